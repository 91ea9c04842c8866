"""Context policies after a few RL steps from one warm start: a `long_context_tiny` training run per policy.

`benchmarks/context_policies.py` compares the policies' rollouts at fixed weights; this one trains. Each arm is the
main job (`skyrl-stepwise train experiment=long_context_tiny`) with `generator.context.policy=<arm>`: SFT warm start
(cached: `generator.context` is not part of the SFT cache key, so the first arm trains it and every arm starts from
the same weights) -> eval "after SFT" -> `--steps` RL steps -> eval "after RL", on the same fixed eval prompts.
The base-model eval is skipped (it is the same for every arm and scores 0 without the warm start).

Per arm, from the run's evals.json and metrics.jsonl:
- EM after SFT and after RL (95% intervals), and RL - SFT paired over the same prompts (bootstrap) with the
  prompts fixed / broken: the policy's effect on what RL learns, net of its effect at the warm start;
- per RL step (means): trajectories cut by the context (`context_exhausted`), edits, summaries, tokens forwarded
  by the update, rollout and update seconds;
- wall time of the arm.

Runs go to `--out/<policy>/` (each a normal run directory: report.md, curves.png, rollouts.jsonl); the table is
printed and written to `--out/table.md`. An arm that fails is reported as failed with its log, the others go on.

    PYTHONPATH=. .venv/bin/python benchmarks/context_policies_rl.py --out /tmp/context_rl   # README (~55 min here)
    PYTHONPATH=. .venv/bin/python benchmarks/context_policies_rl.py --policies none summarize --steps 2 \\
        --eval-prompts 16 --out /tmp/context_rl_smoke                                                     # smoke
    PYTHONPATH=. .venv/bin/python benchmarks/context_policies_rl.py --out /tmp/context_rl --tabulate   # table again
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from skyrl_stepwise.loop.evaluation import paired_bootstrap, transitions

POLICIES = ("none", "truncate", "sliding_window", "summarize")
PER_STEP = {  # column -> metrics.jsonl key, averaged over the RL steps
    "cut by context / step": "context/exhausted_trajectories",
    "edits / step": "context/edits",
    "tokens dropped / step": "context/tokens_dropped",
    "summaries / step": "context/summaries",
    "turns / traj": "generate/turns_per_trajectory_mean",
    "train reward": "reward/mean",
    "forward tokens / step": "train/forward_tokens",
    "rollout s / step": "timing/generate_s",
    "update s / step": "timing/train_s",
}

UPDATE_KEYS = {"train/forward_tokens", "timing/train_s"}  # averaged over the steps that updated


def run_arm(policy: str, args: argparse.Namespace) -> tuple[Path, float, int]:
    """One training run for `policy`; returns its directory, wall seconds and exit code (its output in train.out)."""
    run_dir = (args.out / policy).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "skyrl_stepwise.cli", "train", "experiment=long_context_tiny",
           f"generator.context.policy={policy}", f"total_steps={args.steps}",
           f"data.max_eval_prompts={args.eval_prompts}", "data.max_base_eval_prompts=0",
           f"logging.run_name=long_context_{policy}", f"hydra.run.dir={run_dir}",
           "trainer.ckpt_interval=0", *args.override]  # no 1.7 GB checkpoint per arm
    print(f"[{policy}] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(run_dir / "train.out", "w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    print(f"[{policy}] exit {code} after {seconds:.0f} s -> {run_dir}", file=sys.stderr, flush=True)
    (run_dir / "arm.json").write_text(json.dumps({"seconds": seconds, "exit": code}))
    return run_dir, seconds, code


def finished_arm(policy: str, args: argparse.Namespace) -> tuple[Path, float, int]:
    """An arm trained earlier (`--tabulate`): its directory, wall seconds and exit code from its arm.json."""
    run_dir = (args.out / policy).resolve()
    arm = json.loads((run_dir / "arm.json").read_text()) if (run_dir / "arm.json").exists() else {}
    return run_dir, arm.get("seconds", float("nan")), arm.get("exit", -1)


def arm_row(policy: str, run_dir: Path, seconds: float, code: int) -> dict:
    """The arm's table row from its run directory (what is missing is left blank, the exit code says why)."""
    row: dict = {"policy": policy, "exit": code, "wall s": round(seconds) if seconds == seconds else ""}
    evals_path = run_dir / "evals.json"
    evals = {e["stage"]: e for e in json.loads(evals_path.read_text())} if evals_path.exists() else {}
    sft = evals.get("after SFT")
    rl = next((e for stage, e in reversed(list(evals.items())) if stage.startswith("after RL")), None)
    for name, result in (("EM after SFT", sft), ("EM after RL", rl)):
        if result is not None:
            row[name] = f"{result['mean']:.3f} [{result['ci_low']:.3f}, {result['ci_high']:.3f}]"
    if sft is not None and rl is not None and len(sft["scores"]) == len(rl["scores"]) and sft["scores"]:
        diff, low, high = paired_bootstrap(rl["scores"], sft["scores"])
        fixed, broken = transitions(rl["scores"], sft["scores"])
        row["RL - SFT (paired)"] = f"{diff:+.3f} [{low:+.3f}, {high:+.3f}]"
        row["fixed / broken"] = f"{fixed} / {broken}"
    metrics_path = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()] \
        if metrics_path.exists() else []
    steps = [s for s in steps if "reward/mean" in s]  # RL steps
    updates = [s for s in steps if "timing/train_s" in s and not s.get("train/skipped_step")]
    row["RL steps (updates)"] = f"{len(steps)} ({len(updates)})"  # a batch without signal trains nothing
    for column, key in PER_STEP.items():
        source = updates if key in UPDATE_KEYS else steps
        values = [s[key] for s in source if isinstance(s.get(key), (int, float))]
        if values:
            row[column] = f"{statistics.fmean(values):.1f}" if column != "train reward" \
                else f"{statistics.fmean(values):.3f}"
    return row


def markdown(rows: list[dict]) -> str:
    """The rows as one markdown table, columns in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Train one arm per policy, then print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--steps", type=int, default=4, help="RL steps per arm (total_steps)")
    parser.add_argument("--eval-prompts", type=int, default=64, help="data.max_eval_prompts (same prompts per arm)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/context_policies_rl"))
    parser.add_argument("--override", nargs="*", default=[], help="more Hydra overrides for every arm")
    parser.add_argument("--tabulate", action="store_true", help="train nothing: the table of the arms in --out")
    args = parser.parse_args(argv)
    rows = []
    for policy in args.policies:
        rows.append(arm_row(policy, *(finished_arm if args.tabulate else run_arm)(policy, args)))
        table = markdown(rows)
        (args.out / "table.md").write_text(table + "\n")  # after every arm: a stopped sweep keeps what it measured
    header = (f"long_context_tiny, {args.steps} RL steps per arm from the same SFT warm start, "
              f"{args.eval_prompts} fixed eval prompts; overrides: {args.override or 'none'}")
    print(header + "\n\n" + table)
    (args.out / "table.md").write_text(header + "\n\n" + table + "\n")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
