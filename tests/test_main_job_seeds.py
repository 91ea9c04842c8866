"""benchmarks/main_job_seeds.py: each seed's row is read back from its run dir (evals.json, metrics.jsonl,
sft_metrics.jsonl) with the paired RL - SFT interval and the time per phase; the summary counts resolved gains and
their median; the table survives a failed seed and a rerun skips the seeds already done (issue 55)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
import sys
from pathlib import Path

from skyrl_stepwise.loop.evaluation import eval_result, paired_bootstrap, save_evals

REPO = Path(__file__).resolve().parents[1]
HOST = "Test CPU, 2 cores, no native bf16 (float32 fallback)"


def _module():
    spec = importlib.util.spec_from_file_location("bench_main_job_seeds", REPO / "benchmarks" / "main_job_seeds.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _run_dir(path: Path, sft: list[float], rl: list[float], cached_sft: Path | None = None) -> Path:
    """A finished main job's run dir: three eval stages, two RL steps, SFT trained now or read from `cached_sft`."""
    path.mkdir(parents=True)
    save_evals(path, [eval_result("before SFT", [0.0] * 4, seconds=50.0), eval_result("after SFT", sft, seconds=40.0),
                      eval_result("after RL (step 2)", rl, seconds=45.0)])
    steps = [{"step": s, "timing/generate_s": 20.0 + s, "timing/train_s": 60.0, "timing/old_logprobs_s": 5.0,
              "timing/weight_sync_s": 3.0, "timing/step_s": 90.0 + s} for s in (1, 2)]
    steps.insert(1, {"step": 1, "eval/reward": 0.5})  # an eval-only record is no RL step
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    if cached_sft is None:
        (path / "sft_metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "sft/loss": 1.0, "train/step_time_s": 30.0}) + "\n" for i in (1, 2)))
        (path / "run.log").write_text("06:00:00 sft: done in 61 s, loss 1.000 -> 0.900; model in /cache/sft/abc\n")
    else:
        (path / "sft_metrics.jsonl").write_text("")  # what the main job leaves when it reuses the cached warm start
        (path / "run.log").write_text(f"06:00:00 sft: cached warm start {cached_sft} (inputs unchanged)\n")
    return path


def test_a_row_holds_the_paired_gain_and_the_time_per_phase(tmp_path):
    seeds = _module()
    sft, rl = [0, 0, 0, 0, 1, 1, 0, 0] * 4, [1, 1, 1, 0, 1, 1, 0, 0] * 4  # 12 of 32 prompts fixed, none broken
    row = seeds.seed_row(_run_dir(tmp_path / "s1", sft, rl), 1, ["total_steps=2"], 600.0, 0, HOST)
    assert row.status == "ok" and (row.before_sft, row.after_sft) == (0.0, 0.25)
    assert row.after_rl == sum(rl) / 32 and row.rl_stage == "after RL (step 2)" and row.prompts == 32
    assert (row.gain, row.gain_low, row.gain_high) == paired_bootstrap(rl, sft)
    assert row.resolved and (row.fixed, row.broken) == (12, 0)
    assert (row.eval_before_s, row.eval_after_sft_s, row.eval_final_s) == (50.0, 40.0, 45.0)
    assert (row.sft_cached, row.sft_s, row.sft_trained_s) == (False, 61.0, 60.0)  # the phase as logged, its steps
    assert [(s.step, s.generate_s, s.update_s, s.sync_s) for s in row.rl_steps] == [(1, 21.0, 65.0, 3.0),
                                                                                      (2, 22.0, 65.0, 3.0)]
    assert row.other_s == 600.0 - (50 + 61 + 40 + 91 + 92 + 45)  # start-up, first sync, save: outside the phases
    assert "| 50 | 61 | 40 | 21 / 65, 22 / 65 | 45 | 221 | 10.0 |" in seeds.table([row])


def test_a_reused_warm_start_is_marked_cached_with_the_time_it_took_when_trained(tmp_path):
    seeds = _module()
    folder = tmp_path / "cache" / "sft" / "0123abcd"
    folder.mkdir(parents=True)
    (folder / "sft_metrics.json").write_text(json.dumps([{"train/step_time_s": 130.0}, {"train/step_time_s": 125.0}]))
    row = seeds.seed_row(_run_dir(tmp_path / "s2", [0, 1], [1, 1], cached_sft=folder), 2, [], 300.0, 0, HOST)
    assert (row.sft_cached, row.sft_s, row.sft_trained_s) == (True, 0.0, 255.0)
    assert "0 (cached; trained in 255)" in seeds.table([row])


def test_summary_counts_resolved_seeds_and_the_median_gain_and_keeps_failures_apart(tmp_path):
    seeds = _module()
    up = [0] * 24 + [1] * 8, [0] * 32  # +0.25, resolved
    flat = [1, 0] * 16, [0, 1] * 16  # 0 net: 16 fixed, 16 broken
    rows = [seeds.seed_row(_run_dir(tmp_path / f"s{i}", before, after), i, [], 60.0, 0, HOST)
            for i, (after, before) in enumerate([up, up, flat], 1)]
    crashed = tmp_path / "s4"
    crashed.mkdir()
    save_evals(crashed, [eval_result("before SFT", [0.0] * 4)])
    rows.append(seeds.seed_row(crashed, 4, [], 30.0, 1, HOST))
    assert rows[3].status == "failed (exit 1)" and rows[3].gain is None and rows[3].sft_cached is None
    assert [r.resolved for r in rows] == [True, True, False, False]
    assert seeds.summary(rows) == ("RL - SFT resolved (paired 95% low end > 0) in 2 of 3 seeds; median gain +0.250 "
                                   "EM; 1 seed(s) failed")
    assert "| 4 | failed (exit 1) | 0.000 | - | - | - | 0 / 0 | 0 | - | - | - | - | 30 | 0.5 |" in seeds.table(rows)


def test_a_seed_killed_mid_write_still_gets_its_row(tmp_path):
    seeds = _module()
    run = _run_dir(tmp_path / "s1", [0, 1], [1, 1])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "timing/generate_s": 2')  # the job was killed while logging step 3
    row = seeds.seed_row(run, 1, [], 60.0, -9, HOST)
    assert row.status == "failed (exit -9)" and [s.step for s in row.rl_steps] == [1, 2] and row.gain == 0.5


def test_an_exit_0_without_both_stages_is_a_failed_row(tmp_path):
    seeds = _module()
    run = tmp_path / "s1"
    run.mkdir()
    save_evals(run, [eval_result("before SFT", [0.0] * 4), eval_result("after SFT", [1.0] * 4)])
    row = seeds.seed_row(run, 1, [], 10.0, 0, HOST)
    assert row.status.startswith("failed: evals.json has stages ['before SFT', 'after SFT']")


def test_the_table_is_written_per_seed_and_a_rerun_skips_the_seeds_already_done(tmp_path, monkeypatch):
    seeds = _module()
    calls = []

    def fake_run(seed, overrides, run_dir, keep_ckpts):  # seed 2 crashes; the others learn
        calls.append((seed, tuple(overrides)))
        shutil.rmtree(run_dir, ignore_errors=True)  # as the real one: each run starts in a fresh dir
        if seed == 2:
            run_dir.mkdir(parents=True)
            return 1, 5.0, [1.0]
        _run_dir(run_dir, [0] * 32, [0] * 24 + [1] * 8)
        return 0, 60.0, [1.0, 3.0]

    monkeypatch.setattr(seeds, "run_seed", fake_run)
    monkeypatch.setattr(seeds, "host", lambda: HOST)
    monkeypatch.setattr(seeds, "job_steps", lambda overrides: 2)
    out, runs = tmp_path / "table", tmp_path / "runs"
    common = ["--out", str(out), "--runs", str(runs)]
    assert seeds.main(["--seeds", "3", *common, "--", "total_steps=2"]) == 1  # stops at the failed seed 2
    assert calls == [(1, ("total_steps=2",)), (2, ("total_steps=2",))]
    saved = json.loads((out / "main_job_seeds.json").read_text())
    assert [(r["seed"], r["status"]) for r in saved["rows"]] == [(1, "ok"), (2, "failed (exit 1)")]
    calls.clear()
    assert seeds.main(["--seeds", "3", "--keep-going", *common, "--", "total_steps=2"]) == 1  # 1 is done: skipped
    assert calls == [(2, ("total_steps=2",)), (3, ("total_steps=2",))]
    calls.clear()
    assert seeds.main(["--seeds", "1", *common]) == 0  # other overrides: another arm, its own seed 1
    assert calls == [(1, ())]
    rows = seeds.load_rows(out / "main_job_seeds.json")
    assert sorted((r.seed, tuple(r.overrides), r.status) for r in rows) == [
        (1, (), "ok"), (1, ("total_steps=2",), "ok"), (2, ("total_steps=2",), "failed (exit 1)"),
        (3, ("total_steps=2",), "ok")]
    text = (out / "main_job_seeds.md").read_text()
    assert "## `total_steps=2`, no native bf16 (float32), 2 RL steps" in text
    assert "## `(no overrides)`, no native bf16 (float32), 2 RL steps" in text
    assert "resolved (paired 95% low end > 0) in 2 of 2 seeds; median gain +0.250 EM; 1 seed(s) failed" in text
    assert f"{HOST}, load mean 2.0, max 3.0 (2 samples)" in text  # the load beside the runs, not at one instant
    calls.clear()
    assert seeds.main(["--seeds", "1", "--rerun", *common]) == 0
    assert calls == [(1, ())] and len(seeds.load_rows(out / "main_job_seeds.json")) == 4  # replaced, not added


def test_a_host_of_the_other_kind_runs_the_seeds_again_as_its_own_arm(tmp_path, monkeypatch):
    """The same overrides on a CPU with native bf16 (bfloat16 engines) and on one without (float32) are two arms:
    a seed done on one kind is run again on the other, its row is added beside the first, never in its place, and
    each kind gets its own section and summary."""
    seeds = _module()
    calls = []

    def fake_run(seed, overrides, run_dir, keep_ckpts):
        calls.append(seed)
        shutil.rmtree(run_dir, ignore_errors=True)
        _run_dir(run_dir, [0] * 32, [0] * 24 + [1] * 8 if seed == 1 else [0] * 32)
        return 0, 60.0, [1.0]

    monkeypatch.setattr(seeds, "run_seed", fake_run)
    monkeypatch.setattr(seeds, "job_steps", lambda overrides: 2)
    common = ["--out", str(tmp_path / "table"), "--runs", str(tmp_path / "runs"), "--seeds", "2"]
    monkeypatch.setattr(seeds, "host", lambda: HOST)
    assert seeds.main(common) == 0 and calls == [1, 2]
    bf16 = "Test CPU, 2 cores, native bf16"
    monkeypatch.setattr(seeds, "host", lambda: bf16)
    calls.clear()
    assert seeds.main(common) == 0 and calls == [1, 2]  # not skipped: done on the other kind only
    calls.clear()
    assert seeds.main(common) == 0 and calls == []  # done on this kind now
    rows = seeds.load_rows(tmp_path / "table" / "main_job_seeds.json")
    assert sorted((r.seed, seeds.precision(r.host)) for r in rows) == [
        (1, "native bf16"), (1, "no native bf16 (float32)"), (2, "native bf16"), (2, "no native bf16 (float32)")]
    text = (tmp_path / "table" / "main_job_seeds.md").read_text()
    assert "## `(no overrides)`, no native bf16 (float32), 2 RL steps" in text
    assert "## `(no overrides)`, native bf16, 2 RL steps" in text
    assert text.count("resolved (paired 95% low end > 0) in 1 of 2 seeds") == 2


def test_rows_of_another_step_count_are_another_arm(tmp_path, monkeypatch):
    """The recipe's RL steps can follow the host kind (host_without_bf16): where the job now runs 5 steps, seeds
    done with 6 are run again as their own arm, and rows written before the count was recorded take it from the
    final eval's stage."""
    seeds = _module()
    calls = []

    def fake_run(seed, overrides, run_dir, keep_ckpts):
        calls.append(seed)
        shutil.rmtree(run_dir, ignore_errors=True)
        _run_dir(run_dir, [0] * 32, [0] * 24 + [1] * 8)
        return 0, 60.0, [1.0]

    monkeypatch.setattr(seeds, "run_seed", fake_run)
    monkeypatch.setattr(seeds, "host", lambda: HOST)
    common = ["--out", str(tmp_path / "table"), "--runs", str(tmp_path / "runs"), "--seeds", "1"]
    monkeypatch.setattr(seeds, "job_steps", lambda overrides: 6)
    assert seeds.main(common) == 0 and calls == [1]
    saved = tmp_path / "table" / "main_job_seeds.json"
    payload = json.loads(saved.read_text())
    del payload["rows"][0]["total_steps"]  # an older row: its final eval is "after RL (step 2)"
    saved.write_text(json.dumps(payload))
    assert seeds.load_rows(saved)[0].steps == 2
    monkeypatch.setattr(seeds, "job_steps", lambda overrides: 5)
    calls.clear()
    assert seeds.main(common) == 0 and calls == [1]  # not skipped: that row is another step count
    calls.clear()
    assert seeds.main(common) == 0 and calls == []
    assert sorted(r.steps for r in seeds.load_rows(saved)) == [2, 5]


def test_the_benchmark_plans_the_steps_the_job_will_run(monkeypatch):
    """job_steps resolves the main job's config as the job does: 5 RL steps where the host has no native bf16, 6
    where it has, and what the overrides say either way."""
    import skyrl_stepwise.host.hardware as hardware

    seeds = _module()
    monkeypatch.setattr("skyrl_stepwise.run.config._has_cuda", lambda: False)
    for native, steps in ((True, 6), (False, 5)):
        monkeypatch.setattr(hardware, "cpu_bf16_is_native", lambda native=native: native)
        assert seeds.job_steps([]) == steps and seeds.job_steps(["total_steps=3"]) == 3


def test_each_seed_has_its_own_cached_warm_start_and_a_rerun_finds_it():
    """trainer.seed (= seed) is in the SFT cache key and the run dir is not: a rerun of a seed, in a fresh run dir,
    reuses the warm start that seed trained; another seed trains its own."""
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.loop.warm_start import cache_key

    seeds = _module()

    def key(seed: int, run_dir: str) -> str:
        cfg = load_config([*seeds.main_job_overrides(seed, ["sft.max_rows=4"]), f"logging.output_dir={run_dir}"])
        assert (cfg.seed, cfg.trainer.seed, cfg.data.seed, cfg.sft.max_rows) == (seed, seed, seed, 4)
        return cache_key(cfg, "same demonstrations")

    assert key(1, "/runs/a/seed_1") == key(1, "/runs/b/seed_1") != key(2, "/runs/a/seed_2")


def test_the_load_is_sampled_through_the_run_not_read_once(tmp_path, monkeypatch):
    """A seed's phase times depend on what ran beside it for its whole hour: the load is read at the start and
    every few seconds while the run lasts, and the host column gives their mean and max."""
    seeds = _module()
    readings = itertools.chain([0.5, 4.0, 6.0], itertools.repeat(2.0))
    monkeypatch.setattr(seeds.os, "getloadavg", lambda: (next(readings), 0.0, 0.0))
    with open(tmp_path / "console.log", "w") as console:
        rc, loads = seeds.run_sampling_load([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(3)"],
                                            console, every_s=0.1)
    assert rc == 3 and loads[:3] == [0.5, 4.0, 6.0] and len(loads) >= 3
    assert seeds.load_line([0.5, 4.0, 6.0, 1.5]) == "load mean 3.0, max 6.0 (4 samples)"
    assert seeds.load_line([]) == "load not measured"
