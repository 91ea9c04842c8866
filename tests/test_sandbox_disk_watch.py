"""The working-dir size cap's watchdog process (sandbox/disk_watch.py): it stops a dir-filling run without the
trainer's help, while the trainer is busy in other threads, and a lost or hung watchdog is replaced, never trusted."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from sandbox_helpers import require_sandbox
from skyrl_stepwise.sandbox import BwrapSandbox, Limits, SandboxMetrics, StopReason
from skyrl_stepwise.sandbox import disk_watch, runner

require_sandbox()

CAP = 16 << 20
LIMITS = Limits(wall_s=8.0, cpu_s=4, memory_bytes=256 << 20, processes=32, file_size_bytes=4 << 20,
                output_bytes=16 << 10, workdir_bytes=CAP, tmp_bytes=4 << 20)
FILL = "i=0; while true; do i=$((i+1)); head -c 3000000 /dev/zero > f$i; done"


def _used(sandbox: BwrapSandbox) -> int:
    return sum(p.stat().st_size for p in sandbox.workdir.iterdir())


def test_the_watchdog_alone_stops_a_run_filling_its_working_dir(monkeypatch):
    monkeypatch.setattr(runner, "_WATCH_EVERY_S", 1e9)  # this process never looks during the run
    with BwrapSandbox(limits=LIMITS, metrics=SandboxMetrics()) as sb:
        result = sb.run(FILL)
        used = _used(sb)
    assert result.stop_reason is StopReason.DISK_LIMIT, result
    assert result.wall_s < LIMITS.wall_s / 2, result  # killed by the watchdog, not by the wall clock
    assert used < CAP + (32 << 20)


def test_a_trainer_busy_in_other_threads_does_not_soften_the_cap():
    """With six Python threads holding the GIL in turn, the in-process check came up to a second late: 106-231 MiB
    were written against a 16 MiB cap (2-core AVX2 EPYC). The watchdog is a process of its own."""
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            sum(range(1000))

    threads = [threading.Thread(target=burn, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        # the wall clock is only the backstop here: under a loaded CI run (two test workers, these six threads) the
        # run's start used up 8 s before the command wrote a byte (TIMEOUT, cpu_s 0.016); the cap is what is tested
        with BwrapSandbox(limits=dataclasses.replace(LIMITS, wall_s=30.0), metrics=SandboxMetrics()) as sb:
            result = sb.run(FILL)  # one run: before the watchdog process, 5 of 5 failed
            used = _used(sb)
            kernel = sb.kernel_capped
        assert result.stop_reason is StopReason.DISK_LIMIT, result
        assert used < CAP + (64 << 20), f"{used >> 20} MiB written against a {CAP >> 20} MiB cap"
        assert used <= CAP or not kernel, f"{used} bytes past the tmpfs's {CAP}"  # root: the kernel's cap, exact
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_killed_watchdog_is_replaced_by_the_next_run(monkeypatch, caplog):
    monkeypatch.setattr(runner, "_WATCH_EVERY_S", 1e9)
    caplog.set_level("WARNING", logger=disk_watch.__name__)
    with BwrapSandbox(limits=LIMITS, metrics=SandboxMetrics()) as sb:
        assert sb.run("echo one").stdout == "one\n"
        first = disk_watch.DISK_WATCH._proc.pid
        os.kill(first, signal.SIGKILL)
        assert sb.run("echo two").stdout == "two\n"
        second = disk_watch.DISK_WATCH._proc.pid
        assert second != first
        assert f"watchdog (pid {first}) exited with code -9; starting a new one" in caplog.text
        result = sb.run(FILL)
    assert result.stop_reason is StopReason.DISK_LIMIT, result


def test_a_hung_watchdog_is_killed_not_trusted(monkeypatch, caplog):
    monkeypatch.setattr(disk_watch, "ACK_TIMEOUT_S", 0.5)
    caplog.set_level("WARNING", logger=disk_watch.__name__)
    with BwrapSandbox(limits=LIMITS, metrics=SandboxMetrics()) as sb:
        sb.run("true")
        hung = disk_watch.DISK_WATCH._proc
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            result = sb.run("echo still-runs")
        finally:
            if hung.poll() is None:
                os.kill(hung.pid, signal.SIGCONT)
        assert result.stdout == "still-runs\n" and result.ok, result
        assert hung.poll() is not None, "a watchdog that does not answer must be killed (it could kill a reused pid)"
        assert f"watchdog (pid {hung.pid}) did not answer within 0.5 s: killed" in caplog.text
        assert sb.run("echo next").stdout == "next\n"
        assert disk_watch.DISK_WATCH._proc is not None and disk_watch.DISK_WATCH._proc.pid != hung.pid


def test_the_watchdog_exits_with_its_trainer():
    code = ("from skyrl_stepwise.sandbox import BwrapSandbox, disk_watch\n"
            "with BwrapSandbox() as sb:\n    sb.run('true')\n"
            "print(disk_watch.DISK_WATCH._proc.pid, flush=True)\n"
            "import os; os._exit(0)\n")  # no clean-up of ours: only the closed pipe tells the watchdog
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the watchdog {pid} outlived its trainer"
        time.sleep(0.05)


def test_ctrl_c_in_the_terminal_does_not_reach_the_watchdog(monkeypatch):
    monkeypatch.setattr(runner, "_WATCH_EVERY_S", 1e9)
    with BwrapSandbox(limits=LIMITS, metrics=SandboxMetrics()) as sb:
        sb.run("true")
        proc = disk_watch.DISK_WATCH._proc
        assert os.getpgid(proc.pid) != os.getpgid(0)  # its own session: a terminal's SIGINT goes to our group only
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        assert proc.poll() is None
        assert sb.run(FILL).stop_reason is StopReason.DISK_LIMIT


@pytest.mark.parametrize("name", ["with space", "naïve", "new\nline"])
def test_any_working_dir_name_reaches_the_watchdog(name, monkeypatch):
    monkeypatch.setattr(runner, "_WATCH_EVERY_S", 1e9)
    with tempfile.TemporaryDirectory(prefix=name) as root:  # the system temp dir: a root trainer's uids reach it
        os.chmod(root, 0o755)
        with BwrapSandbox(limits=LIMITS, metrics=SandboxMetrics(), root=Path(root)) as sb:
            assert name in str(sb.workdir)
            assert sb.run(FILL).stop_reason is StopReason.DISK_LIMIT


def _fill_in_a_forked_child(queue) -> None:
    with BwrapSandbox(limits=LIMITS, metrics=SandboxMetrics()) as sb:
        result = sb.run(FILL)
    queue.put((disk_watch.DISK_WATCH._proc.pid, result.stop_reason.value))


def test_a_forked_child_gets_a_watchdog_of_its_own(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(runner, "_WATCH_EVERY_S", 1e9)  # inherited: only a watchdog can stop the child's run
    with BwrapSandbox(limits=LIMITS, metrics=SandboxMetrics()) as sb:
        sb.run("true")
    parents = disk_watch.DISK_WATCH._proc
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_fill_in_a_forked_child, args=(queue,))
    child.start()
    childs_watchdog, reason = queue.get(timeout=60)
    child.join(30)
    assert reason == "disk_limit" and childs_watchdog != parents.pid
    assert disk_watch.DISK_WATCH._proc is parents and parents.poll() is None  # the parent's is untouched


def test_the_watchdog_runs_its_own_packages_code_whatever_the_cwd(tmp_path, monkeypatch):
    """`python -c` puts the cwd first on sys.path: a trainer started in another checkout of this package (another
    version) got that checkout's watchdog, and every run then waited 5 s for an answer it could not parse."""
    fake = tmp_path / "skyrl_stepwise" / "sandbox"
    fake.mkdir(parents=True)
    for d in (tmp_path / "skyrl_stepwise", fake):
        (d / "__init__.py").write_text("")
    (fake / "disk_watch.py").write_text("def main():\n    raise SystemExit('the wrong package')\n")
    monkeypatch.chdir(tmp_path)
    watch = disk_watch.DiskWatch()
    try:
        watch.ensure_started()  # SandboxUnavailable if the fake one ran (it never says "ready")
        assert watch._proc.poll() is None
    finally:
        with watch._lock:
            watch._stop_locked()
