"""What a dead trainer's sandboxes can leave behind, found and killed from outside it.

Why: a run's bwrap carries the parent-death signal (runner.make_preexec), and bwrap's `--die-with-parent` gives the
child it clones the same, but only right before that child execs the sandbox's init. Before that, the child waits on
an eventfd for bwrap to write its uid map (bubblewrap's own start-up; containers/bubblewrap#633, #700): a trainer
killed between bwrap's clone() and that write kills bwrap and leaves the child asleep on the eventfd for ever, as
pid 1 of namespaces of its own, adopted by the host's init. Seen on CI: one such `bwrap` after a killed trainer.
Nothing of the trainer can kill it (it is dead), so two things that outlive it do: its disk watchdog
(disk_watch.py, which exits when the trainer's end of its pipe closes) and the next trainer's start-up sweep
(bwrap.sweep_stale_dirs). Both kill every process whose command line is one of our bwrap command lines for the dead
trainer's sandbox dirs: the dir name holds the trainer's pid, so no other trainer's sandbox can match.
(A sandbox whose init did start is held by its lifeline instead: bwrap.INIT.)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

DIR_PREFIX = "skyrl-sandbox-"  # + the owning process's pid + "-": a sandbox's dir, and the key to its leftovers
_RESCAN_EVERY_S = 0.02


def owner_pid_of(argv: list[str]) -> int | None:
    """The pid of the process whose sandbox `argv` runs, where `argv` is a bwrap command line of ours
    (bwrap.bwrap_argv, possibly behind a holder's `nsenter`): read from the dir bound as its working dir."""
    if "--die-with-parent" not in argv:
        return None
    for i, arg in enumerate(argv[:-1]):
        name = Path(argv[i + 1]).parent.name
        if arg == "--bind" and name.startswith(DIR_PREFIX):
            pid = name[len(DIR_PREFIX):].split("-", 1)[0]
            if pid.isdigit():
                return int(pid)
    return None


def leftover_pids(owners: set[int]) -> list[int]:
    """Live processes (any uid this process may read) whose command line is a sandbox command line of one of
    `owners` (a zombie's is empty: it holds nothing)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        if owner_pid_of([os.fsdecode(a) for a in raw.split(b"\0")[:-1]]) in owners:
            found.append(int(entry.name))
    return found


def kill_leftovers(owners: set[int], settle_s: float = 0.2, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every leftover of the sandboxes of `owners` (dead processes), again until none was seen for
    `settle_s` (a bwrap dying with a clone() in flight may still add one) or `timeout_s` passed; the pids killed.
    Killing a leftover child, pid 1 of its PID namespace, ends the namespace and everything in it."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    quiet_since = None
    while True:
        found = leftover_pids(owners)
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        now = time.monotonic()
        if found:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        if (quiet_since is not None and now - quiet_since >= settle_s) or now >= deadline:
            return sorted(killed)
        time.sleep(_RESCAN_EVERY_S)
