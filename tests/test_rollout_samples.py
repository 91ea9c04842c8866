"""Rollout samples: decoded from the trainer's own ids (scripted engine, real SmolLM2 tokenizer), best and worst of
a group picked, written to rollouts.jsonl, printed by `skyrl-stepwise show` and put into the run report."""

from __future__ import annotations

import json

import pytest
from test_generator import canonical

from skyrl_stepwise.envs.base import EnvRegistry
from skyrl_stepwise.envs.tool import ToolEnvConfig, register_tool_env
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.loop.rollout_samples import RolloutLog, load_rollouts, pick_trajectories

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
PROMPT = [{"role": "user", "content": "What is six times seven?"}]


async def _tool_output(tokenizer, merge: bool):
    """Two samples of one prompt: one calls the calculator then answers 42 (reward 1), one answers 41 at once."""
    eos = tokenizer.eos_token_id
    scripts = {0: [canonical(tokenizer, CALL) + [eos], canonical(tokenizer, "<answer>42</answer>") + [eos]],
               1: [canonical(tokenizer, "<answer>41</answer>") + [eos]]}
    engine = ScriptedEngine(lambda p, s, i: scripts[int(s.rsplit("_", 1)[1])][i], tokenizer)
    registry = EnvRegistry()
    register_tool_env(registry, ToolEnvConfig())
    cfg = GeneratorConfig(max_turns=3, max_input_length=4096, show_progress=False, merge_stepwise_output=merge,
                          sampling=GeneratorSamplingConfig(max_generate_length=64))
    gen = StepwiseGenerator(tokenizer, engine, registry, cfg)
    extras = {"reward_spec": {"ground_truth": {"target": ["42"]}}}
    out = await gen.generate([PROMPT] * 2, ["tool"] * 2, [extras] * 2, [TrajectoryID("q", 0), TrajectoryID("q", 1)])
    return gen, out


@pytest.mark.parametrize("merge", [False, True])
async def test_samples_show_prompt_turns_tool_calls_results_reward_and_stop(tokenizer, tmp_path, merge):
    gen, out = await _tool_output(tokenizer, merge)
    log = RolloutLog(tmp_path, gen.loop.renderer, num_samples=4)
    samples = log.record(out, step=3, stage="train")
    assert [(s.trajectory, s.pick, s.reward) for s in samples] == [("q_0", "best", 1.0), ("q_1", "worst", 0.0)]
    best = samples[0]
    roles = [seg.role for seg in best.segments]
    assert roles == ["prompt", "model", "env", "model"], roles  # merged or step-wise: the same story
    assert "six times seven" in best.prompt and best.turns == 2 and best.stop_reason == "stop"
    assert best.segments[1].tool_calls == [{"name": "calculator", "arguments": {"expression": "6*7"}, "verdict": "ok"}]
    assert "42" in best.segments[2].text  # the calculator's result, as the model read it
    assert "<answer>42</answer>" in best.segments[3].text
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["trajectory"] for r in lines] == ["q_0", "q_1"] and lines[0]["step"] == 3
    log.rewind(2)  # a resumed run redoes step 3
    assert load_rollouts(tmp_path) == []


def test_picks_best_and_worst_of_each_group_first():
    ids = {TrajectoryID(g, r): float(s) for g, scores in (("a", [0, 1, 0]), ("b", [1, 1]), ("c", [0, 2]))
           for r, s in enumerate(scores)}
    picked = [(t.key(), why) for t, why in pick_trajectories(ids, 4)]
    assert picked == [("a_1", "best"), ("a_0", "worst"), ("b_0", "tied"), ("c_1", "best")]


async def test_show_prints_a_step_and_the_report_has_the_section(tokenizer, tmp_path, capsys):
    from skyrl_stepwise.run.report import rollouts_section
    from skyrl_stepwise.cli.show import main

    gen, out = await _tool_output(tokenizer, merge=True)
    log = RolloutLog(tmp_path, gen.loop.renderer, num_samples=2)
    log.record(out, 1, "train")
    log.record(out, 1, "eval step 1")
    assert main([str(tmp_path), "--step", "1", "--stage", "train"]) == 0
    shown = capsys.readouterr().out
    assert "step 1 train | q_0 (best) | reward 1" in shown and 'tool call calculator({"expression": "6*7"})' in shown
    assert "eval step 1" not in shown
    assert main([str(tmp_path), "--step", "7"]) == 1
    section = "\n".join(rollouts_section(tmp_path))
    assert "### last training step (train, step 1)" in section and "### last eval (eval step 1, step 1)" in section
    assert "tool call calculator" in section


def test_the_parsers_verdict_tells_malformed_from_an_unknown_tool():
    from skyrl_stepwise.loop.rollout_samples import call_verdict

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    assert call_verdict(None, "calculator", tools) == "ok"
    assert call_verdict(None, "search", tools) == "unknown tool"  # read fine, but the run has no such tool
    assert call_verdict("ToolCallParseStatus.UNKNOWN_TOOL", "search", tools) == "unknown tool"  # the parser's own
    assert call_verdict("invalid_json", None, tools) == "malformed"
    assert call_verdict(None, "anything", None) == "ok"  # no tool list: a readable call is not judged unknown


def test_a_tamper_suspected_trajectory_is_flagged_in_rollouts_and_show(tmp_path, capsys):
    from skyrl_stepwise.cli.show import main
    from skyrl_stepwise.envs.base import TAMPER_METRIC
    from skyrl_stepwise.generator.agent_loop import StepSample, TrajectoryResult, TrajectoryStats
    from skyrl_stepwise.generator.generator import steps_to_output

    def result(rep: int, tamper: float) -> TrajectoryResult:
        step = StepSample([1, 2], [3, 4], [1, 1], [-0.1, -0.2], float(rep), "stop")
        return TrajectoryResult(TrajectoryID("g", rep), [step], TrajectoryStats(env_metrics={TAMPER_METRIC: tamper}))

    out = steps_to_output([result(0, 0.0), result(1, 1.0)])
    assert out.tamper_suspected == ["g_1"]  # which episode the grading suspected, not only the batch's fraction

    class Decode:
        def decode(self, ids):
            return " ".join(map(str, ids))

    samples = RolloutLog(tmp_path, Decode(), num_samples=4).record(out, 1, "train")
    assert {s.trajectory: s.tamper_suspected for s in samples} == {"g_0": False, "g_1": True}
    assert main([str(tmp_path), "--step", "1"]) == 0
    shown = capsys.readouterr().out.split("--- ")
    assert ["TAMPER SUSPECTED" in block for block in shown[1:]] == [True, False]  # g_1 (best) first, g_0 clean
