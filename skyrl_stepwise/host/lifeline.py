"""Every process a trainer starts dies with it, also when the trainer itself is SIGKILLed (the OOM killer's signal).

A trainer killed outright runs no `finally`, no atexit and no Ray shutdown. Measured before this module: Ray's own
fate sharing ended the GCS, the raylet and the dashboard with the driver, but its retrieval server (re-parented to
PID 1, about 250 MB resident, its port held) and Ray's DashboardAgent and RuntimeEnvAgent (110 and 85 MB) were
still up minutes later, and nothing would ever end them. A parent-death signal (prctl PR_SET_PDEATHSIG) does not
serve: it fires when the parent *thread* exits (a child started from `asyncio.to_thread` would die with that worker
thread), it reaches only direct children, and Ray's agents are the raylet's children, not ours.

So the tie is a lifeline, carried two ways:

- **A mark in the environment.** `arm()` puts a token unique to this process into `os.environ`
  (`SKYRL_STEPWISE_LIFELINE`), so every process started after it carries the token in its initial environment
  (`/proc/<pid>/environ`): the retrieval server, the Ray head (GCS, raylet), the agents the raylet starts, the Ray
  workers, vLLM's engine-core processes, and their children, however deep and whoever their parent is now. Tokens
  accumulate (`a:b`), so a child that arms its own lifeline keeps its parent's mark too.
- **A pipe a keeper watches.** `arm()` also starts one small keeper process (this file run as a script: stdlib only,
  ~13 MB) in a session of its own and detached (its first process exits at once, so it is no descendant of the
  trainer: whoever waits for the trainer's descendants to end does not wait for the keeper's sweep). It holds the read
  end of a pipe whose only write end stays in this process. When this process ends, by any means, the kernel closes
  the write end and the keeper's read returns EOF at once; it then stops every process that carries the token
  (SIGTERM, then SIGKILL after a grace period), each through a pidfd opened and re-checked first, so a recycled pid is
  never hit, and exits. A child forked without exec (whose environment block is the parent's, unmarked) watches the
  same pipe from a thread and exits at its EOF.

A process that clears its environment (the bwrap sandbox) is not marked: the sandbox has its own ties, which hold
in a library user's process too, where no lifeline is armed (`--die-with-parent`, its init's lifeline pipe, and
its disk watchdog's sweep: sandbox/leftovers.py).
Processes on other nodes of a Ray cluster are not ours to stop: Ray ends a dead driver's job there.

The same file tells whether a process is still the one that was meant (`ProcessIdentity`: pid namespace, pid and
start time), which is how owners of leftover files (engines' adapter folders in /dev/shm) are found dead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

LIFELINE_ENV = "SKYRL_STEPWISE_LIFELINE"
GRACE_S = 5.0  # SIGTERM first (Ray's raylet and vLLM clean their shared memory on it), SIGKILL what is left after it
GIVE_UP_S = 30.0  # then a process that outlives SIGKILL (stuck in the kernel) is left, not scanned for forever
_armed: dict[int, "_Lifeline"] = {}  # pid -> its lifeline: one a process (a forked child's copy names the parent)
_arming = threading.Lock()  # two threads arming at once start one keeper


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as it cannot be mistaken for another: its pid namespace and pid, and its start time in clock ticks
    since boot (/proc/<pid>/stat field 22), which a later process given the same pid does not share."""

    namespace: int
    pid: int
    start_ticks: int

    @property
    def tag(self) -> str:
        """`<namespace>-<pid>-<start>`: safe in a file name, read back by `from_tag`."""
        return f"{self.namespace}-{self.pid}-{self.start_ticks}"

    @classmethod
    def from_tag(cls, tag: str) -> "ProcessIdentity | None":
        """The identity a `tag` names, None for text that is not one."""
        parts = tag.split("-")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            return None
        return cls(*(int(p) for p in parts))

    def is_alive(self) -> bool:
        """Whether this very process still runs; one of another pid namespace cannot be seen, so it counts as alive
        (never sweep what might belong to a live process elsewhere)."""
        if self.namespace != pid_namespace():
            return True
        return process_identity(self.pid) == self


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid); 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_identity(pid: int | None = None) -> ProcessIdentity | None:
    """The identity of `pid` (default: this process), None if no such process runs (or it is a zombie)."""
    pid = os.getpid() if pid is None else pid
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] == "Z":
        return None
    return ProcessIdentity(pid_namespace(), pid, int(fields[19]))


def lifeline_tokens(pid: int) -> list[str]:
    """The lifeline tokens process `pid` was started with (empty if none, or if its environment cannot be read)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return []
    prefix = f"{LIFELINE_ENV}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace").split(":")
    return []


def marked_processes(token: str) -> list[int]:
    """Every process (but this one) that carries `token`."""
    own = os.getpid()
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and int(p.name) != own]
    return sorted(pid for pid in pids if token in lifeline_tokens(pid))


def arm() -> str:
    """Tie every process started from now on to this process's life; returns the token ("" off Linux, where there is
    no /proc to find marked processes in). Idempotent in a process."""
    with _arming:
        held = _armed.get(os.getpid())
        if held is not None:
            return held.token
        if not Path("/proc/self/environ").exists():
            return ""
        token = uuid.uuid4().hex[:16]
        read_end, write_end = os.pipe()  # both close-on-exec: no child program inherits either
        # its own session: a signal to the trainer's process group spares it; its first process exits once the
        # keeper proper is forked off
        subprocess.run([sys.executable, "-S", "-E", __file__, token, str(os.getpid())], stdin=read_end,
                       start_new_session=True, check=True)
        _armed[os.getpid()] = _Lifeline(token, read_end, write_end)
        inherited = os.environ.get(LIFELINE_ENV)
        os.environ[LIFELINE_ENV] = f"{inherited}:{token}" if inherited else token
        # Ray's agents set their process title with setproctitle, which overwrites the memory /proc/<pid>/environ
        # shows (padding the title over it): their mark was gone, and a SIGKILLed trainer left DashboardAgent and
        # RuntimeEnvAgent up (the keeper stopped only the retriever). SPT_NOENV keeps setproctitle off the environment.
        os.environ["SPT_NOENV"] = "1"
        return token


@dataclass(frozen=True)
class _Lifeline:
    """What an armed process holds: its token and both ends of the keeper's pipe (the read end for forked children to
    watch)."""

    token: str
    read_end: int
    write_end: int


def _watch_parents_lifeline() -> None:
    """In a child forked without exec (its environment block, copied from the parent's, has no mark): close the
    parent's write end, so the parent's death still reads as EOF, and exit at that EOF."""
    global _arming
    _arming = threading.Lock()  # another thread of the parent may have held it at the fork
    for pid, line in list(_armed.items()):
        if pid == os.getpid():
            continue
        os.close(line.write_end)
        del _armed[pid]
        threading.Thread(target=_exit_at_eof, args=(line.read_end,), daemon=True, name="lifeline").start()


def _exit_at_eof(fd: int) -> None:
    while os.read(fd, 4096):
        pass
    os._exit(1)  # the trainer is gone: end as the SIGKILL that took it would have ended this process


os.register_at_fork(after_in_child=_watch_parents_lifeline)


def _signal(pid: int, token: str, sig: int) -> None:
    """Send `sig` to `pid` if it still carries `token`, through a pidfd so a pid recycled meanwhile is never hit
    (a plain kill right after the check where the kernel has no pidfds)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd_open (Linux before 5.3)
        fd = None
    try:
        if token not in lifeline_tokens(pid):  # checked after the pidfd pins the process
            return
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        pass
    finally:
        if fd is not None:
            os.close(fd)


def stop_marked(token: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every process that carries `token`, SIGKILL those still up after `grace_s` (and any that appeared
    meanwhile), until two scans in a row find none; returns the pids found. Two, because a process caught inside
    exec shows an empty environment for a moment, and processes start others while dying (a raylet its workers)."""
    found: set[int] = set()
    start = time.monotonic()
    scans_without = 0
    while scans_without < 2 and time.monotonic() < start + grace_s + GIVE_UP_S:
        pids = marked_processes(token)
        scans_without = 0 if pids else scans_without + 1
        found.update(pids)
        sig = signal.SIGTERM if time.monotonic() < start + grace_s else signal.SIGKILL
        for pid in pids:
            _signal(pid, token, sig)
        time.sleep(0.1)
    return sorted(found)


def keep(token: str, trainer_pid: int) -> None:
    """The keeper's life: detach, wait for EOF on stdin (the trainer is gone), then stop everything it marked."""
    if os.fork() > 0:
        os._exit(0)  # the trainer reaps this first process; the keeper proper is re-parented, no descendant of it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the trainer must not end the keeper first
    while os.read(0, 4096):
        pass
    stopped = stop_marked(token)
    if stopped:
        print(f"lifeline: the trainer (pid {trainer_pid}) ended; stopped {len(stopped)} process(es) it had started: "
              f"{' '.join(map(str, stopped))}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    keep(sys.argv[1], int(sys.argv[2]))
