"""Sharing a GPU between the trainer and the engines: who gives memory back when, and in which order.

The GPU calls themselves (vLLM's sleep mode, moving FSDP2 shards to the host) cannot run on this CPU box; these
tests pin the order of the calls and the engine's sleep/wake state machine against vLLM's real method names.
"""

from __future__ import annotations

import asyncio

import pytest

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.inference.scripted import ScriptedEngine


class OneTurnEnv:
    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        return StepResult([], reward=float("yes" in action_text), done=True)


class RecordingPolicy:
    """PolicyGroup's interface: logs every method and answers with plausible shapes."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def call(self, method: str, *args):
        self.log.append(f"policy.{method}")
        if method == "compute_logprobs":
            return [[-0.5] * len(ids) for ids in args[0].response_ids]
        if method == "train_step":
            return {"policy/loss": 0.0, "train/real_tokens": 4.0, "train/packed_tokens": 4.0,
                    "train/padded_batch_tokens": 4.0}
        if method == "offload_to_host":
            return 3 * 2**30
        return None


class RecordingEngine(ScriptedEngine):
    def __init__(self, log: list[str], *args) -> None:
        super().__init__(*args)
        self.log = log

    async def generate(self, *args, **kwargs):
        if not self.log or self.log[-1] != "engine.generate":
            self.log.append("engine.generate")
        return await super().generate(*args, **kwargs)

    async def release_memory(self) -> int:
        self.log.append("engine.release_memory")
        return 2**30


class RecordingSync:
    method = "recorded"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def sync(self) -> int:
        self.log.append("weight_sync")
        return 0


def _step_log(tokenizer, tmp_path, offload: bool) -> tuple[list[str], dict]:
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    log: list[str] = []
    cfg = RunConfig(total_steps=1)
    cfg.generator = GeneratorConfig(max_turns=1, max_input_length=512, n_samples_per_prompt=2, show_progress=False,
                                    sampling=GeneratorSamplingConfig(max_generate_length=8))
    cfg.data.train_batch_size = 2
    cfg.trainer.algorithm.use_kl_loss = False
    cfg.trainer.fsdp.offload_during_rollout = offload
    registry = EnvRegistry()
    registry.register("one", OneTurnEnv)
    answer = tokenizer.encode("yes", add_special_tokens=False) + [tokenizer.eos_token_id]
    engine = RecordingEngine(log, lambda prompt, session, index: answer, tokenizer)
    rows = [PromptRow(prompt=[{"role": "user", "content": f"Question {i}?"}], env_class="one", reward_spec={},
                      data_source="toy", instance_id=f"q{i}") for i in range(2)]
    trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                        StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine,
                        RecordingPolicy(log), None, Tracker(tmp_path, "p", "r", "disabled", {}), rows, [], [1, 2],
                        RecordingSync(log))
    metrics = asyncio.run(trainer.train_step())
    return log, metrics


def test_the_trainer_is_offloaded_while_the_engines_generate_and_loaded_after_they_release(tokenizer, tmp_path):
    log, metrics = _step_log(tokenizer, tmp_path, offload=True)
    assert log == ["policy.offload_to_host", "engine.generate",  # rollouts in the trainer's memory
                   "engine.release_memory", "policy.load_to_device",  # never both resident at once
                   "policy.train_step", "weight_sync",
                   "engine.generate", "policy.compute_logprobs"]  # the probe, with the trainer still loaded
    assert metrics["memory/trainer_offloaded_gib"] == 3.0 and metrics["memory/engine_released_gib"] == 1.0


def test_without_offload_the_trainer_stays_put(tokenizer, tmp_path):
    log, metrics = _step_log(tokenizer, tmp_path, offload=False)
    assert "policy.offload_to_host" not in log and "policy.load_to_device" not in log
    assert log[:3] == ["engine.generate", "engine.release_memory", "policy.train_step"]
    assert "memory/trainer_offloaded_gib" not in metrics


class FakeAsyncLLM:
    """The AsyncLLM methods VLLMWorker's sleep path uses, recording each call."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.sleeping = log, set()

        class Outputs:
            @staticmethod
            def has_unfinished_requests() -> bool:
                return False

        self.output_processor = Outputs()

    async def sleep(self, level: int = 1) -> None:
        self.log.append(f"sleep({level})")
        self.sleeping = {"weights", "kv_cache"}

    async def wake_up(self, tags=None) -> bool:
        self.log.append(f"wake_up({tags})")
        self.sleeping -= set(tags or self.sleeping)
        return not self.sleeping

    async def reset_prefix_cache(self) -> None:
        self.log.append("reset_prefix_cache")

    async def collective_rpc(self, method: str, args=()) -> list:
        self.log.append(method)
        return [0]


@pytest.fixture
def sleepy_worker(monkeypatch):
    """A VLLMWorker around FakeAsyncLLM, as on a GPU with engine.sleep_during_update=true."""
    import torch

    from skyrl_stepwise.inference import vllm_engine

    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: True)
    free = iter([10 * 2**30, 14 * 2**30])
    monkeypatch.setattr(vllm_engine.torch.cuda, "mem_get_info", lambda: (next(free), 80 * 2**30))
    worker = object.__new__(vllm_engine.VLLMWorker)
    log: list[str] = []
    worker.engine, worker.sleep_mode, worker.asleep, worker._wake_lock = FakeAsyncLLM(log), True, False, asyncio.Lock()
    # what __init__ sets beside the engine: no LoRA adapters loaded (a full reload forgets them)
    worker.adapters, worker.active_adapter, worker.adapter_folders = {}, None, vllm_engine.AdapterFolders()
    assert torch.cuda.is_available()
    return worker, log


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_fake_uses_vllms_own_method_names():
    from vllm.v1.engine.async_llm import AsyncLLM

    for name in ("sleep", "wake_up", "reset_prefix_cache", "collective_rpc"):
        assert hasattr(AsyncLLM, name) and hasattr(FakeAsyncLLM, name), name


def test_a_sleeping_engine_wakes_its_weights_for_the_sync_then_its_cache(sleepy_worker):
    worker, log = sleepy_worker

    async def cycle():
        released = await worker.release_memory()
        assert released == 4 * 2**30 and worker.asleep
        assert await worker.release_memory() == 0  # asleep already: nothing more to give
        await worker.update_weights_from_file("/dev/shm/w.safetensors")

    asyncio.run(cycle())
    assert log == ["reset_prefix_cache", "sleep(1)",
                   "wake_up(['weights'])", "reload_weights_from_file", "reset_prefix_cache", "wake_up(['kv_cache'])"]
    assert not worker.asleep


def test_concurrent_rollouts_wake_a_sleeping_engine_fully_and_once(sleepy_worker):
    worker, log = sleepy_worker

    async def release_then_wake():
        await worker.release_memory()
        log.clear()
        await asyncio.gather(*(worker._wake(None) for _ in range(3)))  # what generate() does when asleep

    asyncio.run(release_then_wake())
    assert log == ["wake_up(None)"] and not worker.asleep
