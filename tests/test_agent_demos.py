"""Warm starts for agent programs (docs/agent-programs.md "A warm start"): demonstrations recorded through the agent
endpoint with a teacher writing the model's turns (loop/agent_demos.py), SFT on them exactly as the endpoint rendered
them, and the calls-per-trajectory metrics that show the before and after. Scripted (teacher) engine, real SmolLM2
tokenizer and chat template; the example agent program (examples/agent_program) runs unchanged over a real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_stepwise.data.dataset import PromptRow, load_prompt_dataset
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig
from skyrl_stepwise.loop.agent_demos import (UnrepresentableDemo, check_representable, record_agent_demos,
                                             sft_samples, write_agent_demos)

pytest.importorskip("openai")
REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "agent_program" / "data" / "train.jsonl"
TEACHER = "examples.agent_program.teacher:teach"


def _cfg(max_tokens: int = 64) -> GeneratorConfig:
    return GeneratorConfig(sampling=GeneratorSamplingConfig(max_generate_length=max_tokens))


def _teach(messages, row):
    from examples.agent_program.teacher import teach

    return teach(messages, row)


def _wrong_on_51(messages, row):
    """The example teacher, but it answers the 17 * 3 row wrong (reward 0) and crashes on the spider row."""
    if "spider" in row["prompt"][-1]["content"]:
        raise RuntimeError("the teacher has no idea")
    reply = _teach(messages, row)
    if messages[-1]["role"] == "tool" and row["reward_spec"]["ground_truth"] == "51":
        return {"role": "assistant", "content": "I do not know."}
    return reply


def _rambling(messages, row):
    """A teacher whose final answer for the moons row is longer than generator.sampling.max_generate_length."""
    reply = _teach(messages, row)
    if messages[-1]["role"] == "tool" and "Mars" in row["prompt"][-1]["content"]:
        return {"role": "assistant", "content": "The answer is 2. " + "Phobos and Deimos orbit Mars. " * 20}
    return reply


def test_recorded_conversations_are_what_the_endpoint_rendered_and_sft_reads_them_back(tokenizer, tmp_path):
    from skyrl_stepwise.data.demonstrations import load_conversation_tools, load_conversations
    from skyrl_stepwise.loop.sft import conversation_samples

    rows = load_prompt_dataset(TRAIN)
    demos = record_agent_demos(tokenizer, rows, _teach, _cfg(), log=lambda line: None)
    assert len(demos.kept) == len(rows) == 4 and all(d.reward == 1.0 and d.calls == 2 for d in demos.kept)
    summary = demos.summary()
    assert summary["calls_per_trajectory_kept"] == {"mean": 2.0, "multi_call_share": 1.0, "histogram": {"2": 4}}
    moons = demos.kept[0]
    assert [m["role"] for m in moons.messages] == ["user", "assistant", "tool", "assistant"]
    assert moons.messages[1]["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"query": "moons mars"}'}
    assert moons.tools is not None and {t["function"]["name"] for t in moons.tools} == {"search", "calculator"}
    assert "Phobos" in moons.messages[2]["content"] and moons.messages[2]["name"] == "search"

    path = write_agent_demos(demos, tmp_path / "demos.parquet")
    conversations, tools = load_conversations(path), load_conversation_tools(path)
    assert conversations == demos.conversations() and tools == demos.tools()
    # the SFT path, from the file: each conversation's samples are exactly the endpoint's step samples (the agent's
    # tools in every prompt, the teacher's calls in the family's format, trained tokens = what the engine sampled)
    output = conversation_samples(tokenizer, conversations, _cfg(), None, tools)
    for i, demo in enumerate(demos.kept):
        assert sft_samples(output, i) == demo.endpoint, demo.trajectory
        [(prompt, response, mask)] = demo.endpoint  # one chain, merged: the user's question, then both calls
        assert "calculator" in tokenizer.decode(prompt) and rows[i].prompt[0]["content"] in tokenizer.decode(prompt)
        trained = tokenizer.decode([t for t, k in zip(response, mask) if k])
        assert "<tool_call>" in trained and f"The answer is {rows[i].reward_spec['ground_truth']}." in trained
        assert "Phobos" not in trained and "Spiders have" not in trained  # tool results are never trained


def test_failed_low_reward_and_cut_trajectories_are_not_kept(tokenizer):
    rows = load_prompt_dataset(TRAIN)
    demos = record_agent_demos(tokenizer, rows, _wrong_on_51, _cfg(), log=lambda line: None)
    by_truth = {r.instance_id: r.reward_spec["ground_truth"] for r in rows}
    kept = {by_truth[d.instance_id] for d in demos.kept}
    assert kept == {"2", "30"}, demos.describe()
    dropped = {by_truth[d.instance_id]: d.dropped for d in demos.demos if d.dropped}
    assert dropped == {"51": "low_reward", "8": "engine_error"}, dropped
    assert demos.summary()["dropped"] == {"engine_error": 1, "low_reward": 1}
    assert all(d.messages == [] for d in demos.demos if d.dropped)  # nothing of a dropped one is written

    cut = record_agent_demos(tokenizer, rows[:1], _rambling, _cfg(max_tokens=64), log=lambda line: None)
    assert [d.dropped for d in cut.demos] == ["length"] and not cut.kept
    with pytest.raises(ValueError, match="no trajectory reached reward >= 1"):
        write_agent_demos(cut, "/nonexistent/demos.parquet")


def test_a_conversation_the_sft_path_renders_otherwise_is_refused_naming_the_trajectory(tokenizer):
    rows = load_prompt_dataset(TRAIN)[:2]
    demos = record_agent_demos(tokenizer, rows, _teach, _cfg(), log=lambda line: None)
    check_representable(tokenizer, _cfg(), demos)  # as recorded: identical
    demos.kept[1].tools = [t for t in demos.kept[1].tools if t["function"]["name"] == "calculator"]
    with pytest.raises(UnrepresentableDemo, match=r"trajectory demo/train-1/1_0: its SFT rendering differs .*prompt"):
        check_representable(tokenizer, _cfg(), demos)


async def _editing_agent(task):
    """Calls twice, but drops its first exchange from the second request (a chain break)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    from examples.agent_program.agent import TOOLS

    first = await client.chat.completions.create(model=task.model, messages=task.messages, tools=TOOLS)
    assert first.choices[0].message.tool_calls
    await client.chat.completions.create(model=task.model, tools=TOOLS, messages=[
        *task.messages, {"role": "user", "content": "Just answer, please."}])
    return 1.0


def test_an_agent_that_edits_its_history_cannot_be_one_sft_conversation(tokenizer):
    [row] = load_prompt_dataset(TRAIN)[:1]
    row = PromptRow(row.prompt, row.env_class, row.reward_spec, row.data_source,
                    {**row.extra_info, "agent": f"{__name__}:_editing_agent"}, row.instance_id)
    with pytest.raises(UnrepresentableDemo, match="call 0 is not a prefix .*chain break"):
        record_agent_demos(tokenizer, [row], _teach, _cfg(), log=lambda line: None)


def _warm_config(tmp_path, *overrides):
    from skyrl_stepwise.run.app_config import load_config

    return load_config(["experiment=agent_program_warm_tiny", f"data.train_path={TRAIN}",
                        f"logging.output_dir={tmp_path / 'run'}", *overrides])


@pytest.mark.integration  # ~2 s quiet (config, tokenizer, recording, SFT samples); more on a loaded box
def test_sft_on_agent_demos_trains_the_endpoint_samples(monkeypatch, tmp_path, model_path):
    """sft.data=agent_demos in a gateway run: the warm start records through the endpoint and trains exactly the
    samples the endpoint recorded (the policy ranks are a stand-in that keeps the batches)."""
    from test_sft_warm_start import _FakePolicyGroup

    from skyrl_stepwise.loop import agent_demos, warm_start
    from skyrl_stepwise.loop.warm_start import sft_model
    from skyrl_stepwise.policy import worker_group

    monkeypatch.setenv("SKYRL_STEPWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(worker_group, "PolicyGroup", _FakePolicyGroup)
    monkeypatch.setattr(warm_start, "model_digest", lambda *a, **k: "smollm2")  # not 0.5 GB of sha256 in a unit test
    step = {"sft/loss": 1.0, "train/grad_norm": 1.0, "sft/entropy": 1.0, "train/lr": 5e-5, "train/step_time_s": 1.0}
    _FakePolicyGroup.instances, _FakePolicyGroup.nats, _FakePolicyGroup.script = [], 1.0, [dict(step)] * 8
    recorded = []
    real = agent_demos.record_agent_demos
    monkeypatch.setattr(agent_demos, "record_agent_demos", lambda *a, **k: recorded.append(real(*a, **k)) or recorded[-1])
    cfg = _warm_config(tmp_path, "sft.epochs=1")
    cfg.trainer.model_path = str(model_path)
    lines = []
    sft_model(cfg, lines.append)
    assert any("4 kept" in line for line in lines), lines
    [policy] = _FakePolicyGroup.instances
    [batch] = [args[0] for method, args in policy.calls if method == "train_step"]  # 4 conversations, one step
    trained = sorted((list(p), list(r), list(m)) for p, r, m in
                     zip(batch.prompt_ids, batch.response_ids, batch.loss_masks))
    endpoint = sorted((list(p), list(r), list(m)) for d in recorded[0].kept for p, r, m in d.endpoint)
    assert trained == endpoint


def test_gateway_sft_data_without_the_agents_tools_is_refused(monkeypatch, tmp_path, model_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from skyrl_stepwise.loop.warm_start import sft_model

    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
    conversation = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "5", "tool_call_id": "call_0"},
                    {"role": "assistant", "content": "5"}]
    data = tmp_path / "demos.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": conversation}]), data)
    monkeypatch.setenv("SKYRL_STEPWISE_CACHE", str(tmp_path / "cache"))
    cfg = _warm_config(tmp_path, f"sft.data={data}")
    cfg.trainer.model_path = str(model_path)
    with pytest.raises(ValueError, match=r"conversations \[0\] call tools but carry no `tools` column"):
        sft_model(cfg, lambda line: None)


def test_agent_demos_config_is_checked_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="sft.agent_demos.teacher"):
        _warm_config(tmp_path, "sft.agent_demos.teacher=null")
    with pytest.raises(ValueError, match="needs gateway.enabled=true"):
        _warm_config(tmp_path, "gateway.enabled=false")
    with pytest.raises(ValueError, match="sft.agent_demos.samples_per_row must be > 0"):
        _warm_config(tmp_path, "sft.agent_demos.samples_per_row=0")


def test_calls_per_trajectory_in_rollouts_evals_and_the_step_line(caplog):
    import asyncio
    import logging

    from skyrl_stepwise.gateway.rollout import call_metrics
    from skyrl_stepwise.generator.agent_loop import StepSample, TrajectoryResult, TrajectoryStats
    from skyrl_stepwise.generator.output import TrajectoryID
    from skyrl_stepwise.loop.evaluation import eval_table
    from skyrl_stepwise.loop.loop import evaluate_prompts
    from skyrl_stepwise.loop.tracking import Tracker

    def result(calls: int, failure: str | None = None) -> TrajectoryResult:
        steps = [StepSample([1], [2], [1], None, 0.0, "stop") for _ in range(calls)]
        return TrajectoryResult(TrajectoryID("a", 0), [] if failure else steps, TrajectoryStats(), failure,
                                partial_steps=steps if failure else [])

    metrics = call_metrics([result(1), result(2), result(3), result(1), result(4, "agent_error")])
    assert metrics == {"gateway/finished_trajectories": 4.0, "gateway/calls_per_trajectory_mean": 7 / 4,
                       "gateway/multi_call_share": 0.5, "gateway/tool_calls_per_trajectory_mean": 0.0,
                       "gateway/calls_per_failed_trajectory_mean": 4.0}
    formats = [result(3), result(2)]  # calls that carried a tool call (the rest: format errors, a final answer)
    formats[0].stats.tool_call_turns, formats[1].stats.tool_call_turns = 0, 1
    assert call_metrics(formats)["gateway/tool_calls_per_trajectory_mean"] == 0.5
    # every trajectory failed (an eval that timed out): the calls were not measured, which is not 0 calls
    none_finished = call_metrics([result(3, "agent_timeout"), result(5, "agent_timeout")])
    assert none_finished == {"gateway/finished_trajectories": 0.0, "gateway/calls_per_failed_trajectory_mean": 4.0}

    class _Generator:  # an agent-program eval: its output carries the gateway's metrics
        async def generate(self, prompts, classes, extras, ids):
            from skyrl_stepwise.generator import GeneratorOutput

            return GeneratorOutput([[1]], [[2]], [[1.0]], [[1]], trajectory_ids=[ids[0]],
                                   rollout_metrics={"gateway/calls_per_trajectory_mean": 2.0,
                                                    "gateway/multi_call_share": 1.0,
                                                    "gateway/tool_calls_per_trajectory_mean": 1.0})

    row = load_prompt_dataset(TRAIN)[0]
    evaluated = asyncio.run(evaluate_prompts(_Generator(), [row], "after SFT"))
    assert (evaluated.calls_per_trajectory, evaluated.multi_call_share) == (2.0, 1.0)
    assert "2.00 calls per trajectory, 100% with >= 2, 1.00 with a tool call" in evaluated.describe()
    assert "| after SFT | 1.000 |" in eval_table([evaluated]) and "| 2.00 | 100% | 1.00 |" in eval_table([evaluated])

    class _FailedGenerator:  # every trajectory failed: no score, no calls counted
        async def generate(self, prompts, classes, extras, ids):
            from skyrl_stepwise.generator import GeneratorOutput

            return GeneratorOutput([], [], [], [], trajectory_ids=[], rollout_metrics=none_finished)

    failed = asyncio.run(evaluate_prompts(_FailedGenerator(), [row], "before SFT"))
    assert (failed.unscored, failed.calls_counted, failed.calls_per_trajectory) == (1, 0, None)
    assert "calls per trajectory not measured: no trajectory finished" in failed.describe()
    assert "0.00 calls" not in failed.describe()
    assert "| before SFT | 0.000 |" in eval_table([failed, evaluated]) and "none finished" in eval_table([failed])

    tracker = Tracker("/tmp/skyrl-agent-demos-test", "p", "r", "disabled", {})
    with caplog.at_level(logging.INFO, logger="skyrl_stepwise"):
        tracker.log({"reward/mean": 1.0, **metrics}, 1)
    assert "calls=1.75 multi_call=0.5" in caplog.text


@pytest.mark.integration  # the Hydra app in-process: config, tokenizer, recording (~2 s quiet)
def test_the_cli_records_and_writes_the_parquet(tmp_path, capsys):
    from skyrl_stepwise.cli import main
    from skyrl_stepwise.data.demonstrations import load_conversation_tools

    out = tmp_path / "demos.parquet"
    assert main(["data", "agent-demos", "--out", str(out), "--teacher", TEACHER, "--max-rows", "2",
                 "experiment=agent_program_tiny", f"data.train_path={TRAIN}"]) == 0
    printed = capsys.readouterr().out
    assert "agent demos: 2/2 trajectories recorded" in printed
    summary = json.loads(printed[printed.index("\n{\n"):printed.rindex("}") + 1])
    assert summary["recorded"] == summary["kept"] == 2 and summary["calls_per_trajectory_kept"]["mean"] == 2.0
    assert len(load_conversation_tools(out)) == 2 and f"sft.data={out}" in printed
