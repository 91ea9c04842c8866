"""Where `make test`'s minutes go: the slowest tests and the time per file, from pytest's JUnit XML.

Why: CI has a hard 90-minute limit and the suite's budget is 20 minutes (docs/development.md). Each new feature's
tests pay from that budget, so the table has to be one command away, not a rerun with `--durations` by hand.

    python benchmarks/test_times.py                      # runs the whole suite (as `make test`), then the table
    python benchmarks/test_times.py --junit FILE.xml     # only the table, from a run that wrote FILE.xml
    python benchmarks/test_times.py --junit a.xml --junit b.xml   # several runs of one suite (fast + integration)

It writes benchmarks/results/test_times/{slowest.md,per_file.md} and prints the same. `.ci/run` calls it with
`--top 10 --budget-min 20 --alarm-min 25` after the suite: it prints, warns loudly past the alarm, and never fails
on time (hosts are noisy; a red CI lands nothing).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "test_times"


@dataclass(frozen=True)
class CaseTime:
    """One test's wall time as JUnit recorded it (setup, call and teardown together)."""

    file: str
    name: str
    seconds: float
    outcome: str  # passed / failed / error / skipped


def read_junit(path: Path) -> list[CaseTime]:
    """Every testcase of a pytest JUnit XML file. The file of a test comes from its classname
    (`tests.test_x` or `test_x.Class`), the form pytest writes."""
    times = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        module = next((part for part in classname.split(".") if part.startswith("test_")), classname)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        times.append(CaseTime(f"tests/{module}.py", case.get("name", "?"), float(case.get("time", 0.0)), outcome))
    return times


def cpu_kind() -> str:
    """The CPU's model name, its core count and whether it has native bf16: every figure needs its host."""
    model = platform.processor() or "unknown CPU"
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "unknown CPU", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    bf16 = "native bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "no native bf16"
    return f"{model}, {os.cpu_count()} cores, {bf16}"


def tables(times: list[CaseTime], top: int) -> tuple[str, str]:
    """(the `top` slowest tests, the time per file), as markdown."""
    total = sum(t.seconds for t in times)
    slowest = sorted(times, key=lambda t: -t.seconds)[:top]
    rows = [f"| {i} | {t.seconds:.1f} | {t.file}::{t.name} | {t.outcome} |" for i, t in enumerate(slowest, 1)]
    slow_md = "\n".join([f"Slowest {len(slowest)} of {len(times)} tests ({total:.0f} s in all; {cpu_kind()})", "",
                         "| # | s | test | outcome |", "|---|---|---|---|", *rows])
    per_file: dict[str, list[float]] = defaultdict(list)
    for t in times:
        per_file[t.file].append(t.seconds)
    files = sorted(per_file.items(), key=lambda kv: -sum(kv[1]))
    file_rows = [f"| {sum(s):.1f} | {100 * sum(s) / max(total, 1e-9):.1f}% | {len(s)} | {f} |" for f, s in files]
    file_md = "\n".join([f"Time per file ({total:.0f} s in all)", "", "| s | share | tests | file |",
                         "|---|---|---|---|", *file_rows])
    return slow_md, file_md


def budget_line(wall_s: float, budget_min: float, alarm_min: float) -> str:
    """One line on the suite's wall time against its budget; past the alarm it is a loud warning, never a failure."""
    minutes = wall_s / 60
    if minutes > alarm_min:
        bar = "!" * 78
        return (f"{bar}\nWARNING: the test suite took {minutes:.1f} min, past its {alarm_min:.0f}-min alarm (budget "
                f"{budget_min:.0f} min, docs/development.md). The slowest tests are above: move plumbing to the tiny "
                f"model or share a session fixture before adding more.\n{bar}")
    return f"test suite wall time: {minutes:.1f} min (budget {budget_min:.0f} min, alarm {alarm_min:.0f} min)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, action="append", help="JUnit XML of a finished run (repeatable)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--wall-s", type=float, default=None, help="the suite's wall time, for the budget line")
    parser.add_argument("--budget-min", type=float, default=20.0)
    parser.add_argument("--alarm-min", type=float, default=25.0)
    parser.add_argument("--out", default=str(RESULTS), help="where the tables go ('' to write none)")
    args = parser.parse_args(argv)

    junits = args.junit
    if not junits:
        out = Path(args.out or RESULTS)
        out.mkdir(parents=True, exist_ok=True)
        junits = [out / "junit.xml"]
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not own_model",
                        f"--junitxml={junits[0]}", "tests"], cwd=REPO, check=False)
    missing = [str(j) for j in junits if not j.exists()]
    if missing:
        print(f"test_times: no JUnit XML at {', '.join(missing)}: the suite did not get to write it", file=sys.stderr)
        return 0 if args.wall_s is not None else 1
    times = [t for j in junits for t in read_junit(j)]
    slow_md, file_md = tables(times, args.top)
    print(slow_md, "", file_md, sep="\n")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "slowest.md").write_text(slow_md + "\n")
        (out / "per_file.md").write_text(file_md + "\n")
    if args.wall_s is not None:
        print(budget_line(args.wall_s, args.budget_min, args.alarm_min))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
