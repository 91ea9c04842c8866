"""Eval intervals: the bootstrap must bracket the mean, shrink with more prompts, and be reproducible."""

from __future__ import annotations

import pytest

from skyrl_stepwise.algorithms.advantages import groups_with_signal
from skyrl_stepwise.loop.evaluation import (bootstrap_interval, eval_result, eval_subset, eval_table, load_evals,
                                              save_evals)
from skyrl_stepwise.generator import TrajectoryID


def test_bootstrap_interval_brackets_the_mean_and_shrinks_with_more_prompts():
    small = [1.0] * 3 + [0.0] * 7
    large = small * 10
    lo_s, hi_s = bootstrap_interval(small)
    lo_l, hi_l = bootstrap_interval(large)
    assert lo_s < 0.3 < hi_s and lo_l < 0.3 < hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 2  # ~1/sqrt(10) of the width
    # the normal approximation for 100 Bernoulli(0.3): 0.3 +- 1.96 * sqrt(0.21 / 100) = [0.210, 0.390]
    assert lo_l == pytest.approx(0.21, abs=0.03) and hi_l == pytest.approx(0.39, abs=0.03)
    assert bootstrap_interval(small) == (lo_s, hi_s)  # seeded


def test_constant_scores_have_a_zero_width_interval():
    assert bootstrap_interval([0.0] * 16) == (0.0, 0.0)
    assert bootstrap_interval([]) == (0.0, 0.0)


def test_stages_round_trip_through_the_run_dir(tmp_path):
    stages = [eval_result("before SFT", [0.0, 0.0, 1.0]),
              eval_result("after SFT", [1.0, 1.0, 0.0], seconds=3.0, sources=["a", "b", "a"])]
    save_evals(tmp_path, stages)
    assert load_evals(tmp_path) == stages
    assert load_evals(tmp_path)[1].sources == ["a", "b", "a"]  # per prompt, so paired differences split by source
    assert load_evals(tmp_path / "missing") == []
    table = eval_table(stages)
    assert "| after SFT | 0.667 |" in table and table.count("\n") == 3
    assert stages[0].describe().startswith("0.333 [0.000, ") and stages[0].describe().endswith("on 3 prompts")


def test_groups_with_signal_counts_groups_whose_scores_differ():
    scores = {TrajectoryID("a", 0): 1.0, TrajectoryID("a", 1): 0.0,
              TrajectoryID("b", 0): 0.0, TrajectoryID("b", 1): 0.0,
              TrajectoryID("c", 0): 1.0}
    assert groups_with_signal(scores) == (1, 3)


def test_eval_subset_is_fixed_and_mixes_sources_of_a_grouped_file():
    rows = ["fanout"] * 72 + ["description"] * 200
    subset = eval_subset(rows, 32, seed=0)
    assert subset == eval_subset(rows, 32, seed=0) and len(subset) == 32
    assert 2 <= subset.count("fanout") <= 20 and subset.count("description") >= 12
    assert eval_subset(rows[:5], 32) == rows[:5]


def test_per_source_means_show_in_the_table_and_the_console_line():
    result = eval_result("after SFT", [1.0, 0.0, 1.0, 1.0], sources=["a", "b", "a", "b"])
    assert result.by_source == {"a": 1.0, "b": 0.5}
    assert result.describe().endswith("on 4 prompts (a 1.000, b 0.500)")
    assert "| after SFT | 0.750 | [" in eval_table([result]) and "| 1.000 | 0.500 |" in eval_table([result])


async def test_eval_scores_every_prompt_even_failed_or_overlong_ones(tokenizer):
    """A prompt whose trajectory failed, or whose first prompt exceeds max_input_length, was left out of the
    mean: stages were compared on different subsets. It now scores 0 and is counted."""
    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.envs.base import EnvRegistry, StepResult
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
    from skyrl_stepwise.inference.scripted import ScriptedEngine
    from skyrl_stepwise.loop.loop import evaluate_prompts

    class OneTurn:
        async def reset(self, prompt_messages, extras):
            if extras["extra_info"].get("crash"):
                raise RuntimeError("env down")
            return list(prompt_messages)

        async def step(self, action_text):
            return StepResult([], reward=1.0, done=True)

    registry = EnvRegistry()
    registry.register("one", OneTurn)
    engine = ScriptedEngine(lambda prompt, session, index: tokenizer.encode("yes", add_special_tokens=False)
                            + [tokenizer.eos_token_id], tokenizer)
    cfg = GeneratorConfig(max_turns=1, max_input_length=64, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=8, temperature=0.0))
    rows = [PromptRow(prompt=[{"role": "user", "content": text}], env_class="one", reward_spec={},
                      data_source="toy", instance_id=f"q{i}", extra_info=extra)
            for i, (text, extra) in enumerate([("Hi?", {}), ("Hi?", {"crash": True}), ("word " * 200, {}),
                                               ("Yo?", {})])]
    result = await evaluate_prompts(StepwiseGenerator(tokenizer, engine, registry, cfg), rows, "after RL")
    assert result.scores == [1.0, 0.0, 0.0, 1.0] and result.num_prompts == 4 and result.unscored == 2
    assert "(2 unscored, counted as 0" in result.describe()
    assert "| 4 (2 unscored) |" in eval_table([result])


async def test_an_eval_keeps_the_env_s_metrics_and_says_where_answers_came_from(tokenizer, tmp_path):
    """The python-tool task asks how many tool calls a trajectory makes and how many answers were read from a run,
    before and after RL: each eval stage keeps the env's `environment/*` means (saved in evals.json) and says so."""
    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.envs.base import EnvRegistry, StepResult
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
    from skyrl_stepwise.inference.scripted import ScriptedEngine
    from skyrl_stepwise.loop.loop import evaluate_prompts

    class Reports:
        async def reset(self, prompt_messages, extras):
            self.row = extras["instance_id"]
            return list(prompt_messages)

        async def step(self, action_text):
            return StepResult([], reward=1.0, done=True, metrics={"tool_calls": 2.0 if self.row == "q0" else 1.0,
                                                                   "answer_from_output": float(self.row == "q0")})

    registry = EnvRegistry()
    registry.register("reports", Reports)
    engine = ScriptedEngine(lambda prompt, session, index: tokenizer.encode("yes", add_special_tokens=False)
                            + [tokenizer.eos_token_id], tokenizer)
    cfg = GeneratorConfig(max_turns=1, max_input_length=64, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=8, temperature=0.0))
    rows = [PromptRow(prompt=[{"role": "user", "content": "Hi?"}], env_class="reports", reward_spec={},
                      data_source="toy", instance_id=f"q{i}") for i in range(2)]
    result = await evaluate_prompts(StepwiseGenerator(tokenizer, engine, registry, cfg), rows, "after RL")
    assert result.env_metrics["environment/tool_calls"] == 1.5
    assert result.env_metrics["environment/answer_from_output"] == 0.5
    assert result.describe().endswith("; 1.50 tool calls per trajectory, 50% of answers from a run's output")
    save_evals(tmp_path, [result])
    assert load_evals(tmp_path)[0].env_metrics == result.env_metrics
    assert "tool calls" not in eval_result("x", [1.0]).describe()  # envs without the metric: the line as it was


def test_the_summary_prints_rl_minus_sft_paired_over_the_same_prompts():
    """The main job's own verdict: RL - SFT on the same prompts with a paired interval, fixed/broken counts; a
    consistent gain that the separate intervals would call overlapping is resolved by pairing."""
    from skyrl_stepwise.loop.evaluation import eval_result, paired_bootstrap, rl_minus_sft

    sft = [1.0] * 30 + [0.0] * 70
    rl = [1.0] * 30 + [1.0] * 12 + [0.0] * 58  # 12 prompts fixed, none broken
    stages = [eval_result("before SFT", [0.0] * 100), eval_result("after SFT", sft),
              eval_result("after RL (step 6)", rl)]
    assert stages[2].ci_low < stages[1].ci_high  # the separate intervals overlap
    diff, low, high = paired_bootstrap(rl, sft)
    assert diff == pytest.approx(0.12) and 0 < low < diff < high
    line = rl_minus_sft(stages)
    assert line.startswith("EM after RL (step 6) - after SFT (paired, 100 prompts): +0.120 [")
    assert "12 prompts fixed, 0 broken: RL beat SFT" in line
    assert "no difference resolved" in rl_minus_sft([stages[1], eval_result("after RL (step 1)", sft)])
    assert rl_minus_sft(stages[:2]) is None  # no RL stage yet
    with pytest.raises(ValueError, match="same prompts"):
        paired_bootstrap(rl[:50], sft)


def test_an_eval_score_is_called_em_only_where_the_env_scores_exact_match(tmp_path):
    """Search-R1's reward is its EM (`environment/em` in the step metrics); a repo fix or HumanEval is scored by its
    hidden tests, which is a reward, not an exact match: the paired line and the report's eval table say which."""
    from skyrl_stepwise.loop.evaluation import eval_result, save_evals, score_label
    from skyrl_stepwise.run.report import evaluation_section

    assert score_label([{"reward/mean": 0.5, "environment/em": 0.5}]) == "EM"
    assert score_label([{"reward/mean": 0.5}]) == score_label([]) == "reward"
    save_evals(tmp_path, [eval_result("after SFT", [0.0, 1.0]), eval_result("after RL (step 2)", [1.0, 1.0])])
    repo_fix = "\n".join(evaluation_section(tmp_path, [{"step": 1, "reward/mean": 0.5}]))
    assert "| stage | reward |" in repo_fix and "**reward after RL (step 2) - after SFT" in repo_fix
    assert "EM" not in repo_fix
    search = "\n".join(evaluation_section(tmp_path, [{"step": 1, "reward/mean": 0.5, "environment/em": 0.5}]))
    assert "| stage | EM |" in search and "**EM after RL (step 2) - after SFT" in search


def test_the_base_model_eval_can_use_the_first_prompts_of_the_fixed_subset(monkeypatch):
    """data.max_base_eval_prompts: the base model's eval takes the first N prompts of the same fixed subset (the later
    stages every prompt; 0: none), and a negative value is refused naming the key."""
    import asyncio

    from skyrl_stepwise.cli.train import EvalStages, load_config

    cfg = load_config(["experiment=search_r1_tiny", "logging.output_dir=/tmp/unused"])
    assert cfg.data.max_eval_prompts == 128 and cfg.data.max_base_eval_prompts == 0  # the main job skips it
    seen = []

    async def fake_evaluate(generator, rows, stage, rollout_log):
        seen.append((stage, list(rows)))
        return None

    monkeypatch.setattr("skyrl_stepwise.loop.loop.evaluate_prompts", fake_evaluate)
    stages = EvalStages(cfg, None, list(range(10)))
    stages.add = lambda result: None
    asyncio.run(stages.run("before SFT", limit=0))  # 0: no eval of the base model at all
    asyncio.run(stages.run("before SFT", limit=3))
    asyncio.run(stages.run("after SFT"))
    assert seen == [("before SFT", [0, 1, 2]), ("after SFT", list(range(10)))]
    cfg.data.max_base_eval_prompts = -1
    with pytest.raises(ValueError, match="data.max_base_eval_prompts"):
        cfg.validate()
