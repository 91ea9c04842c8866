"""DAPO dynamic sampling: a step keeps drawing prompt batches until it has train_batch_size groups whose samples
scored differently, trains on those only, and says how much it generated to get them."""

from __future__ import annotations

import pytest

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
from skyrl_stepwise.inference.pool import EnginePool
from skyrl_stepwise.inference.scripted import ScriptedEngine

# rows "same*" answer yes in every sample (no signal); "mixed*" answer yes in sample 0 and no in sample 1
ROWS = ("same1", "mixed1", "same2", "mixed2", "same3", "same4", "mixed3", "same5")


class YesEnv:
    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        return StepResult([], reward=float("yes" in action_text), done=True)


def _row(name: str):
    from skyrl_stepwise.data.dataset import PromptRow

    return PromptRow(prompt=[{"role": "user", "content": "Is the sky blue?"}], env_class="yes", reward_spec={},
                     data_source="toy", instance_id=name)


def _trainer(tokenizer, tmp_path, dynamic: bool):
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    def script(prompt, session, index):  # session: "<tag>/<row>/<index>_<rep>"
        row, rep = session.split("/")[1], int(session.rsplit("_", 1)[1])
        answer = "no" if row.startswith("mixed") and rep == 1 else "yes"
        return tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]

    cfg = RunConfig(total_steps=2)
    cfg.generator = GeneratorConfig(max_turns=1, max_input_length=512, n_samples_per_prompt=2, show_progress=False,
                                    sampling=GeneratorSamplingConfig(max_generate_length=8))
    cfg.data.train_batch_size, cfg.data.shuffle = 2, False
    cfg.trainer.algorithm.dynamic_sampling, cfg.trainer.algorithm.max_sample_batches = dynamic, 3
    registry = EnvRegistry()
    registry.register("yes", YesEnv)
    engine = EnginePool([ScriptedEngine(script, tokenizer)])
    return RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                     StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine, None, None,
                     Tracker(tmp_path, "p", "r", "disabled", {}), [_row(r) for r in ROWS], [], [1])


def _groups(batch) -> list[str]:
    return sorted({iid.split("/")[1] for iid in batch.instance_ids})


async def test_dynamic_sampling_draws_until_enough_groups_have_signal_and_trains_only_those(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, dynamic=True)
    output, batch, metrics, prompts = await trainer.sample()
    # draw 0: same1 mixed1 (1 with signal), draw 1: same2 mixed2 (2 with signal): stop, same* dropped
    assert prompts == ["same1", "mixed1", "same2", "mixed2"]
    assert _groups(batch) == ["mixed1", "mixed2"] and len(batch) == 4
    assert all(any(a[0] > 0 for a in batch.advantages[i:i + 2]) for i in (0, 2))  # GRPO within each group
    assert metrics == {"advantages/groups_with_signal": 2.0, "advantages/groups_with_signal_frac": 1.0,
                       "dynamic_sampling/draws": 2.0, "dynamic_sampling/generated_groups": 4.0,
                       "dynamic_sampling/generated_signal_frac": 0.5,
                       # step-level credit (algorithms/credit.py) of the 4 trained one-turn steps
                       "credit/steps": 4.0, "credit/reward_turn0": 0.75, "credit/advantage_turn0": 0.0,
                       "credit/sign_flip_frac": 0.0}
    assert len(output) == 8  # every generated sample is reported (reward metrics cover all of them)

    trainer.step = 1  # data position = step * max_sample_batches + draw: step 1 starts at batch 3 (rows 6, 7)
    _, batch, metrics, prompts = await trainer.sample()
    assert prompts == ["mixed3", "same5", "same1", "mixed1"]  # batch 4 wraps around the 8 rows
    assert _groups(batch) == ["mixed1", "mixed3"] and metrics["dynamic_sampling/draws"] == 2.0


async def test_draws_generated_at_once_train_exactly_what_one_after_another_trains(tokenizer, tmp_path):
    one_by_one = _trainer(tokenizer, tmp_path, dynamic=True)
    at_once = _trainer(tokenizer, tmp_path / "at_once", dynamic=True)
    at_once.cfg.trainer.algorithm.draws_at_once = 3  # all 3 draws in one go; the step needs only the first 2
    requested = []
    script = at_once.engine.engines[0].script
    at_once.engine.engines[0].script = lambda prompt, session, index: requested.append(session) or script(
        prompt, session, index)
    for step in (0, 1):
        one_by_one.step = at_once.step = step
        output, batch, metrics, prompts = await one_by_one.sample()
        output_3, batch_3, metrics_3, prompts_3 = await at_once.sample()
        assert prompts_3 == prompts and len(output_3) == len(output) == 8
        assert batch_3.instance_ids == batch.instance_ids and batch_3.response_ids == batch.response_ids
        assert batch_3.advantages == batch.advantages
        assert metrics_3 == {**metrics, "dynamic_sampling/draws_not_needed": 1.0}
    # the third draw of each step was generated (with the first two), then not trained
    assert {s.split("/")[0] for s in requested} == {"train0", "train0.1", "train0.2", "train1", "train1.1", "train1.2"}


async def test_dynamic_sampling_out_of_draws_trains_the_groups_it_found(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, dynamic=True)
    trainer.cfg.trainer.algorithm.max_sample_batches = 1
    _, batch, metrics, prompts = await trainer.sample()
    assert prompts == ["same1", "mixed1"] and _groups(batch) == ["mixed1"]
    assert metrics["dynamic_sampling/draws"] == 1.0 and metrics["advantages/groups_with_signal"] == 1.0


async def test_without_dynamic_sampling_every_group_is_trained_and_counted(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, dynamic=False)
    _, batch, metrics, prompts = await trainer.sample()
    assert prompts == ["same1", "mixed1"] and _groups(batch) == ["mixed1", "same1"]
    assert metrics == {"advantages/groups_with_signal": 1.0, "advantages/groups_with_signal_frac": 0.5,
                       "credit/steps": 4.0, "credit/reward_turn0": 0.75, "credit/advantage_turn0": 0.0,
                       "credit/sign_flip_frac": 0.0}


def test_max_sample_batches_is_validated():
    from skyrl_stepwise.policy.config import AlgorithmConfig

    with pytest.raises(ValueError, match="trainer.algorithm.max_sample_batches must be >= 1, got 0"):
        AlgorithmConfig(max_sample_batches=0).validate()
    with pytest.raises(ValueError, match="trainer.algorithm.draws_at_once must be >= 1, got 0"):
        AlgorithmConfig(draws_at_once=0).validate()


def test_the_report_says_what_dynamic_sampling_generated_to_find_its_groups():
    from skyrl_stepwise.run.report import learning_summary

    history = [{"advantages/groups_with_signal": 4.0, "advantages/groups_with_signal_frac": 1.0,
                "dynamic_sampling/draws": d, "dynamic_sampling/generated_groups": 4.0 * d,
                "dynamic_sampling/generated_signal_frac": f} for d, f in ((2.0, 0.5), (1.0, 1.0))]
    assert learning_summary(history) == (
        "2 of 2 RL steps had non-zero advantages; 2 had reward variance in at least half of their prompt groups. "
        "Dynamic sampling kept only groups with variance: 3 prompt batches drawn for 2 steps, 8 of 12 generated "
        "groups (67%) had variance.")
    history[1]["dynamic_sampling/draws_not_needed"] = 1.0  # draws_at_once=2: its second draw was not needed
    assert learning_summary(history).endswith(
        "8 of 12 generated groups (67%) had variance. Draws generated with those and not needed (draws_at_once), "
        "never trained: 1.")


def test_dynamic_sampling_with_one_sample_per_prompt_is_refused_at_startup():
    """One-sample groups never score differently: every step would be skipped and nothing trained."""
    from skyrl_stepwise.run.config import RunConfig

    cfg = RunConfig()
    cfg.trainer.algorithm.dynamic_sampling, cfg.generator.n_samples_per_prompt = True, 1
    with pytest.raises(ValueError, match=r"generator.n_samples_per_prompt=1 .*trainer.algorithm.dynamic_sampling"):
        cfg.validate()
    cfg.generator.n_samples_per_prompt = 2
    cfg.validate()


class SlowYesEnv:
    """"yes" scores 1 and ends the episode; anything else earns 0 and asks again."""

    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        if "yes" in action_text:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "Try again."}], reward=0.0, done=False)


def _discounted_trainer(tokenizer, tmp_path, dynamic: bool):
    """Rows "same*": both samples answer yes at once. Row "late": sample 0 answers yes at once, sample 1 only on its
    second turn, so both score 1 in total but gamma < 1 gives their steps different advantages."""
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    def script(prompt, session, index):
        row, rep = session.split("/")[1], int(session.rsplit("_", 1)[1])
        answer = "no" if row == "late" and rep == 1 and index == 0 else "yes"
        return tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]

    cfg = RunConfig(total_steps=1)
    cfg.generator = GeneratorConfig(max_turns=2, max_input_length=512, n_samples_per_prompt=2, show_progress=False,
                                    sampling=GeneratorSamplingConfig(max_generate_length=8))
    cfg.data.train_batch_size, cfg.data.shuffle = 1, False
    algo = cfg.trainer.algorithm
    algo.dynamic_sampling, algo.max_sample_batches = dynamic, 3
    algo.step_advantage, algo.gamma = "discounted", 0.9
    registry = EnvRegistry()
    registry.register("yes", SlowYesEnv)
    engine = EnginePool([ScriptedEngine(script, tokenizer)])
    return RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                     StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine, None, None,
                     Tracker(tmp_path, "p", "r", "disabled", {}), [_row(r) for r in ("same1", "late", "same2")],
                     [], [1])


async def test_dynamic_sampling_keeps_a_group_whose_steps_have_advantage_although_its_scores_tie(tokenizer, tmp_path):
    """Signal is a trained token with a non-zero advantage under the configured credit, not distinct trajectory
    scores: with discounting, "late" ties on score (1 and 1) yet its slow sample's steps are below the baseline."""
    trainer = _discounted_trainer(tokenizer, tmp_path, dynamic=True)
    _, batch, metrics, prompts = await trainer.sample()
    assert prompts == ["same1", "late"]  # same1 has no signal; late has, and fills the batch
    assert _groups(batch) == ["late"] and len(batch) == 3  # 1 step + 2 steps
    assert any(abs(a) > 0.01 for adv in batch.advantages for a in adv)
    assert metrics["advantages/groups_with_signal"] == 1.0 and metrics["dynamic_sampling/draws"] == 2.0


async def test_groups_with_signal_counts_per_step_advantages_without_dynamic_sampling(tokenizer, tmp_path):
    trainer = _discounted_trainer(tokenizer, tmp_path, dynamic=False)
    trainer.cfg.data.train_batch_size = 2
    trainer.loader.batch_size = 2
    _, batch, metrics, prompts = await trainer.sample()
    assert prompts == ["same1", "late"] and _groups(batch) == ["late", "same1"]
    assert metrics["advantages/groups_with_signal"] == 1.0 and metrics["advantages/groups_with_signal_frac"] == 0.5


def test_signal_ignores_advantages_on_tokens_that_are_not_trained():
    from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
    from skyrl_stepwise.algorithms.advantages import signal_groups

    output = GeneratorOutput(prompt_token_ids=[[1]] * 4, response_ids=[[2, 3]] * 4, rewards=[0.0] * 4,
                             loss_masks=[[1, 0], [1, 0], [1, 1], [0, 1]],
                             trajectory_ids=[TrajectoryID("a", 0), TrajectoryID("a", 1), TrajectoryID("b", 0),
                                             TrajectoryID("b", 1)])
    assert signal_groups(output, [[0.0, 0.5], [1e-12, -0.5], [0.0, 0.0], [0.0, -0.2]]) == {"a": False, "b": True}
