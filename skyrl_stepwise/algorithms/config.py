"""The algorithm's typed config (`trainer.algorithm.*`): estimator, clipping, KL, loss reduction, step credit.

It sits with the algorithm, below the policy worker that nests it in TrainerConfig, so advantages, credit and
losses never import the policy room. Every `validate` names the full key path of the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass

ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
KL_LOSS_TYPES = ("low_var_kl", "k1", "k2")
LOSS_REDUCTIONS = ("token_mean", "trajectory_mean", "sequence_mean")
STEP_ADVANTAGES = ("outcome", "discounted", "gigpo")


@dataclass
class AlgorithmConfig:
    """What is optimised: per-step advantages (outcome by default), PPO clip, truncated IS, KL."""

    # grpo: score - the group's mean (/ its std, see norm_adv_by_std); rloo: score - the mean of the group's others
    advantage_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # grpo: divide by the group's score std (+1e-6); false: Dr. GRPO's unscaled advantage
    # How a trajectory's credit reaches its steps (algorithms/credit.py), always grouped by prompt:
    # outcome: the trajectory's advantage on every step; discounted: each step's return (its reward + gamma-
    # discounted later rewards) minus the group's mean trajectory return (a trajectory-level baseline: stopping
    # earlier earns nothing by itself); gigpo: the outcome advantage + step_advantage_weight x the step's return
    # normalised among the group's steps with an identical observation history (GiGPO's anchor states).
    step_advantage: str = "outcome"
    gamma: float = 1.0  # discount over turns (discounted, gigpo)
    step_advantage_weight: float = 1.0  # GiGPO's omega
    eps_clip_low: float = 0.2  # PPO clips the ratio new/old policy below at 1 - eps_clip_low
    eps_clip_high: float = 0.28  # ... and above at 1 + eps_clip_high (higher than low: DAPO's clip-higher)
    # Dual-clip PPO: caps the loss of negative-advantage tokens at dual_clip_c * |A|; None disables it.
    dual_clip_c: float | None = None
    # Token-level truncated importance sampling against the inference engine's logprobs: the weight
    # exp(old - rollout) is clipped at this value and detached. None or 0 disables it.
    tis_ratio_clip_high: float | None = 2.0
    use_kl_loss: bool = True  # add a KL-to-reference term to the loss (a frozen copy of the starting policy)
    kl_loss_coef: float = 0.001  # the KL term's weight in the loss
    kl_loss_type: str = "low_var_kl"  # the per-token KL estimator: low_var_kl (k3: >= 0, low variance) | k1 | k2
    # token_mean: sum of per-token losses / number of loss-masked tokens in the whole mini-batch (all ranks).
    # trajectory_mean: each trajectory's token mean, averaged over the mini-batch's trajectories, so a long
    # trajectory counts as much as a short one (rLLM's seq-mean-token-mean, per trajectory, not per sample).
    # Both sum over a trajectory's tokens, so splitting it into steps or merging steps never changes the loss.
    # sequence_mean: each sample's token mean, averaged over samples (SkyRL/verl's per-sequence mean, for parity with
    # their recipes). NOT merge-invariant: a 4-step trajectory weighs 4 samples step-wise and 1 merged.
    loss_reduction: str = "token_mean"
    # DAPO's dynamic sampling: a prompt group whose samples all scored the same has zero GRPO/RLOO advantage
    # and teaches nothing. When on, a step draws up to `max_sample_batches` batches of prompts until it has
    # data.train_batch_size groups with different scores, and trains on those only (generation is cheap next
    # to the update on small models; the data position stays a pure function of the step).
    dynamic_sampling: bool = False
    max_sample_batches: int = 3  # dynamic sampling: prompt batches a step draws at most (1: no redraw)
    # Dynamic sampling: how many of those draws are generated at once. 1: one after another, stopping as soon as the
    # step has its groups. More: the next draws run together, as one larger batch in the engines (on a CPU engine
    # decoding 32 trajectories costs little more than 16; the turns' tails overlap), and draws not needed are
    # generated but never trained. The same prompts and per-(trajectory, turn) seeds either way, so it pays off where
    # a step nearly always needs the later draws (measured: the main job's runs draw both in 12 of 12 steps).
    draws_at_once: int = 1

    def validate(self, prefix: str = "trainer.algorithm") -> None:
        """Reject settings that would silently optimise something else than intended."""
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"{prefix}.advantage_estimator: {self.advantage_estimator!r} cannot be broadcast "
                             f"step-wise; use grpo or rloo")
        if self.kl_loss_type not in KL_LOSS_TYPES:
            raise ValueError(f"{prefix}.kl_loss_type: {self.kl_loss_type!r} is not one of {KL_LOSS_TYPES}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"{prefix}.loss_reduction: {self.loss_reduction!r} is not one of {LOSS_REDUCTIONS}")
        if self.step_advantage not in STEP_ADVANTAGES:
            raise ValueError(f"{prefix}.step_advantage: {self.step_advantage!r} is not one of {STEP_ADVANTAGES}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"{prefix}.gamma must be in [0, 1], got {self.gamma}")
        if self.step_advantage_weight < 0:
            raise ValueError(f"{prefix}.step_advantage_weight must be >= 0, got {self.step_advantage_weight}")
        for key in ("eps_clip_low", "eps_clip_high", "kl_loss_coef"):
            if getattr(self, key) < 0:
                raise ValueError(f"{prefix}.{key} must be >= 0, got {getattr(self, key)}")
        if self.max_sample_batches < 1:
            raise ValueError(f"{prefix}.max_sample_batches must be >= 1, got {self.max_sample_batches}")
        if self.draws_at_once < 1:
            raise ValueError(f"{prefix}.draws_at_once must be >= 1, got {self.draws_at_once}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"{prefix}.dual_clip_c must be > 1 (or null to disable), got {self.dual_clip_c}")
        if self.tis_ratio_clip_high is not None and self.tis_ratio_clip_high < 0:
            raise ValueError(f"{prefix}.tis_ratio_clip_high must be > 0 (or null/0 to disable), "
                             f"got {self.tis_ratio_clip_high}")

    @property
    def use_tis(self) -> bool:
        """TIS is on unless the clip is null or 0 (both spellings mean 'off' in peer configs)."""
        return bool(self.tis_ratio_clip_high)
