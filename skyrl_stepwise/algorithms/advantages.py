"""Outcome advantages for step-wise samples: one number per trajectory, broadcast to all its steps.

(This is `trainer.algorithm.step_advantage=outcome`, the default; per-step modes live in credit.py.)

A trajectory's score is the sum of the rewards of all its samples (step-wise, merged or whole: the same
total). Scores are compared within a prompt group (same instance_id) by GRPO or RLOO; the resulting
advantage is then written on every loss-masked token of every sample of that trajectory, so an early
step is credited with the outcome it led to and the per-token advantages do not depend on how the
trajectory was cut into samples.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.algorithms.config import ADVANTAGE_ESTIMATORS, AlgorithmConfig


def trajectory_scores(output: GeneratorOutput) -> dict[TrajectoryID, float]:
    """Sum every sample's rewards into its trajectory, because the outcome is spread over its steps."""
    if output.trajectory_ids is None:
        raise ValueError("compute_advantages needs GeneratorOutput.trajectory_ids (got None): advantages are "
                         "computed per trajectory and grouped by instance_id")
    scores: dict[TrajectoryID, float] = defaultdict(float)
    for tid, reward in zip(output.trajectory_ids, output.trajectory_rewards()):
        scores[tid] += reward
    return dict(scores)


def group_advantages(scores: dict[TrajectoryID, float], estimator: str = "grpo", norm_adv_by_std: bool = True,
                     eps: float = 1e-6, failed: list[TrajectoryID] = ()) -> dict[TrajectoryID, float]:
    """Baseline each trajectory against the others sampled for the same prompt.

    grpo: (score - group mean) / (group std + eps), std unbiased as in verl/SkyRL; rloo: score minus the
    mean of the other trajectories. A group sampled as one has no baseline and keeps its raw score (as in
    verl); a group that failures (`failed`: trajectories whose infrastructure failed) left with fewer than two
    gets advantage 0, since its raw score was meant to be compared with siblings that never came back.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"algorithm.advantage_estimator: {estimator!r} cannot be broadcast step-wise; "
                         f"use grpo or rloo")
    groups: dict[str, list[TrajectoryID]] = defaultdict(list)
    for tid in scores:
        groups[tid.instance_id].append(tid)
    lost_members = {tid.instance_id for tid in failed}
    advantages: dict[TrajectoryID, float] = {}
    for instance_id, tids in groups.items():
        r = torch.tensor([scores[t] for t in tids], dtype=torch.float64)
        n = len(tids)
        if n == 1:
            adv = torch.zeros_like(r) if instance_id in lost_members else r
        elif estimator == "grpo":
            adv = r - r.mean()
            if norm_adv_by_std:
                adv = adv / (r.std() + eps)
        else:  # rloo: r_i - mean_{j != i} r_j
            adv = (r - (r.sum() - r) / (n - 1))
        advantages.update(zip(tids, adv.tolist()))
    return advantages


# an advantage this small is rounding (GRPO over equal scores can leave ~1e-11), not a gradient
SIGNAL_TOLERANCE = 1e-8


def signal_groups(output: GeneratorOutput, advantages: list[list[float]]) -> dict[str, bool]:
    """Each prompt group (instance_id, in first-seen order) -> whether any of its trained (loss-masked) tokens has a
    non-zero advantage under the configured credit: only those groups give the policy a gradient.

    Judged on the advantages, not on trajectory scores: with discounting (gamma < 1), GiGPO or intermediate
    rewards, trajectories that scored the same in total still give their steps different advantages."""
    if output.trajectory_ids is None:
        raise ValueError("signal_groups needs GeneratorOutput.trajectory_ids (got None): signal is per prompt group")
    signal: dict[str, bool] = {}
    for tid, adv, mask in zip(output.trajectory_ids, advantages, output.loss_masks):
        trained = any(m and abs(a) > SIGNAL_TOLERANCE for a, m in zip(adv, mask))
        signal[tid.instance_id] = signal.get(tid.instance_id, False) or trained
    return signal


def groups_with_signal(scores: dict[TrajectoryID, float]) -> tuple[int, int]:
    """(prompt groups whose trajectories scored differently, all groups): reward variance, which is what gives
    outcome credit a non-zero advantage (per-step credit can have signal without it: see signal_groups)."""
    groups: dict[str, set[float]] = defaultdict(set)
    for tid, score in scores.items():
        groups[tid.instance_id].add(score)
    return sum(len(v) > 1 for v in groups.values()), len(groups)


def loss_weights(output: GeneratorOutput, cfg: AlgorithmConfig) -> list[list[float]] | None:
    """Per-token loss weights for `loss_reduction=trajectory_mean`: 1 / the loss-masked tokens of the token's
    trajectory, counted over all its samples, so each trajectory weighs 1 however it was cut into samples (a
    per-sample mean would weigh a 4-step trajectory 4x when step-wise and 1x when merged). None: token_mean.

    sequence_mean is that per-sample mean (1 / the sample's loss-masked tokens; SkyRL/verl's per-sequence mean),
    kept for parity with their recipes although it is not merge-invariant."""
    if cfg.loss_reduction == "token_mean":
        return None
    if cfg.loss_reduction == "sequence_mean":
        return [[1.0 / sum(mask) if sum(mask) else 0.0] * len(mask) for mask in output.loss_masks]
    tokens: dict[TrajectoryID, int] = defaultdict(int)
    for tid, mask in zip(output.trajectory_ids, output.loss_masks):
        tokens[tid] += sum(mask)
    return [[1.0 / tokens[tid] if tokens[tid] else 0.0] * len(mask)
            for tid, mask in zip(output.trajectory_ids, output.loss_masks)]
