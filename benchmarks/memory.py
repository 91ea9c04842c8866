"""Peak memory of the main job, per process: who holds what while `experiment=search_r1_tiny` runs.

Starts the run as a subprocess and samples every process on the machine that belongs to it (its descendants
and the Ray processes it starts: the vLLM actor and engine core, the policy ranks, the retrieval server, Ray's
own daemons) once a second, reading PSS (proportional set size: shared pages split between their users, so
the column sums to what the run really occupies). Prints each process's peak, and the peak of the sum at any
one moment, which is the number to compare with a laptop's RAM.

    python benchmarks/memory.py [hydra overrides...]        # e.g. total_steps=1 sft.enabled=false

A run of the tiny recipe with a cached SFT model takes about 6 minutes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

# how a process is named in the table: the first pattern its command line matches
ROLES = [(r"VLLM::EngineCore|EngineCore", "vLLM engine core"), (r"ray::VLLMWorker", "vLLM actor (AsyncLLM)"),
         (r"ray::_PolicyRank", "policy rank"), (r"retrieval", "retrieval server"),
         (r"skyrl_stepwise\.train", "driver (train.py)"), (r"raylet|gcs_server|dashboard|log_monitor|ray::IDLE|"
                                                          r"runtime_env|default_worker|monitor\.py", "Ray")]


def role(cmdline: str) -> str:
    for pattern, name in ROLES:
        if re.search(pattern, cmdline):
            return name
    return "other"


def pss_bytes(proc: psutil.Process) -> int:
    """PSS from /proc/<pid>/smaps_rollup (Linux); RSS where that is unavailable."""
    try:
        for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def run_processes(root: psutil.Process, baseline: set[int]) -> list[psutil.Process]:
    """The run's processes: its descendants, plus processes started since (Ray daemons reparent to init)."""
    procs = {}
    try:
        for p in [root, *root.children(recursive=True)]:
            procs[p.pid] = p
    except psutil.Error:
        pass
    for p in psutil.process_iter(["cmdline"]):
        if p.pid not in baseline and p.pid not in procs and "ray" in " ".join(p.info["cmdline"] or []):
            procs[p.pid] = p
    return list(procs.values())


def main() -> None:
    overrides = sys.argv[1:]
    out = Path(tempfile.mkdtemp(prefix="memory_"))
    command = [sys.executable, "-m", "skyrl_stepwise.cli.train", "experiment=search_r1_tiny", "logging.wandb_mode=disabled",
               f"logging.output_dir={out / 'run'}", *overrides]
    baseline = {p.pid for p in psutil.process_iter()}
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=open(out / "console.log", "w"), stderr=subprocess.STDOUT)
    root = psutil.Process(child.pid)
    peak: dict[tuple[str, int], int] = defaultdict(int)  # (role, pid) -> peak PSS
    peak_total, peak_total_at, peak_by_role_at_total = 0, 0.0, {}
    while child.poll() is None:
        now: dict[str, int] = defaultdict(int)
        for proc in run_processes(root, baseline):
            try:
                name = role(" ".join(proc.cmdline()))
            except psutil.Error:
                continue
            pss = pss_bytes(proc)
            peak[(name, proc.pid)] = max(peak[(name, proc.pid)], pss)
            now[name] += pss
        total = sum(now.values())
        if total > peak_total:
            peak_total, peak_total_at, peak_by_role_at_total = total, time.perf_counter() - start, dict(now)
        time.sleep(1.0)  # reading smaps walks page tables: sampling faster slows the run it measures
    shutil.rmtree(out / "run" / "ckpts", ignore_errors=True)  # GBs of resumable state nobody will resume
    gib = 1 << 30
    print(f"run: {' '.join(command[2:])}  (exit {child.returncode}, {time.perf_counter() - start:.0f} s; "
          f"console in {out / 'console.log'})")
    print(f"\n{'process':28s} {'pid':>8s} {'peak PSS GiB':>13s}")
    for (name, pid), value in sorted(peak.items(), key=lambda kv: -kv[1]):
        if value > 50 << 20:  # skip the small fry (<50 MiB) in the per-process list
            print(f"{name:28s} {pid:8d} {value / gib:13.2f}")
    print(f"\nat the peak of the sum ({peak_total_at:.0f} s in):")
    for name, value in sorted(peak_by_role_at_total.items(), key=lambda kv: -kv[1]):
        print(f"  {name:26s} {value / gib:6.2f} GiB")
    print(f"  {'total':26s} {peak_total / gib:6.2f} GiB  (target for the tiny main job: <= 8 GiB)")


if __name__ == "__main__":
    main()
