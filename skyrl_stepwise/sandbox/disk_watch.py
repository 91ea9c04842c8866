"""The working-dir size cap, enforced by a process of its own.

A sandbox's working dir is a host directory, so no kernel limit caps its total size (RLIMIT_FSIZE caps one file, not
how many). A watchdog must poll it and kill the run past `Limits.workdir_bytes`. Polling from the trainer's own
process is soft: every check needs the GIL, and a trainer busy in other threads (an engine, a tokenizer, other
rollouts) delays the check by up to a second while a shell loop writes ~400 MB/s. Measured on a 2-core AVX2 EPYC
with 6 busy Python threads: 106-231 MiB written against a 16 MiB cap. So the cap is polled by a small process of its
own (stdlib only, started once per trainer process), which no thread of the trainer can delay:

    trainer --"add <token> <pgid> <cap> <path>"--> watchdog     (after the run's process started)
    trainer --"del <token>"--> watchdog --"done <token> killed|kept"-->  (before the run's process is reaped)

The watchdog SIGKILLs the run's process group once the dir passes its cap. It never kills a group after its "done":
the run's group leader is reaped only after that reply, so its pid cannot have been reused. A watchdog that does not
answer within `ACK_TIMEOUT_S` is killed (then it cannot kill anything either) and a new one starts with the next run.
It exits when the trainer closes its stdin (the trainer died), after killing what the trainer's sandboxes left
(leftovers.py: a bwrap child caught in its start-up), and ignores SIGINT (Ctrl-C stops the trainer, which then
closes it). The runner keeps its own in-process check too, and checks the size after every run.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from skyrl_stepwise.sandbox.base import SandboxUnavailable
from skyrl_stepwise.sandbox.files import over_cap
from skyrl_stepwise.sandbox.leftovers import kill_leftovers

logger = logging.getLogger(__name__)

POLL_EVERY_S = 0.02  # the watchdog's period while runs are watched (longer if a scan takes longer: <= 1/3 of a CPU)
ACK_TIMEOUT_S = 5.0
START_TIMEOUT_S = 60.0  # a loaded box may take seconds to import the package


class DiskWatch:
    """The trainer's handle on its watchdog process: `watch` a run's process group, `unwatch` it before reaping."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._tokens = itertools.count(1)

    def ensure_started(self) -> None:
        """Start the watchdog if this process has none running; SandboxUnavailable if it cannot start."""
        with self._lock:
            self._ensure_locked()

    def watch(self, pgid: int, cap_bytes: int, workdir: Path) -> int:
        """Ask the watchdog to kill process group `pgid` once `workdir` holds more than `cap_bytes`; a token for
        `unwatch`."""
        token = next(self._tokens)
        with self._lock:
            self._send(f"add {token} {pgid} {cap_bytes} {os.fsencode(str(workdir)).hex()}\n")
        return token

    def unwatch(self, token: int) -> bool:
        """Stop watching `token`; returns only once the watchdog can no longer kill its group (it answered, or it
        was killed), so the caller may reap the group's leader. True where the watchdog killed the group (the dir
        passed its cap: with a kernel cap, the files that filled it may be gone with the run's processes)."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return False  # none is running: nothing can kill the group (the next run starts one, and says so)
            try:
                os.write(proc.stdin.fileno(), f"del {token}\n".encode())
            except OSError:
                self._stop_locked()
                return False
            answer = _read_line(proc.stdout.fileno(), ACK_TIMEOUT_S)
            if answer not in (f"done {token} kept", f"done {token} killed"):
                logger.warning("the working-dir size watchdog (pid %d) did not answer within %.1f s: killed; the "
                               "next sandbox run starts a new one", proc.pid, ACK_TIMEOUT_S)
                self._stop_locked()
                return False
            return answer.endswith("killed")

    def _ensure_locked(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._proc is not None:
            logger.warning("the working-dir size watchdog (pid %d) exited with code %s; starting a new one",
                           self._proc.pid, self._proc.returncode)
            self._stop_locked()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": package_root}
        try:
            self._proc = subprocess.Popen(
                # the package's own root first on the path, before the cwd `-c` puts there: a checkout in the cwd
                # (another version of this package) must not answer for this one
                [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                 "from skyrl_stepwise.sandbox.disk_watch import main; main(int(sys.argv[2]))", package_root,
                 str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, start_new_session=True, close_fds=True,
                env=env,
            )
        except OSError as e:
            raise SandboxUnavailable(f"could not start the working-dir size watchdog ({sys.executable}, "
                                     f"skyrl_stepwise.sandbox.disk_watch.main): {e}") from e
        if _read_line(self._proc.stdout.fileno(), START_TIMEOUT_S) != "ready":  # no run goes unwatched meanwhile
            self._stop_locked()
            raise SandboxUnavailable(f"the working-dir size watchdog ({sys.executable}, skyrl_stepwise.sandbox."
                                     f"disk_watch.main) did not start within {START_TIMEOUT_S:.0f} s (its error, if "
                                     "any, is on stderr above); no command runs without it")

    def _send(self, line: str) -> None:
        """Write one request, starting the watchdog if needed (once more if it died just now)."""
        for _ in range(2):
            self._ensure_locked()
            try:
                os.write(self._proc.stdin.fileno(), line.encode())
                return
            except OSError:
                self._stop_locked()
        raise SandboxUnavailable("the working-dir size watchdog died twice while a run was registered with it")

    def _stop_locked(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            f.close()

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's watchdog is not ours (and the lock may have been held by a thread that
        does not exist here). Close our copies of its pipes, so it still sees EOF when the parent dies."""
        self._lock = threading.Lock()
        proc, self._proc = self._proc, None
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


def _read_line(fd: int, timeout: float) -> str | None:
    """One line from `fd` within `timeout` seconds (the watchdog writes each reply in one write), else None."""
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
    return data.decode().strip()


DISK_WATCH = DiskWatch()
os.register_at_fork(after_in_child=DISK_WATCH._forget_after_fork)


def main(trainer_pid: int) -> None:
    """The watchdog process: read requests from stdin, scan the watched dirs every POLL_EVERY_S, kill past a cap;
    once `trainer_pid` is gone, kill what its sandboxes left (leftovers.py) and exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.write(1, b"ready\n")
    watched: dict[str, tuple[int, int, Path]] = {}  # token -> (pgid, cap, workdir); dropped once killed
    killed: set[str] = set()
    pending = b""
    period = POLL_EVERY_S
    next_scan = time.monotonic() + period
    while True:
        timeout = max(next_scan - time.monotonic(), 0.0) if watched else None
        if select.select([0], [], [], timeout)[0]:
            chunk = os.read(0, 65536)
            if not chunk:  # the trainer is gone
                _sweep_after(trainer_pid)
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                verb, token, *rest = line.decode().split(" ")
                if verb == "add":
                    pgid, cap, path = rest
                    watched[token] = (int(pgid), int(cap), Path(os.fsdecode(bytes.fromhex(path))))
                    if len(watched) == 1:  # the first run after an idle spell: scan one period from now
                        next_scan = time.monotonic() + period
                elif verb == "del":
                    watched.pop(token, None)
                    how = "killed" if token in killed else "kept"
                    killed.discard(token)
                    os.write(1, f"done {token} {how}\n".encode())
        now = time.monotonic()
        if watched and now >= next_scan:
            for token, (pgid, cap, workdir) in list(watched.items()):
                if over_cap(workdir, cap):
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    del watched[token]
                    killed.add(token)
            took = time.monotonic() - now
            period = max(POLL_EVERY_S, 2 * took)
            next_scan = time.monotonic() + period


def _sweep_after(trainer_pid: int, wait_s: float = 5.0) -> None:
    """Kill what the dead trainer's sandboxes left (leftovers.py), once the kernel has finished its exit: its pipe
    closes before its children get their parent-death signals, which is when this process is handed to another
    parent. (A trainer that only closed the pipe, an exec, is waited for `wait_s`.)"""
    deadline = time.monotonic() + wait_s
    while os.getppid() == trainer_pid and time.monotonic() < deadline:
        time.sleep(0.005)
    killed = kill_leftovers({trainer_pid})
    if killed:
        with contextlib.suppress(OSError):  # the trainer's stderr may be a pipe nobody reads any more
            print(f"skyrl_stepwise sandbox watchdog: trainer {trainer_pid} is gone; killed {len(killed)} sandbox "
                  f"process(es) it left starting (pids {killed})", file=sys.stderr, flush=True)
