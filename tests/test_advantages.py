"""Outcome advantages: per trajectory, grouped by prompt, broadcast to every step's loss-masked tokens."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest

from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.trainer.advantages import compute_advantages, group_advantages, trajectory_scores
from skyrl_stepwise.trainer.config import AlgorithmConfig


@dataclass
class Traj:
    """A multi-turn trajectory as one token chain: prompt, then (response, observation) per turn."""

    tid: TrajectoryID
    prompt: list[int]
    responses: list[list[int]]
    observations: list[list[int]]  # after each turn but the last
    step_rewards: list[float]  # reward of each step, put on the step's last response token
    masks: list[list[int]] | None = None  # per-response loss masks; default all 1
    logprobs: list[list[float]] | None = None  # per-response rollout logprobs

    def mask(self, i: int) -> list[int]:
        return self.masks[i] if self.masks else [1] * len(self.responses[i])

    def logprob(self, i: int) -> list[float]:
        return self.logprobs[i] if self.logprobs else [-1.0] * len(self.responses[i])

    def reward(self, i: int) -> list[float]:
        return [0.0] * (len(self.responses[i]) - 1) + [self.step_rewards[i]]


def stepwise_output(trajs: list[Traj]) -> GeneratorOutput:
    """One sample per turn; turn i's prompt is the whole chain before its response (exact history)."""
    cols: dict[str, list] = {k: [] for k in ("p", "r", "rw", "m", "lp", "tid", "last")}
    for t in trajs:
        history = list(t.prompt)
        for i, resp in enumerate(t.responses):
            for k, v in zip(cols, (list(history), resp, t.reward(i), t.mask(i), t.logprob(i), t.tid,
                                   i == len(t.responses) - 1)):
                cols[k].append(v)
            history += resp + (t.observations[i] if i < len(t.observations) else [])
    out = GeneratorOutput(prompt_token_ids=cols["p"], response_ids=cols["r"], rewards=cols["rw"],
                          loss_masks=cols["m"], rollout_logprobs=cols["lp"], trajectory_ids=cols["tid"],
                          is_last_step=cols["last"])
    out.validate()
    return out


def whole_output(trajs: list[Traj]) -> GeneratorOutput:
    """One sample per trajectory, built by hand: observations are in the response with loss mask 0."""
    cols: dict[str, list] = {k: [] for k in ("r", "rw", "m", "lp")}
    for t in trajs:
        r, rw, m, lp = [], [], [], []
        for i, resp in enumerate(t.responses):
            obs = t.observations[i] if i < len(t.observations) else []
            r += resp + obs
            rw += t.reward(i) + [0.0] * len(obs)
            m += t.mask(i) + [0] * len(obs)
            lp += t.logprob(i) + [0.0] * len(obs)
        for k, v in zip(cols, (r, rw, m, lp)):
            cols[k].append(v)
    return GeneratorOutput(prompt_token_ids=[t.prompt for t in trajs], response_ids=cols["r"], rewards=cols["rw"],
                           loss_masks=cols["m"], rollout_logprobs=cols["lp"],
                           trajectory_ids=[t.tid for t in trajs], is_last_step=[True] * len(trajs))


def masked_token_advantages(output: GeneratorOutput, adv: list[list[float]]) -> dict[TrajectoryID, list]:
    """(token, advantage) of every loss-masked token of each trajectory, in chain order."""
    seen: dict[TrajectoryID, list] = {}
    for tid, resp, mask, a in zip(output.trajectory_ids, output.response_ids, output.loss_masks, adv):
        seen.setdefault(tid, []).extend((tok, round(x, 9)) for tok, m, x in zip(resp, mask, a) if m)
    return seen


def sample_trajs() -> list[Traj]:
    """Two prompts; trajectories of 1, 2 and 3 turns in one group; a masked token in one response."""
    q1, q2 = "q1", "q2"
    return [
        Traj(TrajectoryID(q1, 0), [1, 2, 3], [[10, 11], [12, 13, 14], [15]], [[90, 91], [92]], [0.0, 0.0, 1.0]),
        Traj(TrajectoryID(q1, 1), [1, 2, 3], [[20, 21, 22]], [], [0.0]),
        Traj(TrajectoryID(q1, 2), [1, 2, 3], [[30], [31, 32]], [[93, 94, 95]], [0.2, 0.3],
             masks=[[1], [1, 0]]),
        Traj(TrajectoryID(q2, 0), [4, 5], [[40, 41], [42]], [[96]], [0.0, 1.0]),
        Traj(TrajectoryID(q2, 1), [4, 5], [[50, 51]], [], [1.0]),
    ]


def test_grpo_broadcasts_the_trajectory_advantage_to_every_step():
    out = stepwise_output(sample_trajs())
    adv = compute_advantages(out, AlgorithmConfig(advantage_estimator="grpo"))

    q1 = [1.0, 0.0, 0.5]  # trajectory totals: rewards summed over all steps
    q2 = [1.0, 1.0]
    expected = {TrajectoryID("q1", i): (s - statistics.mean(q1)) / (statistics.stdev(q1) + 1e-6)
                for i, s in enumerate(q1)}
    expected |= {TrajectoryID("q2", i): 0.0 for i in range(len(q2))}  # no spread, no signal (not nan)
    assert trajectory_scores(out) == pytest.approx({tid: s for tid, s in zip(expected, q1 + q2)})
    for tid, resp_adv, mask in zip(out.trajectory_ids, adv, out.loss_masks):
        assert resp_adv == pytest.approx([expected[tid] * m for m in mask])
    # the first step of the 3-turn trajectory carries its (positive) outcome, not zero
    assert adv[0] == pytest.approx([expected[TrajectoryID("q1", 0)]] * 2) and adv[0][0] > 0.5
    # the masked token of q1/2's last step gets no advantage
    assert adv[5] == [pytest.approx(expected[TrajectoryID("q1", 2)]), 0.0]


def test_rloo_and_unnormalised_grpo():
    out = stepwise_output(sample_trajs())
    rloo = group_advantages(trajectory_scores(out), "rloo")
    assert rloo[TrajectoryID("q1", 0)] == pytest.approx(1.0 - (0.0 + 0.5) / 2)
    assert rloo[TrajectoryID("q1", 1)] == pytest.approx(0.0 - (1.0 + 0.5) / 2)
    grpo = group_advantages(trajectory_scores(out), "grpo", norm_adv_by_std=False)
    assert grpo[TrajectoryID("q1", 2)] == pytest.approx(0.5 - 0.5)
    assert grpo[TrajectoryID("q1", 0)] == pytest.approx(0.5)


def test_singleton_group_keeps_raw_score():
    scores = {TrajectoryID("solo", 0): 0.7}
    assert group_advantages(scores, "grpo") == {TrajectoryID("solo", 0): pytest.approx(0.7)}


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_stepwise_merged_and_whole_trajectory_agree_on_loss_tokens(estimator):
    trajs = sample_trajs()
    cfg = AlgorithmConfig(advantage_estimator=estimator)
    stepwise = stepwise_output(trajs)
    merged = merge_stepwise_output(stepwise)
    whole = whole_output(trajs)
    assert len(merged) == len(whole) < len(stepwise)  # the chains really were merged
    per_repr = [masked_token_advantages(o, compute_advantages(o, cfg)) for o in (stepwise, merged, whole)]
    assert per_repr[0] == per_repr[1] == per_repr[2]
    assert any(a != 0 for toks in per_repr[0].values() for _, a in toks)


def test_float_rewards_equal_per_token_rewards():
    out = stepwise_output(sample_trajs())
    floats = GeneratorOutput(**{**out.__dict__, "rewards": out.trajectory_rewards()})
    cfg = AlgorithmConfig()
    assert compute_advantages(floats, cfg) == compute_advantages(out, cfg)


def test_errors_name_the_problem():
    out = stepwise_output(sample_trajs())
    with pytest.raises(ValueError, match="advantage_estimator: 'gae' cannot be broadcast step-wise"):
        compute_advantages(out, AlgorithmConfig(advantage_estimator="gae"))
    out.trajectory_ids = None
    with pytest.raises(ValueError, match="trajectory_ids"):
        compute_advantages(out, AlgorithmConfig())
