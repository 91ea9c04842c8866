"""The tracker: no credential reaches a log, and a resumed run's metrics.jsonl lists every step once."""

from __future__ import annotations

import json
import logging

from skyrl_stepwise.loop.tracking import Tracker, scrub


def test_scrub_drops_credentials_and_keeps_token_counts():
    config = {"hf_token": "x", "logging": {"wandb_api_key": "y", "project": "p"}, "password": "z",
              "trainer": {"micro_batch_tokens": 4096, "secret_sauce": 1}, "max_tokens": 8}
    assert scrub(config) == {"logging": {"project": "p"}, "trainer": {"micro_batch_tokens": 4096}, "max_tokens": 8}


def test_rewind_drops_steps_logged_after_the_checkpoint(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="skyrl_stepwise")
    tracker = Tracker(tmp_path, "p", "r", "disabled", {})
    for step in (1, 2, 3):
        tracker.log({"reward/mean": float(step)}, step, {"prompts": [f"q{step}"]})
    tracker.finish()
    with open(tmp_path / "metrics.jsonl", "a") as f:  # and killed while writing step 4's record
        f.write('{"step": 4, "reward/me')
    # the run was killed after logging step 3 but before checkpointing it; it resumes from step 2
    resumed = Tracker(tmp_path, "p", "r", "disabled", {})
    resumed.rewind(2)
    resumed.log({"reward/mean": 30.0}, 3)
    resumed.finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert records[0]["prompts"] == ["q1"]
    assert "step 3: reward=30" in caplog.text  # the console line, through the skyrl_stepwise logger


def test_a_skipped_update_is_on_the_console_line_and_in_the_report(tmp_path, caplog):
    """train/skipped_step (a non-finite gradient norm: the whole batch's gradient lost) was in neither."""
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.run.report import write_run_report

    caplog.set_level(logging.INFO, logger="skyrl_stepwise")
    tracker = Tracker(tmp_path, "p", "r", "disabled", {})
    tracker.log({"reward/mean": 0.5, "train/skipped_step": 0.0, "train/optimizer_steps": 2.0}, 1)
    tracker.log({"reward/mean": 0.25, "train/skipped_step": 2.0, "train/optimizer_steps": 0.0}, 2)
    tracker.finish()
    lines = {r.message.split(":")[0]: r for r in caplog.records if r.message.startswith("step ")}
    assert "SKIPPED" not in lines["step 1"].message and lines["step 1"].levelno == logging.INFO
    assert "SKIPPED 2 OF 2 OPTIMIZER UPDATE(S)" in lines["step 2"].message
    assert lines["step 2"].levelno == logging.WARNING  # shown however quiet the console is

    cfg = RunConfig()
    cfg.total_steps, cfg.trainer.ckpt_dir = 2, str(tmp_path / "ckpts")
    text = write_run_report(cfg, tmp_path).read_text()
    assert "**1 of 2 steps skipped optimizer updates** (step 2: skipped 2 of 2 optimizer update(s))" in text
    head = next(line for line in text.splitlines() if line.startswith("| step"))
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert "skipped updates" in head and rows[1].split("|")[head.split("|").index(" skipped updates ")].strip() == "2"
