"""PPO clipped policy loss with token-level truncated IS and an optional KL-to-reference term.

All inputs are flat per-token tensors over one micro-batch's response tokens. The loss is the sum of the
masked per-token losses divided by `num_tokens`, the number of loss-masked tokens in the whole mini-batch
(all micro-batches, all ranks): summed over micro-batches it is exactly the mini-batch token mean, so how
trajectories are cut into samples, packed or sharded never changes the loss or its gradient. Other reductions are
per-token weights (advantages.loss_weights) with `num_tokens` their weighted count: trajectory_mean keeps that
invariance, sequence_mean (a per-sample mean, for SkyRL/verl parity) does not.
"""

from __future__ import annotations

import torch

from skyrl_stepwise.algorithms.config import AlgorithmConfig


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate to the reference; low_var_kl (k3) is unbiased, >= 0 and low variance.

    k3 clamps its log-ratio before the exp() (at +-20, as verl): a token the policy has pushed far below
    the reference (or a masked placeholder) would otherwise give exp() = inf, a nan gradient even after the
    final clamp, and a skipped step.
    """
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind == "low_var_kl":
        log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)  # clamp as in verl: rare huge ratios
    raise ValueError(f"algorithm.kl_loss_type: {kind!r} is not one of low_var_kl, k1, k2")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: AlgorithmConfig,
    num_tokens: float,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    loss_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return this micro-batch's share of the mini-batch loss, and metrics on the same scale.

    Each metric is a masked token sum divided by `num_tokens`, so summing the metrics of all micro-batches
    and ranks of a mini-batch gives its token mean. Masked positions never enter an exp(): their
    placeholder logprobs (0.0 for observation tokens) could otherwise overflow into inf * 0 = nan.
    `loss_weights` (trajectory_mean) scale each token, and `num_tokens` is then their weighted count.
    """
    mask = loss_mask.to(logprobs.dtype)
    if loss_weights is not None:
        mask = mask * loss_weights.to(logprobs.dtype)
    live = mask > 0
    denom = max(float(num_tokens), 1.0)

    log_ratio = torch.where(live, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    pg = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).to(mask.dtype)
    if cfg.dual_clip_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * cfg.dual_clip_c), pg)

    metrics: dict[str, float] = {}
    if rollout_logprobs is not None:  # the agreement alarm's evidence (loop/agreement.py): trainer vs engine
        gap = torch.where(live, (old_logprobs - rollout_logprobs).abs(), torch.zeros_like(logprobs)).detach()
        metrics["agreement/logprob_abs_diff_mean"] = (gap * mask).sum().item() / denom
        metrics["agreement/logprob_abs_diff_max"] = gap.max().item() if gap.numel() else 0.0
    if cfg.use_tis:
        if rollout_logprobs is None:
            raise ValueError("algorithm.tis_ratio_clip_high is set but the batch has no rollout_logprobs; "
                             "sample with logprobs or set algorithm.tis_ratio_clip_high=null")
        tis_log = torch.where(live, old_logprobs - rollout_logprobs, torch.zeros_like(logprobs)).detach()
        tis = tis_log.exp()
        metrics["policy/tis_clip_frac"] = ((tis > cfg.tis_ratio_clip_high).to(mask.dtype) * mask).sum().item() / denom
        tis = tis.clamp(max=cfg.tis_ratio_clip_high)
        metrics["policy/tis_weight"] = (tis * mask).sum().item() / denom
        pg = pg * tis

    per_token = pg
    if cfg.use_kl_loss:
        if ref_logprobs is None:
            raise ValueError("algorithm.use_kl_loss=true but the batch has no ref_logprobs; compute them with "
                             "the reference worker or set algorithm.use_kl_loss=false")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_loss_type)
        per_token = per_token + cfg.kl_loss_coef * kl
        metrics["policy/kl_loss"] = (kl.detach() * mask).sum().item() / denom

    loss = (per_token * mask).sum() / denom
    metrics["policy/loss"] = loss.item()
    metrics["policy/pg_loss"] = (pg.detach() * mask).sum().item() / denom
    metrics["policy/clip_frac"] = (clipped * mask).sum().item() / denom
    # k3 estimate of KL(old || new): how far this update has moved the policy
    metrics["policy/ppo_kl"] = ((ratio.detach() - 1 - log_ratio.detach()) * mask).sum().item() / denom
    if entropy is not None:
        metrics["policy/entropy"] = (entropy.detach() * mask).sum().item() / denom
    return loss, metrics


def no_gradient(batch, algorithm: AlgorithmConfig) -> bool:
    """Whether the RL loss of `batch` has an exactly zero gradient whatever the weights: every trained token's
    advantage is 0 and no KL term is on (the policy loss is -advantage x ratio; the KL term is the only other
    one). A step of a batch whose prompt groups all scored alike is such a batch: its forward and backward
    (minutes on a CPU box) cannot change what the optimizer does."""
    if algorithm.use_kl_loss or batch.advantages is None:
        return False
    if algorithm.use_tis and batch.rollout_logprobs is None:  # the full pass refuses it: no skip hides that
        return False
    return all(a == 0.0 for adv, mask in zip(batch.advantages, batch.loss_masks) for a, m in zip(adv, mask) if m)
