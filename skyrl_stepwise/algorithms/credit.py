"""Step-level credit: how a prompt group's rewards become one advantage per step (`trainer.algorithm.step_advantage`).

A step is (trajectory, turn). Its tokens are found through `GeneratorOutput.turn_indices`, so a step is the same
whether it is its own sample or part of a merged one: its reward is the sum of the rewards on its tokens, its
observation history is the prompt it was sampled from (merged: the sample's prompt + the response before the
step's first token, identical by the merge's exact-prefix rule), and its advantage goes on its loss-masked tokens.
Hence step-wise and merged samples get the same per-token advantages in every mode.

Modes, all grouped by prompt (instance_id) as GRPO/RLOO do (`advantage_estimator` picks the baseline):

- outcome: the trajectory's total reward, baselined in its group, on every step (advantages.py).
- discounted: step k's return G_k = r_k + gamma G_{k+1}; the baseline is the group's mean *trajectory* return
  G_0 (and its std the scale), never a per-turn-index mean: comparing turn k only with other trajectories' turn k
  rewards a policy for stopping before the turns where others fail (verl RFC #7244). With gamma = 1 and a
  terminal reward it is exactly `outcome`.
- gigpo (GiGPO, arXiv 2505.10978): the outcome (episode) advantage + step_advantage_weight x the step's return
  baselined among its anchor group: the group's steps whose observation history is identical (matched by a hash
  of the prompt ids). A singleton anchor group contributes 0.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.algorithms.advantages import group_advantages, trajectory_scores
from skyrl_stepwise.algorithms.config import AlgorithmConfig

StepKey = tuple[TrajectoryID, int]  # (trajectory, turn index)
_STD_FLOOR = 1e-6  # below this a group's return spread is treated as none (see _baseline)


@dataclass
class StepInfo:
    """One step as credit assignment sees it: its own reward and the hash of what it was sampled from."""

    reward: float = 0.0
    anchor: str = ""


@dataclass
class Credit:
    """Per-token advantages parallel to response_ids, and what they were made of (for the run's metrics)."""

    advantages: list[list[float]]
    step_advantages: dict[StepKey, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def collect_steps(output: GeneratorOutput) -> dict[StepKey, StepInfo]:
    """Every step of the output with its reward (rewards of its tokens, observation tokens after it included) and
    its anchor: a hash of the prompt ids it was sampled from. Needs `turn_indices` (the generator sets them)."""
    if output.trajectory_ids is None or output.turn_indices is None:
        raise ValueError("per-step credit (trainer.algorithm.step_advantage != outcome) needs GeneratorOutput."
                         "trajectory_ids and turn_indices (the generator sets both; a hand-built output must too)")
    steps: dict[StepKey, StepInfo] = {}
    for i, (tid, prompt, resp, rewards, turns) in enumerate(zip(
            output.trajectory_ids, output.prompt_token_ids, output.response_ids, output.rewards,
            output.turn_indices)):
        if not isinstance(rewards, list):  # a per-sample float sits on the sample's last token
            if rewards and not resp:
                raise ValueError(f"sample {i} has reward {rewards} but no response token, so no step to credit")
            rewards = [0.0] * (len(resp) - 1) + [float(rewards)] if resp else []
        history = hashlib.blake2b(array("q", prompt).tobytes(), digest_size=16)
        for j, (turn, reward) in enumerate(zip(turns, rewards)):
            if j == 0 or turns[j - 1] != turn:  # the step's first token: what came before is its history
                key = (tid, turn)
                if key in steps:
                    raise ValueError(f"turn {turn} of trajectory {tid.key()} appears in two samples (sample {i} "
                                     f"again); a step's tokens must be contiguous")
                steps[key] = StepInfo(anchor=history.copy().hexdigest())
            steps[(tid, turn)].reward += float(reward)
            history.update(array("q", [resp[j]]).tobytes())
    return steps


def step_returns(steps: dict[StepKey, StepInfo], gamma: float) -> dict[StepKey, float]:
    """G_k = r_k + gamma^(k' - k) G_k' over each trajectory's steps (k' the next step present)."""
    by_traj: dict[TrajectoryID, list[int]] = defaultdict(list)
    for tid, turn in steps:
        by_traj[tid].append(turn)
    returns: dict[StepKey, float] = {}
    for tid, turns in by_traj.items():
        later, later_turn = 0.0, None
        for turn in sorted(turns, reverse=True):
            later = steps[(tid, turn)].reward + (gamma ** (later_turn - turn) * later if later_turn is not None else 0.0)
            returns[(tid, turn)] = later
            later_turn = turn
    return returns


def _baseline(values: torch.Tensor, estimator: str, norm_adv_by_std: bool, eps: float = 1e-6
              ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Per-member baseline and scale of a group of >= 2 values: grpo mean (and std + eps), rloo mean of the others.

    The returned flag says the std was ~0 and the scale fell back to 1: with discounting, steps can differ while
    the trajectory returns do not, and dividing their difference by eps would blow it up.
    """
    n = len(values)
    if estimator == "rloo":
        return (values.sum() - values) / (n - 1), torch.ones_like(values), False
    base = values.mean().expand(n)
    if not norm_adv_by_std:
        return base, torch.ones_like(values), False
    std = values.std()
    if std <= _STD_FLOOR:
        return base, torch.ones_like(values), True
    return base, (std + eps).expand(n), False


def discounted_advantages(output: GeneratorOutput, steps: dict[StepKey, StepInfo], cfg: AlgorithmConfig
                          ) -> tuple[dict[StepKey, float], dict[str, float]]:
    """Each step's return minus its group's trajectory-level baseline (over returns from each trajectory's first
    step), divided by the group's trajectory-return std. Groups of one keep the raw return, as outcome does."""
    returns = step_returns(steps, cfg.gamma)
    first_turn: dict[TrajectoryID, int] = {}
    for tid, turn in steps:
        first_turn[tid] = min(turn, first_turn.get(tid, turn))
    groups: dict[str, list[TrajectoryID]] = defaultdict(list)
    for tid in dict.fromkeys(output.trajectory_ids):  # every trajectory, even one with no step (return 0)
        groups[tid.instance_id].append(tid)
    lost = {tid.instance_id for tid in output.failed_trajectory_ids}
    traj_base: dict[TrajectoryID, tuple[float, float]] = {}
    unnormalised = 0
    for instance_id, tids in groups.items():
        g0 = torch.tensor([returns.get((t, first_turn.get(t, -1)), 0.0) for t in tids], dtype=torch.float64)
        if len(tids) == 1:
            traj_base[tids[0]] = (float("nan"), 0.0) if instance_id in lost else (0.0, 1.0)
            continue
        base, scale, fell_back = _baseline(g0, cfg.advantage_estimator, cfg.norm_adv_by_std)
        unnormalised += fell_back
        traj_base.update(zip(tids, zip(base.tolist(), scale.tolist())))
    advantages = {}
    for key, ret in returns.items():
        base, scale = traj_base[key[0]]
        advantages[key] = 0.0 if scale == 0.0 else (ret - base) / scale
    return advantages, {"credit/unnormalised_groups": float(unnormalised)}


def gigpo_advantages(output: GeneratorOutput, steps: dict[StepKey, StepInfo], cfg: AlgorithmConfig
                     ) -> tuple[dict[StepKey, float], dict[str, float]]:
    """GiGPO: episode (outcome) advantage + omega x the step's return baselined within its anchor group."""
    episode = group_advantages(trajectory_scores(output), cfg.advantage_estimator, cfg.norm_adv_by_std,
                               failed=output.failed_trajectory_ids)
    returns = step_returns(steps, cfg.gamma)
    anchors: dict[tuple[str, str], list[StepKey]] = defaultdict(list)
    for key, info in steps.items():
        anchors[(key[0].instance_id, info.anchor)].append(key)
    step_adv = dict.fromkeys(steps, 0.0)  # a singleton anchor group has nothing to compare with: 0
    for members in anchors.values():
        if len(members) < 2:
            continue
        values = torch.tensor([returns[k] for k in members], dtype=torch.float64)
        base, scale, _ = _baseline(values, cfg.advantage_estimator, cfg.norm_adv_by_std)
        # an anchor group whose returns agree gives 0 either way; the std fallback changes nothing here
        step_adv.update(zip(members, ((values - base) / scale).tolist()))
    sizes = [len(m) for m in anchors.values()]
    metrics = {"credit/anchor_groups": float(len(sizes)),
               "credit/anchor_group_size_mean": sum(sizes) / max(len(sizes), 1),
               "credit/anchor_group_size_max": float(max(sizes, default=0)),
               "credit/anchor_singleton_step_frac": sum(s == 1 for s in sizes) / max(sum(sizes), 1)}
    advantages = {k: episode[k[0]] + cfg.step_advantage_weight * step_adv[k] for k in steps}
    return advantages, metrics


def _sign(x: float, tol: float = 1e-12) -> int:
    return 0 if abs(x) <= tol else (1 if x > 0 else -1)


def turn_metrics(steps: dict[StepKey, StepInfo], step_adv: dict[StepKey, float],
                 outcome: dict[TrajectoryID, float]) -> dict[str, float]:
    """Reward and advantage by turn index, and the share of steps whose advantage sign differs from their
    trajectory's outcome advantage (how much per-step credit departs from broadcasting the outcome)."""
    by_turn: dict[int, list[StepKey]] = defaultdict(list)
    for key in steps:
        by_turn[key[1]].append(key)
    metrics: dict[str, float] = {}
    for turn in sorted(by_turn):
        keys = by_turn[turn]
        metrics[f"credit/reward_turn{turn}"] = sum(steps[k].reward for k in keys) / len(keys)
        metrics[f"credit/advantage_turn{turn}"] = sum(step_adv[k] for k in keys) / len(keys)
    flips = sum(_sign(step_adv[k]) != _sign(outcome[k[0]]) for k in steps)
    metrics["credit/sign_flip_frac"] = flips / max(len(steps), 1)
    metrics["credit/steps"] = float(len(steps))
    return metrics


def compute_credit(output: GeneratorOutput, cfg: AlgorithmConfig) -> Credit:
    """Per-token advantages for `cfg.step_advantage`, and credit metrics; the advantage of a step is written on
    its loss-masked tokens only."""
    outcome = group_advantages(trajectory_scores(output), cfg.advantage_estimator, cfg.norm_adv_by_std,
                               failed=output.failed_trajectory_ids)
    if cfg.step_advantage == "outcome":
        advantages = [[outcome[tid] * m for m in mask] for tid, mask in zip(output.trajectory_ids, output.loss_masks)]
        if output.turn_indices is None:  # hand-built outputs: no steps to report on, the outcome needs none
            return Credit(advantages)
        steps = collect_steps(output)
        step_adv = {k: outcome[k[0]] for k in steps}
        return Credit(advantages, step_adv, turn_metrics(steps, step_adv, outcome))
    steps = collect_steps(output)
    if cfg.step_advantage == "discounted":
        step_adv, metrics = discounted_advantages(output, steps, cfg)
    elif cfg.step_advantage == "gigpo":
        step_adv, metrics = gigpo_advantages(output, steps, cfg)
    else:
        raise ValueError(f"trainer.algorithm.step_advantage: {cfg.step_advantage!r} is not one of outcome, "
                         f"discounted, gigpo")
    advantages = [[step_adv[(tid, t)] * m for t, m in zip(turns, mask)]
                  for tid, turns, mask in zip(output.trajectory_ids, output.turn_indices, output.loss_masks)]
    metrics.update(turn_metrics(steps, step_adv, outcome))
    return Credit(advantages, step_adv, metrics)


def compute_advantages(output: GeneratorOutput, cfg: AlgorithmConfig) -> list[list[float]]:
    """Per-token advantages parallel to response_ids for `cfg.step_advantage` (outcome: the trajectory's advantage
    times the sample's loss mask), for callers that do not need the credit metrics `compute_credit` also returns."""
    return compute_credit(output, cfg).advantages
