"""What grading out of the agent's reach costs: honest code episodes graded by this checkout vs by the code before.

Why: issue 58 moved every code env's verdict out of the sandbox that ran the model's code (envs/grading.py): the
hidden cases run in a fresh sandbox holding only the task's sources, and the host compares. Its budget was at most
1.5x the grading time of before. Timings on a shared 2-core box swing by 2x between minutes, so the two arms run
alternately in one command, each in its own process importing its own checkout, and the ratio is of medians.

    python benchmarks/grading_before_after.py                 # before = the commit before envs/grading.py
    python benchmarks/grading_before_after.py --rounds 5 --n 20 --before REV

The "before" checkout is a temporary `git worktree` of REV (removed at the end). Each arm plays `--n` honest
episodes per env through `benchmarks/sandbox.py`'s `grading()` (repo-fix: the demonstration's fix; HumanEval: the
canonical answer) and reports the median grading step and episode in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE_GRADING = "fca0490^"  # the parent of "envs/grading: rewards that cannot be forged"

ARM = """
import json, statistics, sys
checkout, n = sys.argv[1], int(sys.argv[2])
sys.path[:0] = [checkout, {benchmarks!r}, {tests!r}]
import skyrl_stepwise
assert skyrl_stepwise.__file__.startswith(checkout), skyrl_stepwise.__file__
from sandbox import grading
print(json.dumps({{k: 1000 * statistics.median(v) for k, v in grading(n).items()}}))
"""


def run_arm(checkout: Path, n: int) -> dict[str, float]:
    """One arm in its own interpreter: the medians (ms) of its honest episodes, by env and phase."""
    code = ARM.format(benchmarks=str(REPO / "benchmarks"), tests=str(REPO / "tests"))
    out = subprocess.run([sys.executable, "-c", code, str(checkout), str(n)], capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"the arm of {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE_GRADING, help="the git revision graded the old way")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two arms")
    parser.add_argument("--n", type=int, default=20, help="honest episodes per env per arm and round")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from sandbox import cpu_name

    with tempfile.TemporaryDirectory(prefix="grading-before-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(before), args.before],
                       check=True)
        try:
            arms: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for round_ in range(args.rounds):
                for name, checkout in (("before", before), ("after", REPO)):
                    arms[name].append(run_arm(checkout, args.n))
                    print(f"round {round_ + 1} {name}: {arms[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], check=False)
    print(f"\n# grading before ({args.before}) vs after (this checkout): {cpu_name()}; "
          f"{args.rounds} alternating rounds x {args.n} honest episodes per env; medians of the round medians, ms")
    print("\n| phase | before | after | after / before |\n|---|---|---|---|")
    for key in arms["after"][0]:
        b = statistics.median(r[key] for r in arms["before"])
        a = statistics.median(r[key] for r in arms["after"])
        print(f"| {key} | {b:.1f} | {a:.1f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
