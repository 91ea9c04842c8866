"""Does the main job's RL beat its warm start in (nearly) every run? The main job, N seeds, one table (issue 55).

One run of `make run` says +0.062 [+0.000, +0.125] "no difference resolved" where earlier runs said +0.102 or +0.125,
resolved: one seed cannot tell a setting that learns from one that got lucky. This runs the main job
(`python -m skyrl_stepwise.cli.train experiment=search_r1_tiny`, what `make run` runs) once per seed, with
`seed` and `data.seed` both set to it, and reads each run dir back with the project's own loaders (evals.json,
metrics.jsonl, sft_metrics.jsonl): per seed the EM after SFT and after RL, the paired RL - SFT interval, and the wall
time per phase (the eval before SFT, SFT, each RL step's generate and update, the final eval), so a sweep of settings
(issue 55, item 2) and the time budget (item 3) are measured on the same table.

    python benchmarks/main_job_seeds.py [--seeds 5] [--first-seed 1] [--out DIR] [--keep-going] [--rerun]
        [-- hydra overrides, e.g. trainer.optim.lr=2e-6 model_path=smollm2-tiny]

The SFT warm start is cached under $SKYRL_STEPWISE_CACHE/sft/<key> and `trainer.seed` (= `seed`) is part of the key
(loop/warm_start.py): each seed trains its own warm start once, and a rerun with the same overrides reuses it (the
table says "cached"). The eval prompts are data.seed's sample of the validation set, the same at every stage of a
seed, so each seed's paired interval compares like with like. The table (markdown + json) is rewritten after every
seed, so a failed or killed seed never loses the others' rows, and a rerun skips seeds whose row is already there
with the same overrides (--rerun redoes them). The real 5-seed sweep takes ~43 min per seed on a 2-core AVX2 CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from skyrl_stepwise.loop.evaluation import load_evals, paired_bootstrap, transitions

RESULTS = "main_job_seeds"  # <out>/main_job_seeds.{json,md}
CONSOLE = "console.log"  # the main job's stdout and stderr, in its run dir
UPDATE_PHASES = ("timing/train_s", "timing/old_logprobs_s", "timing/ref_logprobs_s")  # what an RL step's update is
SFT_LINE = re.compile(r"sft: (?:cached warm start (\S+)|done in (\d+) s.*model in (\S+))")  # warm_start.sft_model


@dataclasses.dataclass
class RLStep:
    """One RL step's wall time, from its metrics.jsonl record."""

    step: int
    generate_s: float
    update_s: float  # the policy update: old/ref logprobs and the optimizer steps
    sync_s: float  # the weight sync to the engines
    step_s: float


@dataclasses.dataclass
class SeedRow:
    """One seed's main job: its evals, the paired RL - SFT gain, and where its minutes went."""

    seed: int
    overrides: list[str]
    status: str  # "ok", or "failed (exit N)" / "failed: <why>"
    run_dir: str
    wall_s: float
    host: str
    before_sft: float | None = None
    after_sft: float | None = None
    after_rl: float | None = None
    rl_stage: str = ""
    prompts: int = 0
    gain: float | None = None
    gain_low: float | None = None
    gain_high: float | None = None
    fixed: int = 0
    broken: int = 0
    eval_before_s: float | None = None
    eval_after_sft_s: float | None = None
    eval_final_s: float | None = None
    sft_s: float | None = None  # the SFT phase of this run, start-up and probe included (0: the cached one reused)
    sft_cached: bool | None = None
    sft_trained_s: float | None = None  # what the warm start's own steps took when it was trained
    rl_steps: list[RLStep] = dataclasses.field(default_factory=list)
    # the RL steps the job was configured for on its host (a recipe's host_without_bf16 may change them there);
    # None in rows written before it was recorded: read from the final eval's stage then
    total_steps: int | None = None

    @property
    def steps(self) -> int:
        """The RL steps of this row's arm."""
        if self.total_steps is not None:
            return self.total_steps
        match = re.search(r"step (\d+)", self.rl_stage)
        return int(match.group(1)) if match else len(self.rl_steps)

    @property
    def other_s(self) -> float:
        """The wall time outside the phases above: start-up (retriever, engines, workers), the first weight sync,
        the final checkpoint and the report."""
        phases = [self.eval_before_s, self.sft_s, self.eval_after_sft_s, self.eval_final_s,
                  *(s.step_s for s in self.rl_steps)]
        return self.wall_s - sum(p for p in phases if p is not None)

    @property
    def resolved(self) -> bool:
        """A gain RL can claim: the paired interval's low end above 0."""
        return self.gain_low is not None and self.gain_low > 0


def _records(path: Path) -> list[dict]:
    """A .jsonl file's records ([] when absent); a torn last line (the job was killed mid-write) is left out, so a
    killed seed still gets its row."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    try:
        return records + [json.loads(lines[-1])] if lines else records
    except json.JSONDecodeError:
        return records


def rl_steps(run_dir: Path) -> list[RLStep]:
    """Each RL step's generate, update and sync seconds from metrics.jsonl (eval-only records left out)."""
    steps = []
    for r in _records(run_dir / "metrics.jsonl"):
        if "timing/step_s" not in r:
            continue
        steps.append(RLStep(int(r.get("step", len(steps) + 1)), r.get("timing/generate_s", 0.0),
                            sum(r.get(k, 0.0) for k in UPDATE_PHASES), r.get("timing/weight_sync_s", 0.0),
                            r["timing/step_s"]))
    return steps


def sft_line(run_dir: Path) -> tuple[Path | None, float | None]:
    """The warm-start folder the run used and, when it trained it, the SFT phase's seconds, as its log says them
    (the run dir records the SFT steps' own times only, not the policy's start-up and the terminator probe)."""
    for name in ("run.log", CONSOLE):
        path = run_dir / name
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                m = SFT_LINE.search(line)
                if m:
                    return (Path(m.group(1)), None) if m.group(1) else (Path(m.group(3)), float(m.group(2)))
    return None, None


def fill_sft(row: SeedRow, run_dir: Path) -> None:
    """SFT seconds this run spent (the phase as logged; else its steps, sft_metrics.jsonl, written only when it
    trains) and what the warm start's steps took when it was trained (its folder's sft_metrics.json); all None when
    the run never reached SFT."""
    trained_now = _records(run_dir / "sft_metrics.jsonl")
    folder, phase_s = sft_line(run_dir)
    if not trained_now and folder is None:
        return
    row.sft_cached = not trained_now
    row.sft_s = 0.0 if row.sft_cached else phase_s if phase_s is not None else \
        sum(r.get("train/step_time_s", 0.0) for r in trained_now)
    history = json.loads((folder / "sft_metrics.json").read_text()) \
        if folder is not None and (folder / "sft_metrics.json").is_file() else trained_now
    row.sft_trained_s = sum(r.get("train/step_time_s", 0.0) for r in history) if history else None


def seed_row(run_dir: Path, seed: int, overrides: list[str], wall_s: float, returncode: int, host: str) -> SeedRow:
    """One seed's row, read back from its run dir (evals.json, metrics.jsonl, sft_metrics.jsonl)."""
    status = "ok" if returncode == 0 else f"failed (exit {returncode})"
    row = SeedRow(seed, list(overrides), status, str(run_dir), wall_s, host)
    stages = {e.stage: e for e in load_evals(run_dir)}
    before, sft = stages.get("before SFT"), stages.get("after SFT")
    rl = next((e for name, e in reversed(stages.items()) if name.startswith("after RL")), None)
    row.before_sft, row.eval_before_s = (before.mean, before.seconds) if before else (None, None)
    row.after_sft, row.eval_after_sft_s = (sft.mean, sft.seconds) if sft else (None, None)
    if rl is not None:
        row.after_rl, row.eval_final_s, row.rl_stage, row.prompts = rl.mean, rl.seconds, rl.stage, rl.num_prompts
    if sft is not None and rl is not None and sft.num_prompts == rl.num_prompts > 0:
        row.gain, row.gain_low, row.gain_high = paired_bootstrap(rl.scores, sft.scores)
        row.fixed, row.broken = transitions(rl.scores, sft.scores)
    elif row.status == "ok":  # the job exited 0 without the two stages the table compares
        row.status = f"failed: evals.json has stages {list(stages)}, needs 'after SFT' and 'after RL'"
    fill_sft(row, run_dir)
    row.rl_steps = rl_steps(run_dir)
    return row


def summary(rows: list[SeedRow]) -> str:
    """How many seeds resolved a gain, and the median gain (failed seeds counted apart, never as 0)."""
    done = [r for r in rows if r.gain is not None]
    failed = len(rows) - len(done)
    if not done:
        return f"no seed finished ({failed} failed)"
    line = (f"RL - SFT resolved (paired 95% low end > 0) in {sum(r.resolved for r in done)} of {len(done)} seeds; "
            f"median gain {statistics.median(r.gain for r in done):+.3f} EM")
    return line + (f"; {failed} seed(s) failed" if failed else "")


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[SeedRow]) -> str:
    """One arm's markdown (rows of the same overrides): one row per seed, then the summary line and the host(s)."""
    lines = ["| seed | status | EM before SFT | EM after SFT | EM after RL | RL - SFT [95% paired] | fixed / broken | "
             "eval before SFT s | SFT s | eval after SFT s | RL generate / update s per step | final eval s | "
             "other s | total min |", "|---:|---|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r.seed):
        gain = "-" if r.gain is None else f"{r.gain:+.3f} [{r.gain_low:+.3f}, {r.gain_high:+.3f}]" + \
            (" resolved" if r.resolved else "")
        sft = "-" if r.sft_s is None else (f"0 (cached; trained in {_f(r.sft_trained_s, '.0f')})" if r.sft_cached
                                           else f"{r.sft_s:.0f}")
        steps = ", ".join(f"{s.generate_s:.0f} / {s.update_s:.0f}" for s in r.rl_steps) or "-"
        lines.append(f"| {r.seed} | {r.status} | {_f(r.before_sft)} | {_f(r.after_sft)} | {_f(r.after_rl)} | {gain} | "
                     f"{r.fixed} / {r.broken} | {_f(r.eval_before_s, '.0f')} | {sft} | {_f(r.eval_after_sft_s, '.0f')} | "
                     f"{steps} | {_f(r.eval_final_s, '.0f')} | {r.other_s:.0f} | {r.wall_s / 60:.1f} |")
    prompts = sorted({r.prompts for r in rows if r.prompts})
    return "\n".join([f"Overrides: `{' '.join(rows[0].overrides) or '(none)'}`; seed = data.seed per row; "
                      f"{'/'.join(map(str, prompts)) or '?'} eval prompts.", "", *lines, "", summary(rows), "",
                      "Host: " + "; ".join(sorted({r.host for r in rows}))])


def precision(host: str) -> str:
    """The host kind a row ran on, from its host column: a CPU with native bf16 runs the engines and the trainer in
    bfloat16, one without falls back to float32. The same overrides are a different arm on each (other numerics,
    other minutes), so rows of the two kinds never share a section, a summary or a skipped seed."""
    return "no native bf16 (float32)" if "no native bf16" in host else "native bf16"


def arm_name(overrides: list[str], host: str, steps: int) -> str:
    """One sweep arm: its overrides, the host kind it ran on and the RL steps the job ran there (the recipe's count
    can follow the host kind: rows of 6 steps are no answer for a host that now runs 5)."""
    return f"`{' '.join(sorted(overrides)) or '(no overrides)'}`, {precision(host)}, {steps} RL steps"


def arms(rows: list[SeedRow]) -> dict[str, list[SeedRow]]:
    """The rows by arm (overrides and host kind), in the order the arms were first run."""
    groups: dict[str, list[SeedRow]] = {}
    for r in rows:
        groups.setdefault(arm_name(r.overrides, r.host, r.steps), []).append(r)
    return groups


def report(rows: list[SeedRow]) -> str:
    """The whole results file as markdown: one section per arm."""
    sections = [f"## {name}\n\n{table(arm)}" for name, arm in arms(rows).items()]
    return "\n\n".join(["# The main job over seeds (benchmarks/main_job_seeds.py)",
                         "`experiment=search_r1_tiny` per seed; RL - SFT paired over the same eval prompts; "
                         "written after every seed.", *sections])


def overrides_key(overrides: list[str]) -> str:
    """A short digest of the overrides: rows of one sweep arm share it, and so do their run dirs."""
    return hashlib.sha256(json.dumps(sorted(overrides)).encode()).hexdigest()[:8]


def load_rows(path: Path) -> list[SeedRow]:
    """The rows written so far ([] for a new results file)."""
    if not path.is_file():
        return []
    rows = []
    for r in json.loads(path.read_text())["rows"]:
        r["rl_steps"] = [RLStep(**s) for s in r["rl_steps"]]
        rows.append(SeedRow(**r))
    return rows


def save(out: Path, rows: list[SeedRow]) -> None:
    """Rewrite <out>/main_job_seeds.json and .md (atomically: a kill mid-write keeps the previous table)."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"summaries": {name: summary(arm) for name, arm in arms(rows).items()},
               "rows": [dataclasses.asdict(r) for r in rows]}
    for name, text in ((f"{RESULTS}.json", json.dumps(payload, indent=1)), (f"{RESULTS}.md", report(rows) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def upsert(rows: list[SeedRow], row: SeedRow) -> list[SeedRow]:
    """The rows with `row` in place of any earlier row of the same seed and arm (overrides and host kind)."""
    key = (row.seed, arm_name(row.overrides, row.host, row.steps))
    return [r for r in rows if (r.seed, arm_name(r.overrides, r.host, r.steps)) != key] + [row]


def done_seeds(rows: list[SeedRow], overrides: list[str], host: str, steps: int) -> set[int]:
    """Seeds with a finished row for these overrides and RL steps on this host kind (a failed row is run again)."""
    arm = arm_name(overrides, host, steps)
    return {r.seed for r in rows if arm_name(r.overrides, r.host, r.steps) == arm and r.status == "ok"}


def job_steps(overrides: list[str]) -> int:
    """The RL steps the main job runs with these overrides on this host, resolved as the job resolves its config."""
    from skyrl_stepwise.run.app_config import load_config

    return load_config(main_job_overrides(0, overrides)).total_steps


def host() -> str:
    """CPU model, cores and native bf16 or not (host/hardware.py's check); the load is measured per run (run_seed)."""
    from skyrl_stepwise.host.hardware import cpu_bf16_is_native

    model = "unknown CPU"
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    bf16 = "native bf16" if cpu_bf16_is_native() else "no native bf16 (float32 fallback)"
    return f"{model}, {os.cpu_count()} cores, {bf16}"


# How often a run's load is sampled: a seed runs 40-80 min, so this is ~100-160 samples of the 1-min load average.
LOAD_EVERY_S = 30.0


def run_sampling_load(cmd: list[str], console, every_s: float = LOAD_EVERY_S) -> tuple[int, list[float]]:
    """Run `cmd` to the end, sampling the 1-min load average at its start and every `every_s` seconds while it
    runs: the load beside a seed is what makes its phase times comparable, and one reading at its start or end
    said nothing about the hour between (a seed that ran beside tests read "load 0.7")."""
    loads = [os.getloadavg()[0]]
    proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT)
    while True:
        try:
            return proc.wait(timeout=every_s), loads
        except subprocess.TimeoutExpired:
            loads.append(os.getloadavg()[0])


def load_line(loads: list[float]) -> str:
    """The load beside a run, for the host column: its mean and max over the samples."""
    if not loads:
        return "load not measured"
    return f"load mean {statistics.fmean(loads):.1f}, max {max(loads):.1f} ({len(loads)} samples)"


def main_job_overrides(seed: int, overrides: list[str]) -> list[str]:
    """What the main job of one seed is given (the run dir apart): the recipe, the seed for training and data, then
    the arm's own overrides (last: they win). None of it but the seed and the overrides is in the SFT cache key."""
    return ["experiment=search_r1_tiny", f"seed={seed}", f"data.seed={seed}", "logging.wandb_mode=disabled",
            *overrides]


def run_seed(seed: int, overrides: list[str], run_dir: Path, keep_ckpts: bool) -> tuple[int, float, list[float]]:
    """The main job for one seed in a fresh run dir; (exit code, wall seconds, the load samples beside it). Its
    console goes to console.log."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "skyrl_stepwise.cli.train", f"hydra.run.dir={run_dir}",
           *main_job_overrides(seed, overrides)]
    print(f"seed {seed}: {' '.join(cmd[2:])} (console: {run_dir / CONSOLE})", flush=True)
    start = time.perf_counter()
    with open(run_dir / CONSOLE, "w") as console:
        rc, loads = run_sampling_load(cmd, console)
    wall = time.perf_counter() - start
    if not keep_ckpts:  # 1.7 GB per seed; the table needs the evals and metrics only
        shutil.rmtree(run_dir / "ckpts", ignore_errors=True)
    return rc, wall, loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s [options] [-- hydra overrides]")
    parser.add_argument("--seeds", type=int, default=5, help="how many seeds (default 5)")
    parser.add_argument("--first-seed", type=int, default=1, help="the first seed; the others follow it")
    parser.add_argument("--out", default=f"benchmarks/results/{RESULTS}", help="where the table is written")
    parser.add_argument("--runs", default=f"outputs/{RESULTS}", help="where the run dirs go (<runs>/<overrides>/seed_N)")
    parser.add_argument("--keep-going", action="store_true", help="after a failed seed, record it and go on")
    parser.add_argument("--rerun", action="store_true", help="rerun seeds already in the table with these overrides")
    parser.add_argument("--keep-ckpts", action="store_true", help="keep each run's final checkpoint (1.7 GB)")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, overrides = parser.parse_args(argv[:split]), argv[split + 1:]
    out, path = Path(args.out), Path(args.out) / f"{RESULTS}.json"
    rows, here, steps = load_rows(path), host(), job_steps(overrides)
    skip = set() if args.rerun else done_seeds(rows, overrides, here, steps)
    failed = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        if seed in skip:
            print(f"seed {seed}: already in {path} with these overrides and {steps} RL steps on a host with "
                  f"{precision(here)} (--rerun to redo it)")
            continue
        run_dir = Path(args.runs) / overrides_key(overrides) / f"seed_{seed}"
        rc, wall, loads = run_seed(seed, overrides, run_dir, args.keep_ckpts)
        row = seed_row(run_dir, seed, overrides, wall, rc, f"{here}, {load_line(loads)}")
        row.total_steps = steps
        rows = upsert(rows, row)
        save(out, rows)
        print(f"seed {seed}: {row.status}, RL - SFT {_f(row.gain, '+.3f')} [{_f(row.gain_low, '+.3f')}, "
              f"{_f(row.gain_high, '+.3f')}], {wall / 60:.1f} min", flush=True)
        if row.status != "ok":
            failed += 1
            if not args.keep_going:
                print(f"stopping: seed {seed} failed (its console: {run_dir / CONSOLE}); --keep-going goes on")
                break
    if rows:  # also when every seed was skipped: the file then renders with this version of the table
        save(out, rows)
    mine = arms(rows).get(arm_name(overrides, here, steps), [])
    if mine:
        print(table(mine))
    print(f"table: {out / (RESULTS + '.md')}, {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
