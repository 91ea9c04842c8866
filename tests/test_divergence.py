"""The divergence guard stops SFT and RL on an update that blew the model up, naming step, metric, start and key;
SFT warms up by default; the guard's thresholds stay out of the SFT cache key, the warm-up does not."""

from __future__ import annotations

import pytest

from skyrl_stepwise.loop.divergence import DivergenceConfig, DivergenceError, DivergenceGuard
from skyrl_stepwise.loop.sft import SFTConfig, train_sft


def _run(guard: DivergenceGuard, steps: list[dict[str, float]]) -> int:
    """Feed the steps; the number of steps judged healthy."""
    for step, metrics in enumerate(steps, 1):
        guard.check(step, metrics)
    return len(steps)


def test_the_gemma_sft_step_is_stopped_naming_the_metric_its_start_and_the_key():
    """The reported trial: entropy 2.9 -> 7.1 and grad norm 448 after one lr 5e-5 step."""
    guard = DivergenceGuard(DivergenceConfig(), "sft.divergence", loss_key="sft/loss", entropy_key="sft/entropy",
                            what="sft step")
    guard.check(1, {"train/grad_norm": 4.0, "sft/entropy": 2.9, "sft/loss": 1.6})
    with pytest.raises(DivergenceError) as e:
        guard.check(2, {"train/grad_norm": 448.0, "sft/entropy": 7.1, "sft/loss": 2.0})
    text = str(e.value)
    assert "sft step 2" in text and "train/grad_norm = 448" in text and "(4, the median of the first 1 step)" in text
    assert "sft.divergence.grad_norm_factor=20" in text and "num_warmup_steps" in text


@pytest.mark.parametrize("metric, values, key", [
    ("sft/entropy", [2.9, 3.0, 2.8, 5.1], "entropy_rise_nats"),
    ("sft/loss", [1.5, 1.4, 1.3, 4.7], "loss_factor"),
    ("train/grad_norm", [1.0, 2.0, 1.5, 40.0], "grad_norm_factor"),
])
def test_each_metric_far_from_its_start_stops_the_run(metric, values, key):
    guard = DivergenceGuard(DivergenceConfig(), "sft.divergence", loss_key="sft/loss", entropy_key="sft/entropy")
    _run(guard, [{metric: v} for v in values[:-1]])
    with pytest.raises(DivergenceError, match=rf"step 4: {metric} = .*sft\.divergence\.{key}="):
        guard.check(4, {metric: values[-1]})


def test_healthy_runs_pass():
    """SFT lowering loss and entropy; RL whose first batches barely had an advantage (grad norm 0 or tiny) and
    whose norm then rises to an ordinary 3 (below grad_norm_floor); a skipped step's inf grad norm."""
    sft = DivergenceGuard(DivergenceConfig(), "sft.divergence", loss_key="sft/loss", entropy_key="sft/entropy")
    assert _run(sft, [{"train/grad_norm": g, "sft/loss": l, "sft/entropy": h}
                      for g, l, h in [(8, 2.0, 3.0), (6, 1.5, 2.6), (5, 1.2, 2.2), (30, 1.1, 2.0), (4, 0.9, 1.5)]]) == 5
    rl = DivergenceGuard(DivergenceConfig(), "trainer.divergence")
    assert _run(rl, [{"train/grad_norm": g, "policy/entropy": 0.8, "policy/loss": loss}
                     for g, loss in [(0.0, 0.0), (0.01, -0.3), (float("inf"), 5.0), (3.0, 9.0), (2.0, -9.0)]]) == 5


def test_a_check_set_to_null_or_the_guard_disabled_lets_the_run_go_on():
    steps = [{"train/grad_norm": 1.0}, {"train/grad_norm": 1000.0}]
    assert _run(DivergenceGuard(DivergenceConfig(grad_norm_factor=None), "trainer.divergence"), steps) == 2
    assert _run(DivergenceGuard(DivergenceConfig(enabled=False), "trainer.divergence"), steps) == 2
    with pytest.raises(DivergenceError):
        _run(DivergenceGuard(DivergenceConfig(), "trainer.divergence"), steps)


class _ScriptedPolicy:
    """train_step answers with the next scripted metrics."""

    def __init__(self, metrics: list[dict[str, float]]) -> None:
        self.metrics, self.calls = list(metrics), 0

    def call(self, method: str, *args):
        assert method == "train_step"
        self.calls += 1
        return self.metrics.pop(0)


def test_train_sft_stops_at_the_diverged_step_after_logging_it():
    policy = _ScriptedPolicy([{"sft/loss": 1.0, "train/grad_norm": 2.0}, {"sft/loss": 9.0, "train/grad_norm": 2.0},
                              {"sft/loss": 0.5, "train/grad_norm": 2.0}])
    logged = []
    guard = DivergenceGuard(SFTConfig().divergence, "sft.divergence", loss_key="sft/loss", what="sft step")
    with pytest.raises(DivergenceError, match=r"sft step 2: sft/loss = 9, 9\.0x its start"):
        train_sft(policy, [object()] * 3, on_step=lambda step, m: logged.append(step), guard=guard)
    assert policy.calls == 2 and logged == [1, 2]


def test_sft_warms_up_by_default_and_validates_its_keys():
    cfg = SFTConfig()
    assert cfg.num_warmup_steps is None
    assert [cfg.warmup_steps(n) for n in (1, 6, 16, 1000)] == [1, 2, 4, 50]
    assert SFTConfig(num_warmup_steps=0).warmup_steps(6) == 0
    with pytest.raises(ValueError, match=r"sft\.num_warmup_steps must be >= 0"):
        SFTConfig(num_warmup_steps=-1).validate()
    with pytest.raises(ValueError, match=r"sft\.divergence\.grad_norm_factor must be > 1"):
        SFTConfig(divergence=DivergenceConfig(grad_norm_factor=0.5)).validate()


def test_rl_guard_keys_are_validated_with_their_path():
    from skyrl_stepwise.run.app_config import load_config

    with pytest.raises(ValueError, match=r"trainer\.divergence\.entropy_rise_nats must be > 0"):
        load_config(["experiment=search_r1_tiny", "trainer.divergence.entropy_rise_nats=0"])


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_sft_cache_key_ignores_the_guard_but_not_the_warmup():
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.loop.warm_start import cache_key

    base = cache_key(load_config(["experiment=search_r1_tiny"]), "digest")
    for override in ("sft.divergence.grad_norm_factor=50", "sft.divergence.enabled=false",
                     "trainer.divergence.entropy_rise_nats=1"):
        assert cache_key(load_config(["experiment=search_r1_tiny", override]), "digest") == base, override
    assert cache_key(load_config(["experiment=search_r1_tiny", "sft.num_warmup_steps=2"]), "digest") != base


def _sft_batch():
    import torch

    from skyrl_stepwise.policy.batching import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (24, 16, 24, 16)]
    return TrainBatch(prompt_ids=ids[:2], response_ids=ids[2:], loss_masks=[[1] * 24, [1] * 16],
                      instance_ids=["a", "b"], advantages=[[0.0] * 24, [0.0] * 16])


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("lr, diverges", [(3.0, True), (1e-3, False)])
def test_a_tiny_model_at_a_huge_lr_is_stopped_and_a_sane_lr_is_not(tiny_model_dir, lr, diverges):
    """A real worker: SFT steps at lr 3 (no warm-up, clipping off) blow up the loss and grad norm; at 1e-3 the
    same steps train normally."""
    from skyrl_stepwise.policy.config import TrainerConfig

    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = TrainerConfig(model_path=str(tiny_model_dir), micro_batch_tokens=64)
    cfg.fsdp.world_size, cfg.fsdp.mixed_precision = 1, False
    cfg.optim.lr, cfg.optim.max_grad_norm = lr, 1e9
    worker, batch = PolicyWorker(cfg), _sft_batch()
    guard = DivergenceGuard(DivergenceConfig(), "sft.divergence", loss_key="sft/loss", entropy_key="sft/entropy")

    def steps() -> None:
        for step in range(1, 9):
            guard.check(step, worker.train_step(batch, "sft"))

    if diverges:
        with pytest.raises(DivergenceError, match=r"sft\.divergence\."):
            steps()
    else:
        steps()
