"""report.md says what happened (issue #45 item 11): a failure's whole message, whether an interrupted run has a
checkpoint to resume from, the SFT warm start's steps, and the trajectories that failed."""

from __future__ import annotations

import json

import pytest

from skyrl_stepwise.run.config import RunConfig
from skyrl_stepwise.run.report import write_run_report
from skyrl_stepwise.loop.divergence import DivergenceConfig, DivergenceError, DivergenceGuard


def _cfg(tmp_path) -> RunConfig:
    cfg = RunConfig()
    cfg.total_steps, cfg.trainer.ckpt_dir = 3, str(tmp_path / "ckpts")
    return cfg


def _divergence() -> DivergenceError:
    guard = DivergenceGuard(DivergenceConfig(), "sft.divergence", loss_key="sft/loss", entropy_key="sft/entropy",
                            what="sft step")
    guard.check(1, {"sft/entropy": 3.8})
    try:
        guard.check(2, {"sft/entropy": 8.5})
    except DivergenceError as e:
        return e
    raise AssertionError("the guard did not fire")


def test_a_failure_is_reported_with_its_whole_message_and_the_sft_steps_are_in_the_report(tmp_path):
    """The guard's message is one line of ~500 characters; the report cut it at 300, mid-sentence."""
    error = _divergence()
    (tmp_path / "sft_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "sft/loss": 15.0, "train/grad_norm": 487.0, "sft/entropy": 3.8, "train/lr": 0.0},
        {"step": 2, "sft/loss": 14.0, "train/grad_norm": 450.0, "sft/entropy": 8.5, "train/lr": 5e-5}]))
    text = write_run_report(_cfg(tmp_path), tmp_path, failure=error).read_text()
    assert len(str(error)) > 300
    assert f"`DivergenceError: {error}`" in text and text.count("to train anyway.") == 1
    assert "## SFT warm start" in text and "| 2 | 14 | 450 | 8.5 | 5e-05 |" in text
    assert "`sft_metrics.jsonl`: every SFT warm-start step" in text


def test_a_very_long_failure_line_is_cut_after_a_full_sentence(tmp_path):
    from skyrl_stepwise.run.report import failure_text

    line = "First sentence here. " * 200
    cut = failure_text(RuntimeError(line + "\nsecond line"))
    assert cut.endswith("here. [...]") and len(cut) <= 2010 and "second line" not in cut


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_an_interrupted_run_without_a_checkpoint_does_not_promise_a_resume(tmp_path):
    cfg = _cfg(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.0}) + "\n")
    text = write_run_report(cfg, tmp_path, failure=KeyboardInterrupt("stopped by SIGTERM")).read_text()
    assert "**interrupted at step 1** of 3" in text
    assert "resumes from the last complete checkpoint" not in text
    assert f"No checkpoint was saved before that (trainer.ckpt_interval={cfg.trainer.ckpt_interval})" in text
    from skyrl_stepwise.checkpoint.store import COMPLETE

    step = tmp_path / "ckpts" / "step_1"  # with one: named
    step.mkdir(parents=True)
    (step / COMPLETE).write_text("ok")
    text = write_run_report(cfg, tmp_path, failure=KeyboardInterrupt()).read_text()
    assert "The same command resumes from the last complete checkpoint, step_1 (see Files)." in text


def test_the_report_names_the_export_command_of_its_checkpoints(tmp_path):
    from skyrl_stepwise.checkpoint.store import COMPLETE

    cfg = _cfg(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.0}) + "\n")
    assert "model export" not in write_run_report(cfg, tmp_path).read_text()  # nothing to export yet
    step = tmp_path / "ckpts" / "step_1"
    step.mkdir(parents=True)
    (step / COMPLETE).write_text("ok")
    text = write_run_report(cfg, tmp_path).read_text()
    assert f"`skyrl-stepwise model export {(tmp_path / 'ckpts').resolve()} --out <dir>`" in text
    assert "--adapter-only" not in text
    cfg.trainer.lora.enabled = True
    assert "(`--adapter-only`: the LoRA adapter in peft format)" in write_run_report(cfg, tmp_path).read_text()
