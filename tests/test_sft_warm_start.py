"""The SFT warm start picks its lr and warm-up from what it sees (issue #45 item 11): a model that has never produced
the chat format's turn terminator (Gemma 3 270M base: 15-30 nats) diverged at the recipe's lr 5e-5 after one
warm-up step. SFT measures that cost before its first step, lowers the lr and lengthens the warm-up, says so in one
line, writes every step's metrics to the run dir as they happen, and the guard has an absolute grad-norm bound."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from skyrl_stepwise.loop.divergence import DivergenceConfig, DivergenceError, DivergenceGuard
from skyrl_stepwise.loop.sft import SFTConfig, terminator_nats, warm_start_settings


def test_a_terminator_the_model_never_produced_lowers_the_lr_and_lengthens_the_warmup():
    cfg = SFTConfig()  # lr 5e-5, warm-up a quarter of the steps
    base = warm_start_settings(cfg, 16, "<end_of_turn>", 21.3)
    assert (base.lr, base.warmup_steps, base.adjusted) == (1e-5, 8, True)
    line = base.describe(cfg, cfg.warmup_steps(16))
    assert "base model" in line and "'<end_of_turn>' costs 21.3 nats" in line and "lr 1e-05, warm-up 8 steps" in line
    assert "sft.lr=5e-05 after 4" in line and "sft.unseen_terminator_nats=null" in line
    short = warm_start_settings(cfg, 3, "<end_of_turn>", 21.3)  # never a warm-up longer than the run
    assert (short.lr, short.warmup_steps) == (1e-5, 3)
    instruct = warm_start_settings(cfg, 16, "<|im_end|>", 0.4)  # an instruct model keeps the recipe's settings
    assert (instruct.lr, instruct.warmup_steps, instruct.adjusted) == (5e-5, 4, False)
    assert "costs 0.4 nats -> lr 5e-05, warm-up 4 steps" in instruct.describe(cfg, 4)
    off = warm_start_settings(replace(cfg, unseen_terminator_nats=None), 16, "<end_of_turn>", 21.3)
    assert (off.lr, off.warmup_steps) == (5e-5, 4)
    lower = warm_start_settings(replace(cfg, lr=1e-6), 16, "<end_of_turn>", 21.3)  # a lower sft.lr is kept
    assert lower.lr == 1e-6


def test_the_terminator_cost_is_the_mean_loss_on_trained_terminators_only():
    masks = [[0, 1, 1, 1], [1, 1]]
    ids = [[9, 5, 9, 7], [9, 9]]  # 9: the terminator; the first one is in the (untrained) observation
    logprobs = [[-50.0, -1.0, -20.0, -2.0], [-10.0, -30.0]]
    assert terminator_nats(masks, ids, logprobs, 9) == pytest.approx(20.0)
    assert terminator_nats(masks, ids, logprobs, 3) is None


@pytest.mark.parametrize("key, value", [("unseen_terminator_nats", 0.0), ("unseen_terminator_lr", 0.0),
                                        ("unseen_terminator_warmup_steps", -1)])
def test_the_unseen_terminator_keys_are_validated(key, value):
    with pytest.raises(ValueError, match=rf"sft\.{key} must be"):
        replace(SFTConfig(), **{key: value}).validate()


def test_a_wild_first_step_is_caught_by_the_absolute_grad_norm_bound():
    """Relative to a start of 487 (step 1 already wild), a step of 3000 is only 6x: the relative check cannot
    fire; the absolute bound does, also at step 1, and names its key."""
    steps = [{"train/grad_norm": 487.0, "sft/entropy": 3.8}, {"train/grad_norm": 480.0, "sft/entropy": 3.9},
             {"train/grad_norm": 3000.0, "sft/entropy": 4.5}]
    guard = DivergenceGuard(DivergenceConfig(), "sft.divergence", loss_key="sft/loss", entropy_key="sft/entropy",
                            what="sft step")
    guard.check(1, steps[0])
    guard.check(2, steps[1])
    with pytest.raises(DivergenceError, match=r"sft step 3: train/grad_norm = 3000, past sft\.divergence\."
                                              r"grad_norm_max=1000 \(an absolute bound"):
        guard.check(3, steps[2])
    first = DivergenceGuard(DivergenceConfig(), "trainer.divergence")
    with pytest.raises(DivergenceError, match=r"step 1: .*trainer\.divergence\.grad_norm_max=1000"):
        first.check(1, {"train/grad_norm": 5000.0})
    off = DivergenceGuard(DivergenceConfig(grad_norm_max=None), "sft.divergence")
    for step, metrics in enumerate(steps, 1):
        off.check(step, metrics)
    with pytest.raises(ValueError, match=r"sft\.divergence\.grad_norm_max must be > 0"):
        DivergenceConfig(grad_norm_max=0).validate("sft.divergence")


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_set_optim_changes_lr_and_warmup_before_the_first_step_and_is_refused_after(tiny_model_dir):
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from test_divergence import _sft_batch

    cfg = TrainerConfig(model_path=str(tiny_model_dir), micro_batch_tokens=64)
    cfg.fsdp.mixed_precision = False
    cfg.optim.lr, cfg.optim.num_warmup_steps = 5e-5, 0
    worker, batch = PolicyWorker(cfg), _sft_batch()
    worker.set_optim(replace(cfg.optim, lr=1e-5, num_warmup_steps=4))
    lrs = [worker.train_step(batch, "sft")["train/lr"] for _ in range(3)]
    assert lrs == pytest.approx([0.0, 2.5e-6, 5e-6])
    with pytest.raises(RuntimeError, match="set_optim after an optimizer step"):
        worker.set_optim(cfg.optim)


class _FakePolicyGroup:
    """Stands in for the FSDP ranks: the base model pays `nats` for every token, train_step answers scripted
    metrics; records what SFT asked of it."""

    instances: list = []

    def __init__(self, cfg, actor_options=None, **kwargs) -> None:
        self.cfg, self.calls = cfg, []
        self.metrics = list(_FakePolicyGroup.script)
        _FakePolicyGroup.instances.append(self)

    def call(self, method, *args):
        self.calls.append((method, args))
        if method == "compute_logprobs":
            return [[-_FakePolicyGroup.nats] * len(r) for r in args[0].response_ids]
        if method == "train_step":
            return self.metrics.pop(0)
        if method == "export_weights":
            open(args[0], "wb").close()
        if method == "packing_summary":  # what a worker says at start-up (no dropout turned off here)
            return {"notes": []}
        return None

    def shutdown(self) -> None:
        pass


def _sft_setup(monkeypatch, tmp_path, model_path, nats: float, script: list[dict]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.policy import worker_group

    conversations = [[{"role": "user", "content": f"What is {i} + {i}?"},
                      {"role": "assistant", "content": str(2 * i)}] for i in range(16)]
    data = tmp_path / "demos.parquet"
    pq.write_table(pa.table({"messages": conversations}), data)
    monkeypatch.setenv("SKYRL_STEPWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(worker_group, "PolicyGroup", _FakePolicyGroup)
    _FakePolicyGroup.instances, _FakePolicyGroup.nats, _FakePolicyGroup.script = [], nats, script
    cfg = load_config(["experiment=search_r1_tiny", f"sft.data={data}", "sft.batch_size=4", "sft.epochs=1",
                       f"logging.output_dir={tmp_path / 'run'}"])
    cfg.trainer.model_path = str(model_path)
    return cfg


def _step(loss: float, grad_norm: float, entropy: float, lr: float = 0.0) -> dict:
    return {"sft/loss": loss, "train/grad_norm": grad_norm, "sft/entropy": entropy, "train/lr": lr,
            "train/step_time_s": 1.0}


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_sft_on_a_model_that_never_produced_its_terminator_lowers_the_lr_and_says_so(monkeypatch, tmp_path,
                                                                                    model_path):
    from skyrl_stepwise.loop.warm_start import sft_model

    cfg = _sft_setup(monkeypatch, tmp_path, model_path, 21.3, [_step(15.0 - k, 400.0, 3.8) for k in range(4)])
    lines: list[str] = []
    metrics_path = tmp_path / "run" / "sft_metrics.jsonl"
    sft_model(cfg, lines.append, metrics_path=metrics_path)
    said = [line for line in lines if "warm start" in line]
    assert len(said) == 1 and "base model" in said[0] and "costs 21.3 nats" in said[0], lines
    assert "-> lr 1e-05, warm-up 4 steps" in said[0]  # 4 steps in all: the warm-up spans the run
    # measured, then set, before any step (the start-up packing summary is only read)
    calls = [(m, args) for m, args in _FakePolicyGroup.instances[0].calls if m != "packing_summary"]
    assert [m for m, _ in calls[:3]] == ["compute_logprobs", "set_optim", "train_step"]
    assert (calls[1][1][0].lr, calls[1][1][0].num_warmup_steps) == (1e-5, 4)
    assert [json.loads(line)["step"] for line in metrics_path.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_diverged_warm_start_leaves_its_steps_in_the_run_dir(monkeypatch, tmp_path, model_path):
    """An instruct-like model (terminator 0.3 nats) keeps sft.lr; its divergence at step 3 stops SFT, and the
    steps up to it are in sft_metrics.jsonl, not only on the console."""
    from skyrl_stepwise.loop.warm_start import sft_model

    cfg = _sft_setup(monkeypatch, tmp_path, model_path, 0.3,
                     [_step(2.0, 5.0, 2.9), _step(1.9, 6.0, 2.8), _step(9.0, 400.0, 8.5), _step(1.0, 1.0, 1.0)])
    lines: list[str] = []
    metrics_path = tmp_path / "run" / "sft_metrics.jsonl"
    with pytest.raises(DivergenceError, match="sft step 3"):
        sft_model(cfg, lines.append, metrics_path=metrics_path)
    assert any("costs 0.3 nats -> lr 5e-05" in line for line in lines), lines
    assert "set_optim" not in [m for m, _ in _FakePolicyGroup.instances[0].calls]
    logged = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3] and logged[-1]["sft/entropy"] == 8.5
