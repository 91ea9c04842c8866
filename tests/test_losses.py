"""PPO loss: clipping, dual clip, truncated IS, KL, and the mini-batch token-mean reduction."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_stepwise.policy.config import AlgorithmConfig
from skyrl_stepwise.algorithms.losses import kl_penalty, policy_loss

PLAIN = AlgorithmConfig(use_kl_loss=False, tis_ratio_clip_high=None)


def _loss(logprobs, old, adv, mask, cfg=PLAIN, n=None, **kw):
    lp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(lp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                                torch.tensor(mask, dtype=torch.float64), cfg, n if n is not None else sum(mask),
                                **{k: torch.tensor(v, dtype=torch.float64) for k, v in kw.items()})
    loss.backward()
    return loss.item(), lp.grad.tolist(), metrics


def test_ppo_clip_values_and_gradients():
    # ratios: 1.5 (A>0, clipped at 1.28), 0.5 (A<0, clipped at 0.8), 1.1 (A>0, inside), masked token
    r = [1.5, 0.5, 1.1, 3.0]
    old = [-1.0, -2.0, -0.5, -1.0]
    lp = [o + math.log(x) for o, x in zip(old, r)]
    adv, mask = [2.0, -1.0, 1.0, 5.0], [1, 1, 1, 0]
    loss, grad, m = _loss(lp, old, adv, mask)
    expected = (-2.0 * 1.28 + 1.0 * 0.8 + -1.0 * 1.1) / 3
    assert loss == pytest.approx(expected)
    # clipped tokens get no gradient; the live one gets -A * ratio / N; the masked one nothing
    assert grad == pytest.approx([0.0, 0.0, -1.0 * 1.1 / 3, 0.0])
    assert m["policy/clip_frac"] == pytest.approx(2 / 3)
    assert m["policy/loss"] == pytest.approx(expected)


def test_dual_clip_caps_negative_advantage_loss():
    cfg = AlgorithmConfig(use_kl_loss=False, tis_ratio_clip_high=None, dual_clip_c=3.0)
    loss, grad, _ = _loss([math.log(10.0)], [0.0], [-1.0], [1], cfg=cfg)
    assert loss == pytest.approx(3.0) and grad == [0.0]
    loss_no_dual, _, _ = _loss([math.log(10.0)], [0.0], [-1.0], [1])
    assert loss_no_dual == pytest.approx(10.0)


def test_truncated_is_weights_are_clipped_detached_and_ignore_masked_placeholders():
    cfg = AlgorithmConfig(use_kl_loss=False, tis_ratio_clip_high=2.0)
    old = [-1.0, -1.0, -60.0]
    rollout = [-1.5, -3.0, 0.0]  # weights e^0.5, e^2 -> 2.0; the masked token's placeholder would be e^-60
    loss, grad, m = _loss(old, old, [1.0, 1.0, 1.0], [1, 1, 0], cfg=cfg, rollout_logprobs=rollout)
    w = [math.exp(0.5), 2.0]
    assert loss == pytest.approx(-(w[0] + w[1]) / 2)
    assert grad == pytest.approx([-w[0] / 2, -w[1] / 2, 0.0])  # the weight scales, but is not differentiated
    assert m["policy/tis_clip_frac"] == pytest.approx(0.5)
    assert m["policy/tis_weight"] == pytest.approx(sum(w) / 2)
    # a placeholder that would overflow exp() must not poison the loss
    loss, grad, _ = _loss([-1.0, -1.0], [-1.0, 200.0], [1.0, 1.0], [1, 0], cfg=cfg, rollout_logprobs=[-1.0, -500.0])
    assert math.isfinite(loss) and all(map(math.isfinite, grad))


def test_low_var_kl_loss():
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5, tis_ratio_clip_high=None)
    lp, ref = [-1.0, -2.0], [-1.5, -2.0]
    loss, _, m = _loss(lp, lp, [0.0, 0.0], [1, 1], cfg=cfg, ref_logprobs=ref)
    k3 = math.exp(-0.5) + 0.5 - 1  # exp(ref - lp) - (ref - lp) - 1
    assert m["policy/kl_loss"] == pytest.approx(k3 / 2)
    assert loss == pytest.approx(0.5 * k3 / 2)
    x = torch.randn(1000, dtype=torch.float64)
    assert (kl_penalty(x, x + torch.randn(1000, dtype=torch.float64)) >= 0).all()
    assert kl_penalty(x, x).abs().max() == 0


def test_token_mean_over_the_mini_batch_not_per_micro_batch():
    g = torch.Generator().manual_seed(0)
    n = 50
    lp, old = torch.randn(n, generator=g) - 2, torch.randn(n, generator=g) - 2
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).double()
    cfg = PLAIN
    full, _, _ = _loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), cfg=cfg)
    total = int(mask.sum())
    # two uneven micro-batches, each divided by the mini-batch token count, sum to the same loss
    parts = [_loss(lp[s].tolist(), old[s].tolist(), adv[s].tolist(), mask[s].tolist(), cfg=cfg, n=total)[0]
             for s in (slice(0, 7), slice(7, n))]
    assert sum(parts) == pytest.approx(full)
    # whereas averaging per micro-batch would weight the short one's tokens up
    per_mb = [_loss(lp[s].tolist(), old[s].tolist(), adv[s].tolist(), mask[s].tolist(), cfg=cfg)[0]
              for s in (slice(0, 7), slice(7, n))]
    assert sum(per_mb) / 2 != pytest.approx(full)


def test_missing_inputs_name_the_config_key():
    with pytest.raises(ValueError, match="tis_ratio_clip_high"):
        _loss([-1.0], [-1.0], [1.0], [1], cfg=AlgorithmConfig(use_kl_loss=False))
    with pytest.raises(ValueError, match="use_kl_loss"):
        _loss([-1.0], [-1.0], [1.0], [1], cfg=AlgorithmConfig(tis_ratio_clip_high=0))


def test_low_var_kl_survives_an_extreme_token():
    """ref - logp > ~88 used to overflow exp() in fp32: inf loss, nan gradient, the whole step skipped."""
    lp = torch.tensor([-1.0, -2.0, -100.0, -300.0], requires_grad=True)
    ref = torch.tensor([-1.5, -2.0, -0.5, 0.0])  # the last two: ref far above the policy (or a placeholder)
    kl = kl_penalty(lp, ref)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    assert kl[2:].tolist() == [10.0, 10.0]  # the final clamp as in verl
    torch.testing.assert_close(kl[:2], torch.tensor([math.exp(-0.5) + 0.5 - 1, 0.0]))  # normal tokens unchanged
    # and through the (fp64) loss, live or masked: finite, and the normal token's gradient is the usual one
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5, tis_ratio_clip_high=None)
    for mask in ([1, 1], [1, 0]):
        loss, grad, _ = _loss([-1.0, -1000.0], [-1.0, -1000.0], [0.0, 0.0], mask, cfg=cfg, ref_logprobs=[-1.5, 0.0])
        assert math.isfinite(loss) and all(map(math.isfinite, grad))
        assert grad[0] == pytest.approx(0.5 * (1 - math.exp(-0.5)) / sum(mask))


def test_trajectory_mean_weighs_every_trajectory_once_however_it_is_cut():
    """Trajectory A: 1 loss token (advantage 1) in one step; B: 3 loss tokens (advantage 2) over two steps, with
    an observation token masked. token_mean: -(1 + 2 + 2 + 2) / 4; trajectory_mean: -(1 / 1 + 6 / 3) / 2."""
    from skyrl_stepwise.generator import GeneratorOutput, TrajectoryID
    from skyrl_stepwise.algorithms.advantages import loss_weights
    from skyrl_stepwise.policy.batching import TrainBatch, pack_micro_batch

    a, b = TrajectoryID("q", 0), TrajectoryID("q", 1)
    output = GeneratorOutput(prompt_token_ids=[[1], [1], [1, 5, 6, 7]], response_ids=[[2], [5, 6], [8, 9]],
                             rewards=[0.0, 0.0, 0.0], loss_masks=[[1], [1, 0], [1, 1]], trajectory_ids=[a, b, b])
    advantages = [[1.0], [2.0, 2.0], [2.0, 2.0]]
    for reduction, expected in (("token_mean", -7 / 4), ("trajectory_mean", -(1 + 2) / 2)):
        cfg = AlgorithmConfig(use_kl_loss=False, tis_ratio_clip_high=None, loss_reduction=reduction)
        weights = loss_weights(output, cfg)
        batch = TrainBatch.from_output(output, advantages, loss_weights=weights)
        assert batch.loss_denominator() == pytest.approx(4 if reduction == "token_mean" else 2)
        mb = pack_micro_batch(batch, [0, 1, 2])
        lp = torch.zeros(5, dtype=torch.float64)
        loss, _ = policy_loss(lp, lp, mb.advantages.double(), mb.loss_mask.double(), cfg, batch.loss_denominator(),
                              loss_weights=mb.loss_weights)
        assert loss.item() == pytest.approx(expected), reduction
    assert loss_weights(output, cfg) == [[1.0], [1 / 3, 1 / 3], [1 / 3, 1 / 3]]


def test_an_unknown_loss_reduction_names_the_choices():
    with pytest.raises(ValueError, match=r"trainer.algorithm.loss_reduction: 'seq_mean' is not one of"):
        AlgorithmConfig(loss_reduction="seq_mean").validate()


def test_agreement_gap_is_measured_on_loss_masked_tokens_before_the_update():
    """The alarm's evidence: |trainer - engine| logprob of the tokens trained, the trainer's being the pre-update
    (old) ones; a masked placeholder (0.0 vs -500) must not count, and TIS on or off does not matter."""
    for cfg in (PLAIN, AlgorithmConfig(use_kl_loss=False, tis_ratio_clip_high=2.0)):
        _, _, m = _loss([-1.0, -2.0, -1.0], [-1.0, -2.0, 0.0], [1.0, 1.0, 1.0], [1, 1, 0], cfg=cfg,
                        rollout_logprobs=[-1.1, -2.4, -500.0])
        assert m["agreement/logprob_abs_diff_mean"] == pytest.approx((0.1 + 0.4) / 2)
        assert m["agreement/logprob_abs_diff_max"] == pytest.approx(0.4)
    _, _, m = _loss([-1.0], [-1.0], [1.0], [1])
    assert "agreement/logprob_abs_diff_mean" not in m  # no engine logprobs: nothing measured, nothing made up


def _zero_signal_batch(advantage: float = 0.0):
    from skyrl_stepwise.policy.batching import TrainBatch

    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    responses = [[8, 9, 10, 11, 12], [13, 14, 15]]
    masks = [[1, 1, 0, 1, 1], [1, 1, 1]]
    advantages = [[advantage] * 5, [advantage] * 3]
    advantages[0][2] = 0.7  # an observation token: untrained, its advantage is never read
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=masks, instance_ids=["a", "b"],
                      advantages=advantages)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_batch_without_signal_skips_forward_and_backward_with_the_weights_of_the_full_pass(tiny_model_dir,
                                                                                            monkeypatch):
    """Every trained advantage 0 and no KL term: the gradient is exactly 0, so the update skips its forward and
    backward (2.5 min a step on the issue's box) and AdamW steps on zeros: weights bitwise those of the full
    pass (momentum and weight decay still move them); with a KL term, or one non-zero advantage, it runs."""
    from skyrl_stepwise.policy import fsdp_worker
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.algorithms.losses import no_gradient

    def worker(use_kl: bool = False):
        cfg = TrainerConfig(model_path=str(tiny_model_dir), micro_batch_tokens=64)
        cfg.fsdp.mixed_precision = False
        cfg.optim.lr = 1e-2
        cfg.algorithm.use_kl_loss, cfg.algorithm.tis_ratio_clip_high = use_kl, None  # no rollout logprobs here
        return PolicyWorker(cfg)

    batch = _zero_signal_batch()
    assert no_gradient(batch, worker().cfg.algorithm)
    assert not no_gradient(_zero_signal_batch(0.5), worker().cfg.algorithm)
    assert not no_gradient(batch, worker(use_kl=True).cfg.algorithm)

    full = worker()  # a nudge first, so AdamW has momentum that a zero-gradient step carries on
    full.train_step(_zero_signal_batch(0.5))
    skipping = worker()
    skipping.train_step(_zero_signal_batch(0.5))
    with monkeypatch.context() as m:
        m.setattr(fsdp_worker, "no_gradient", lambda batch, algorithm: False)
        ran = full.train_step(batch)
    forward_calls = []
    real_forward = fsdp_worker.forward_logprobs
    monkeypatch.setattr(fsdp_worker, "forward_logprobs",
                        lambda *a, **k: forward_calls.append(1) or real_forward(*a, **k))
    skipped = skipping.train_step(batch)
    assert ran["train/grad_norm"] == 0.0 and "train/forward_skipped" not in ran
    assert skipped["train/forward_skipped"] == 1.0 and skipped["train/grad_norm"] == 0.0 and forward_calls == []
    assert skipped["train/lr"] == ran["train/lr"]
    assert skipping.weights_checksum() == full.weights_checksum()
    before = skipping.weights_checksum()
    skipping.train_step(batch)
    assert skipping.weights_checksum() != before  # momentum and weight decay: the step was taken, not dropped


def test_the_step_line_says_the_update_was_skipped_and_counts_failed_trajectories(tmp_path, caplog):
    import logging

    from skyrl_stepwise.loop.tracking import Tracker

    caplog.set_level(logging.INFO, logger="skyrl_stepwise")
    tracker = Tracker(tmp_path, "p", "r", "disabled", {})
    tracker.log({"reward/mean": 0.0, "train/forward_skipped": 2.0, "train/optimizer_steps": 2.0,
                 "train/skipped_step": 0.0, "generate/failed_trajectories": 3.0,
                 "generate/failed_trajectories/env_step": 3.0, "generate/failed_trajectories/env_reset": 0.0}, 1)
    tracker.log({"reward/mean": 0.5, "train/optimizer_steps": 1.0, "generate/failed_trajectories": 0.0}, 2)
    tracker.finish()
    lines = [r.message for r in caplog.records if r.message.startswith("step ")]
    assert "no signal: forward/backward skipped on 2 of 2 update(s)" in lines[0]
    assert "3 trajectories failed (env_step 3; not trained)" in lines[0]
    assert "|" not in lines[1]
