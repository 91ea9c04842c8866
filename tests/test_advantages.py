"""Outcome advantages: per trajectory, grouped by prompt, broadcast to every step's loss-masked tokens."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest

from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.algorithms.advantages import group_advantages, loss_weights, trajectory_scores
from skyrl_stepwise.algorithms.credit import compute_advantages
from skyrl_stepwise.policy.config import AlgorithmConfig
from skyrl_stepwise.algorithms.credit import compute_credit


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
    cols: dict[str, list] = {k: [] for k in ("p", "r", "rw", "m", "lp", "tid", "last", "turn")}
    for t in trajs:
        history = list(t.prompt)
        for i, resp in enumerate(t.responses):
            for k, v in zip(cols, (list(history), resp, t.reward(i), t.mask(i), t.logprob(i), t.tid,
                                   i == len(t.responses) - 1, [i] * len(resp))):
                cols[k].append(v)
            history += resp + (t.observations[i] if i < len(t.observations) else [])
    out = GeneratorOutput(prompt_token_ids=cols["p"], response_ids=cols["r"], rewards=cols["rw"],
                          loss_masks=cols["m"], rollout_logprobs=cols["lp"], trajectory_ids=cols["tid"],
                          is_last_step=cols["last"], turn_indices=cols["turn"])
    out.validate()
    return out


def whole_output(trajs: list[Traj]) -> GeneratorOutput:
    """One sample per trajectory, built by hand: observations are in the response with loss mask 0."""
    cols: dict[str, list] = {k: [] for k in ("r", "rw", "m", "lp", "turn")}
    for t in trajs:
        r, rw, m, lp, turn = [], [], [], [], []
        for i, resp in enumerate(t.responses):
            obs = t.observations[i] if i < len(t.observations) else []
            r += resp + obs
            rw += t.reward(i) + [0.0] * len(obs)
            m += t.mask(i) + [0] * len(obs)
            lp += t.logprob(i) + [0.0] * len(obs)
            turn += [i] * (len(resp) + len(obs))  # an observation belongs to the step it answers
        for k, v in zip(cols, (r, rw, m, lp, turn)):
            cols[k].append(v)
    return GeneratorOutput(prompt_token_ids=[t.prompt for t in trajs], response_ids=cols["r"], rewards=cols["rw"],
                           loss_masks=cols["m"], rollout_logprobs=cols["lp"],
                           trajectory_ids=[t.tid for t in trajs], is_last_step=[True] * len(trajs),
                           turn_indices=cols["turn"])


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


@pytest.mark.parametrize("mode", ["outcome", "discounted", "gigpo"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_stepwise_merged_and_whole_trajectory_agree_on_loss_tokens(estimator, mode):
    trajs = sample_trajs()
    cfg = AlgorithmConfig(advantage_estimator=estimator, step_advantage=mode, gamma=0.5)
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


# ------------------------------------------------------------------ per-step credit (algorithms/credit.py)

def _step_adv(out: GeneratorOutput, cfg: AlgorithmConfig) -> dict[tuple[TrajectoryID, int], float]:
    """(trajectory, turn) -> the advantage on that step's first loss-masked token."""
    found: dict = {}
    for tid, turns, mask, adv in zip(out.trajectory_ids, out.turn_indices, out.loss_masks,
                                     compute_advantages(out, cfg)):
        for t, m, a in zip(turns, mask, adv):
            if m:
                found.setdefault((tid, t), a)
    return found


def test_discounted_returns_use_a_trajectory_level_baseline():
    """q1: lengths 3, 1, 2 with rewards [0, 0, 1], [0], [0.2, 0.3]; q2: [0, 1], [1]; gamma 0.5. By hand:
    q1 returns G_k: t0 (0.25, 0.5, 1), t1 (0), t2 (0.35, 0.3); baseline = mean of the G_0 (0.25, 0, 0.35) = 0.2,
    scale = their unbiased std sqrt(0.0325). q2: t0 (0.5, 1), t1 (1); baseline 0.75, std sqrt(0.125)."""
    out = stepwise_output(sample_trajs())
    cfg = AlgorithmConfig(step_advantage="discounted", gamma=0.5)
    q1 = lambda i: TrajectoryID("q1", i)  # noqa: E731
    q2 = lambda i: TrajectoryID("q2", i)  # noqa: E731
    s1, s2 = 0.0325 ** 0.5 + 1e-6, 0.125 ** 0.5 + 1e-6
    expected = {(q1(0), 0): 0.05 / s1, (q1(0), 1): 0.3 / s1, (q1(0), 2): 0.8 / s1, (q1(1), 0): -0.2 / s1,
                (q1(2), 0): 0.15 / s1, (q1(2), 1): 0.1 / s1,
                (q2(0), 0): -0.25 / s2, (q2(0), 1): 0.25 / s2, (q2(1), 0): 0.25 / s2}
    assert _step_adv(out, cfg) == pytest.approx(expected)

    credit = compute_credit(out, cfg)
    assert credit.metrics["credit/reward_turn0"] == pytest.approx((0 + 0 + 0.2 + 0 + 1) / 5)
    assert credit.metrics["credit/reward_turn2"] == pytest.approx(1.0)
    assert credit.metrics["credit/advantage_turn1"] == pytest.approx((0.3 / s1 + 0.1 / s1 + 0.25 / s2) / 3)
    # outcome advantages: q1/2 scores the group mean (0) and q2 has no spread (0): their 5 steps flip sign
    assert credit.metrics["credit/sign_flip_frac"] == pytest.approx(5 / 9)
    assert credit.metrics["credit/steps"] == 9


def test_discounted_with_gamma_one_and_terminal_rewards_is_outcome():
    trajs = [t for t in sample_trajs() if t.tid.instance_id == "q1" and t.tid.repetition_id < 2]
    trajs.append(Traj(TrajectoryID("q1", 2), [1, 2, 3], [[30], [31, 32]], [[93]], [0.0, 0.5]))
    out = stepwise_output(trajs)
    for estimator in ("grpo", "rloo"):
        outcome = compute_advantages(out, AlgorithmConfig(advantage_estimator=estimator))
        discounted = compute_advantages(out, AlgorithmConfig(advantage_estimator=estimator,
                                                             step_advantage="discounted", gamma=1.0))
        assert [x for row in discounted for x in row] == pytest.approx([x for row in outcome for x in row])
        assert any(x != 0 for row in outcome for x in row)


@pytest.mark.parametrize("mode", ["outcome", "discounted", "gigpo"])
def test_stopping_a_turn_earlier_earns_nothing_by_itself(mode):
    """Two trajectories with the same outcome (1.0 at the end), one a turn shorter, and a failed one: both
    successes get the same trajectory-level credit (first and last step). A per-turn-index baseline would not:
    turn 2 exists only in the long trajectory, so its last step would be compared with nothing, and the short
    one's last step (turn 1) with the long one's middle step (reward 0), which rewards stopping early."""
    p = [1, 2]
    out = stepwise_output([
        Traj(TrajectoryID("q", 0), p, [[10], [11], [12]], [[90], [91]], [0.0, 0.0, 1.0]),
        Traj(TrajectoryID("q", 1), p, [[20], [21]], [[92]], [0.0, 1.0]),
        Traj(TrajectoryID("q", 2), p, [[30], [31]], [[93]], [0.0, 0.0]),
    ])
    adv = _step_adv(out, AlgorithmConfig(step_advantage=mode, gamma=1.0))
    long_, short, failed = TrajectoryID("q", 0), TrajectoryID("q", 1), TrajectoryID("q", 2)
    assert adv[(long_, 0)] == pytest.approx(adv[(short, 0)])
    assert adv[(long_, 2)] == pytest.approx(adv[(short, 1)])
    assert adv[(short, 0)] > 0 > adv[(failed, 0)]


def test_gigpo_anchor_groups_by_observation_history():
    """q1 (gamma 1, omega 0.5): A and B sample the same first turn and see the same observation, so their second
    steps share an anchor state; C stops after one turn; D's second step is alone (its anchor group gives 0).
    Outcome scores 1, 0, 0, 1: episode advantage +-0.5 / std, std = sqrt(1/3). Turn 0: all four share the prompt,
    returns = scores, so A^S = A^E. Turn 1 anchor {A, B}: returns 1, 0 -> +-0.5 / sqrt(0.5).
    q2/E has the same token history as A but another prompt group: anchors never cross groups; a group of one
    keeps its raw score (1) as outcome does, and its singleton anchors add 0."""
    p = [1, 2, 3]
    out = stepwise_output([
        Traj(TrajectoryID("q1", 0), p, [[10], [11]], [[90]], [0.0, 1.0]),
        Traj(TrajectoryID("q1", 1), p, [[10], [12]], [[90]], [0.0, 0.0]),
        Traj(TrajectoryID("q1", 2), p, [[20]], [], [0.0]),
        Traj(TrajectoryID("q1", 3), p, [[30], [31]], [[91]], [0.0, 1.0]),
        Traj(TrajectoryID("q2", 0), p, [[10], [11]], [[90]], [0.0, 1.0]),
    ])
    cfg = AlgorithmConfig(step_advantage="gigpo", gamma=1.0, step_advantage_weight=0.5)
    e = 0.5 / ((1 / 3) ** 0.5 + 1e-6)  # episode advantage magnitude
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    t = lambda q, i: TrajectoryID(q, i)  # noqa: E731
    expected = {(t("q1", 0), 0): 1.5 * e, (t("q1", 0), 1): e + 0.5 * a,
                (t("q1", 1), 0): -1.5 * e, (t("q1", 1), 1): -e - 0.5 * a,
                (t("q1", 2), 0): -1.5 * e,
                (t("q1", 3), 0): 1.5 * e, (t("q1", 3), 1): e,
                (t("q2", 0), 0): 1.0, (t("q2", 0), 1): 1.0}
    assert _step_adv(out, cfg) == pytest.approx(expected, rel=1e-5)
    m = compute_credit(out, cfg).metrics
    assert m["credit/anchor_groups"] == 5  # q1: turn 0, {A1, B1}, {D1}; q2: two singletons
    assert m["credit/anchor_group_size_max"] == 4 and m["credit/anchor_group_size_mean"] == pytest.approx(9 / 5)
    assert m["credit/anchor_singleton_step_frac"] == pytest.approx(3 / 9)
    assert m["credit/sign_flip_frac"] == 0.0


def test_gigpo_and_discounted_in_groups_of_one():
    """A group of one keeps its raw (return) as outcome does; one whose siblings failed gets 0."""
    trajs = [Traj(TrajectoryID("solo", 0), [1], [[5], [6]], [[7]], [0.5, 1.0]),
             Traj(TrajectoryID("left", 0), [2], [[8]], [], [1.0])]
    out = stepwise_output(trajs)
    out.failed_trajectory_ids = [TrajectoryID("left", 1)]
    disc = _step_adv(out, AlgorithmConfig(step_advantage="discounted", gamma=0.5))
    assert disc == pytest.approx({(TrajectoryID("solo", 0), 0): 1.0, (TrajectoryID("solo", 0), 1): 1.0,
                                  (TrajectoryID("left", 0), 0): 0.0})
    gigpo = _step_adv(out, AlgorithmConfig(step_advantage="gigpo"))
    assert gigpo == pytest.approx({(TrajectoryID("solo", 0), 0): 1.5, (TrajectoryID("solo", 0), 1): 1.5,
                                   (TrajectoryID("left", 0), 0): 0.0})


def test_discounting_with_equal_trajectory_returns_does_not_divide_by_zero():
    """Both trajectories return 0.81 from their first step (gamma 0.9, reward 1 after 3 turns): no std to divide
    by, so the group is left unnormalised (and counted) instead of dividing 1 - 0.81 by eps."""
    trajs = [Traj(TrajectoryID("q", i), [1], [[5 + i], [6], [7]], [[8], [9]], [0.0, 0.0, 1.0]) for i in range(2)]
    credit = compute_credit(stepwise_output(trajs), AlgorithmConfig(step_advantage="discounted", gamma=0.9))
    assert credit.step_advantages[(TrajectoryID("q", 0), 2)] == pytest.approx(1 - 0.81)
    assert credit.step_advantages[(TrajectoryID("q", 1), 0)] == pytest.approx(0.0)
    assert credit.metrics["credit/unnormalised_groups"] == 1


def test_per_step_modes_need_turn_indices_and_validate_their_keys():
    out = stepwise_output(sample_trajs())
    out.turn_indices = None
    compute_advantages(out, AlgorithmConfig())  # outcome needs no steps
    with pytest.raises(ValueError, match="turn_indices"):
        compute_advantages(out, AlgorithmConfig(step_advantage="gigpo"))
    for kwargs, message in (({"step_advantage": "gae"}, "trainer.algorithm.step_advantage"),
                            ({"gamma": 1.5}, "trainer.algorithm.gamma"),
                            ({"step_advantage_weight": -1.0}, "trainer.algorithm.step_advantage_weight"),
                            ({"loss_reduction": "seq_mean"}, "trainer.algorithm.loss_reduction")):
        with pytest.raises(ValueError, match=message):
            AlgorithmConfig(**kwargs).validate()


def test_sequence_mean_weighs_samples_so_merging_changes_it():
    """token_mean / trajectory_mean weights do not depend on the cut; sequence_mean's denominator is the number of
    samples with loss tokens: 6 step-wise, 3 merged for q1 (3 trajectories)."""
    trajs = [t for t in sample_trajs() if t.tid.instance_id == "q1"]
    stepwise = stepwise_output(trajs)
    merged = merge_stepwise_output(stepwise)

    def denominator(out, reduction):
        weights = loss_weights(out, AlgorithmConfig(loss_reduction=reduction))
        return sum(m * w for mask, ws in zip(out.loss_masks, weights) for m, w in zip(mask, ws))

    assert denominator(stepwise, "trajectory_mean") == pytest.approx(denominator(merged, "trajectory_mean")) == 3
    assert denominator(stepwise, "sequence_mean") == pytest.approx(6)
    assert denominator(merged, "sequence_mean") == pytest.approx(3)
