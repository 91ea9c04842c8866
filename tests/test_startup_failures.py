"""Every component that fails to start is named with its root cause (startup_failures.py): the component's own
exception text, not Ray's ActorDiedError or vLLM's "See root cause above"; the traceback stays in run.log."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

from skyrl_stepwise.host.logs import run_logging
from skyrl_stepwise.run.startup_failures import LogMark, StartupFailure, ray_worker_output, root_cause, starting

VLLM_ROOT_CAUSE = ("ValueError: Available memory on node 0 (6.46/9.46 GiB) on kv cache allocation is less than "
                   "requested memory for kv (9.19 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, "
                   "or reduce CPU memory used by other processes.")


def _vllm_like_log(path):
    path.write_text("2026-11-27 01:00:00 INFO [pid 7] vllm: loading weights\n"
                    "2026-11-27 01:00:03 ERROR [pid 7] vllm.v1.engine.core: EngineCore failed to start.\n"
                    "Traceback (most recent call last):\n  File \"core.py\", line 1, in run\n"
                    f"    raise ValueError(...)\n{VLLM_ROOT_CAUSE}\n"
                    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")


def test_the_cause_in_run_log_wins_over_the_wrapper_that_reached_the_driver(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("an earlier component's line\nKeyError: 'not this one'\n")
    mark = LogMark.now(log)
    with open(log, "a") as f:
        f.write("")
    _vllm_like_log(tmp_path / "part")
    with open(log, "a") as f:
        f.write((tmp_path / "part").read_text())
    wrapper = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    assert root_cause(wrapper, mark) == VLLM_ROOT_CAUSE


def test_a_chained_cause_is_found_without_the_log():
    try:
        try:
            open("/nonexistent/model/config.json")
        except OSError as inner:
            raise RuntimeError("Engine core initialization failed. See root cause above.") from inner
    except RuntimeError as outer:
        error = outer
    assert root_cause(error).startswith("FileNotFoundError: [Errno 2] No such file or directory")


def test_an_oom_kill_names_the_kill():
    error = RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: PolicyWorker\n"
                         "Worker exit detail: Task was killed due to the node running low on memory.")
    assert root_cause(error) == "Task was killed due to the node running low on memory."


def test_a_coloured_ray_error_is_read_in_the_named_workers_own_log_file(tmp_path, monkeypatch):
    """A Ray started before the run (a user's cluster, a test session) routes no worker output into run.log, and
    its log_to_driver copy arrives after the exception: the worker's own file under Ray's logs folder has it."""
    import skyrl_stepwise.run.startup_failures as sf

    _vllm_like_log(tmp_path / "worker-0a1b-01000000-30051.err")
    (tmp_path / "worker-0a1b-01000000-30052.err").write_text("KeyError: 'another worker, not this one'\n")
    monkeypatch.setattr(sf, "ray_logs_dir", lambda: tmp_path)
    error = RuntimeError("The actor died because of an error raised in its creation task, \x1b[36mray::VLLMWorker"
                         ".__init__()\x1b[39m (pid=30051, ip=10.0.0.2, actor_id=ef49ad8b)")
    assert root_cause(error, LogMark.now(tmp_path / "run.log")) == VLLM_ROOT_CAUSE
    assert ray_worker_output(["no pid named"], tmp_path) == ""
    colored = RuntimeError("The actor died because of an error raised in its creation task, \x1b[36mray::W.__init__()"
                           "\x1b[39m\n\x1b[36m(W pid=7)\x1b[0m OSError: no config.json in /models/x")
    assert root_cause(colored) == "OSError: no config.json in /models/x"


class _EngineLike:
    """Starts like vLLM on a refused KV cache: the real error printed, a generic one raised."""

    def __init__(self) -> None:
        print("Traceback (most recent call last):\n" + VLLM_ROOT_CAUSE, file=sys.stderr, flush=True)
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")

    def ready(self) -> bool:
        return True


def _descendants() -> list:
    import psutil

    return psutil.Process().children(recursive=True)


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:  # ended since it was listed
        return []


@pytest.mark.integration
@pytest.mark.before_any_ray  # a session Ray left by an earlier test would make it skip (tests/conftest.py)
def test_a_ray_actor_that_dies_in_its_creation_task_is_named_with_its_own_error(tmp_path):
    """Through Ray as the run starts it (its workers' output routed into run.log): ActorDiedError on the driver,
    the component's ValueError in the message."""
    import ray

    from skyrl_stepwise.inference.vllm_engine import ensure_ray

    if ray.is_initialized():
        pytest.skip("needs a Ray started inside the run's logging (a session Ray routes no output to run.log)")
    with run_logging(tmp_path, console_level="WARNING"):
        ensure_ray()
        try:
            with pytest.raises(StartupFailure) as failed, starting("the vllm engine"):
                tests_dir = str(Path(__file__).parent)  # the worker imports this module to build the actor
                actor = ray.remote(num_cpus=0)(_EngineLike).options(
                    runtime_env={"env_vars": {"PYTHONPATH": tests_dir}}).remote()
                ray.get(actor.ready.remote())
            # the run's Ray prestarts no workers: each of ours has a runtime env of its own, so none would be used
            assert not [p for p in _descendants() if " ".join(_cmdline(p)).startswith("ray::IDLE")]
        finally:
            ray.shutdown()
    message = str(failed.value)
    assert message.startswith("the vllm engine failed to start: ValueError: Available memory on node 0")
    assert "engine.cpu_kvcache_gib" in message and "ActorDiedError" not in message
    assert type(failed.value.__cause__).__name__ in ("ActorDiedError", "RayActorError")


@pytest.mark.integration
def test_an_actor_dying_on_a_ray_started_before_the_run_is_named_with_its_own_error(tmp_path):
    """The CI case: Ray was up before the run's logging began, so the worker's output never reaches run.log."""
    import ray

    from skyrl_stepwise.inference.vllm_engine import ensure_ray

    owns_ray = not ray.is_initialized()
    ensure_ray()  # outside run_logging: no output routing
    try:
        with run_logging(tmp_path, console_level="WARNING"):
            with pytest.raises(StartupFailure) as failed, starting("the vllm engine"):
                tests_dir = str(Path(__file__).parent)
                actor = ray.remote(num_cpus=0)(_EngineLike).options(
                    runtime_env={"env_vars": {"PYTHONPATH": tests_dir}}).remote()
                ray.get(actor.ready.remote())
    finally:
        if owns_ray:
            ray.shutdown()
    assert "ValueError: Available memory on node 0" not in (tmp_path / "run.log").read_text()  # truly unrouted
    assert str(failed.value).startswith("the vllm engine failed to start: ValueError: Available memory on node 0")


@pytest.mark.integration
def test_the_vllm_engine_refusing_its_kv_cache_names_vllms_own_error(tiny_smollm2, tmp_path):
    """The issue's failure, for real: an explicit cache larger than the host gives the engine. vLLM's own check,
    whatever the weights: SmolLM2's tiny twin loads in a fraction of the time."""
    model_path = tiny_smollm2
    import ray

    from skyrl_stepwise.inference import create_engine
    from skyrl_stepwise.inference.config import EngineConfig

    cfg = EngineConfig(backend="vllm", model_path=str(model_path), dtype="float32", max_model_len=512,
                       cpu_kvcache_gib=4096)
    owns_ray = not ray.is_initialized()
    with run_logging(tmp_path, console_level="WARNING"):
        try:
            with pytest.raises(StartupFailure) as failed, starting("the vllm engine"):
                create_engine(cfg)
        finally:
            if owns_ray:
                ray.shutdown()
    assert "the vllm engine failed to start: ValueError: " in str(failed.value)
    assert "requested memory for kv" in str(failed.value) and "engine.cpu_kvcache_gib" in str(failed.value)


@pytest.mark.integration
def test_policy_ranks_without_weights_name_the_missing_file(tmp_path):
    import ray
    from transformers import LlamaConfig

    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.worker_group import PolicyGroup

    model_dir = tmp_path / "no_weights"
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(model_dir)  # a config, no weights
    owns_ray = not ray.is_initialized()
    with run_logging(tmp_path / "run", console_level="WARNING"):
        try:
            with pytest.raises(StartupFailure) as failed, starting("the policy ranks (1 FSDP2)"):
                PolicyGroup(TrainerConfig(model_path=str(model_dir)))
        finally:
            if owns_ray:
                ray.shutdown()
    message = str(failed.value)
    assert message.startswith("the policy ranks (1 FSDP2) failed to start: OSError: ") and "no_weights" in message
    assert "ActorDiedError" not in message


def test_a_retriever_that_crashes_is_named_with_its_own_error(tmp_path):
    from skyrl_stepwise.retrieval.launch import local_retriever

    missing = tmp_path / "no_such_corpus.jsonl"
    with run_logging(tmp_path, console_level="WARNING") as run_log:
        from skyrl_stepwise.host.logs import children_output_to

        with pytest.raises(StartupFailure) as failed, starting("the local retriever"), children_output_to(run_log):
            with local_retriever(str(missing), "bm25", timeout_s=120):
                pass
    message = str(failed.value)
    assert message.startswith("the local retriever failed to start: FileNotFoundError")
    assert "no_such_corpus.jsonl" in message and "exited with code" not in message


def test_a_gateway_on_a_taken_port_says_so(tokenizer, tmp_path):
    from skyrl_stepwise.gateway.config import GatewayConfig
    from skyrl_stepwise.gateway.rollout import AgentServer
    from skyrl_stepwise.gateway.service import Gateway
    from skyrl_stepwise.generator.config import GeneratorConfig
    from skyrl_stepwise.inference.scripted import ScriptedEngine

    async def start(port):
        gateway = Gateway(tokenizer, ScriptedEngine([], tokenizer), GeneratorConfig(), GatewayConfig(port=port))
        with starting("the agent endpoint (gateway)"):
            await AgentServer(gateway).__aenter__()

    with socket.socket() as taken, run_logging(tmp_path, console_level="CRITICAL"):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupFailure) as failed:
            asyncio.run(start(port))
    message = str(failed.value)
    assert message.startswith("the agent endpoint (gateway) failed to start: OSError: ")
    assert f"cannot listen on gateway.host='127.0.0.1', gateway.port={port}" in message
    assert "address already in use" in message.lower()
    assert "SystemExit" not in message


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_console_line_and_report_name_the_root_cause(tmp_path, capsys, monkeypatch):
    """Through the main job's entry point: the engine fails to start; one console line names vLLM's error."""
    from skyrl_stepwise.run import setup as run_setup
    from skyrl_stepwise.cli import train

    def fail_to_start(*args, **kwargs):  # as a Ray worker does: its output goes to run.log
        from skyrl_stepwise.host.logs import active_run_log

        with open(active_run_log(), "a") as log:
            log.write("Traceback (most recent call last):\n" + VLLM_ROOT_CAUSE + "\n")
        raise RuntimeError("Engine core initialization failed. See root cause above.")

    monkeypatch.setattr(run_setup, "plan_resources", lambda *a: None)
    monkeypatch.setattr("skyrl_stepwise.inference.create_engine", fail_to_start)
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        train.main(["experiment=search_r1_tiny", f"logging.output_dir={out}", "logging.wandb_mode=disabled",
                    "engine.backend=transformers", "environment.retriever.start_local=false", "sft.enabled=false"])
    printed = capsys.readouterr()
    console = printed.out + printed.err
    assert "failed before step 1: the transformers engine failed to start: ValueError: Available memory" in console
    assert "Traceback" not in console
    assert "ValueError: Available memory on node 0" in (out / "report.md").read_text()
    assert "the run stopped on this error:" in (out / "run.log").read_text()
