"""Per-sandbox cgroup v2 caps: one cgroup per sandboxed run, capping the memory and processes of all of the run's
processes together and reading their CPU seconds.

Why: rlimits are per process. Up to `processes` processes each hold `memory_bytes`, and memory that no process maps
(tmpfs, shmem, memfd pages) counts against no rlimit at all. A cgroup counts every process of the run together, and
the kernel charges tmpfs/shmem/memfd pages to the cgroup that touched them. One can be had only where this process's
own cgroup is a cgroup v2 with the memory controller and this process may write it: root, or a delegated scope
(`systemd-run --user --scope -p Delegate=yes ...`).

Layout, under cgroup v2's "no internal processes" rule (a non-root cgroup that hands controllers to its children
holds no process itself):

    <own>/cgroup.subtree_control   "+memory +pids" (the pids controller where it is delegated)
    <own>/trainer/                 this process and those it started (a working dir's holder, the disk
                                   watchdog, an engine's workers), moved there once where <own> lists them. The
                                   others of <own> are not ours to move; where there are any, the kernel refuses
                                   the controllers (EBUSY), the warning names their pids, and the sandboxes stay
                                   per process
    <own>/sandbox-<pid>-<n>/       one per run: memory.max (`memory_bytes` plus what the run may write to its
                                   tmpfs dirs: those pages are charged here too, and a write the disk caps allow
                                   must not leave the command less than `memory_bytes`), memory.swap.max 0,
                                   pids.max `processes` + 2 (bwrap and the sandbox's init); the run's first process
                                   joins it before it execs bwrap, so nothing the run forks starts outside; after the
                                   run: memory.peak, memory.events' oom_kill, cpu.stat's usage_usec are read, the
                                   cgroup is killed (cgroup.kill) and removed

A process the trainer starts sits in <own>/trainer; it finds that layout and makes its runs' cgroups beside the
trainer's. A SIGKILLed trainer's run cgroups are swept by the next trainer (by the pid in their names).

The cpu controller is not enabled: Limits has no CPU share for cpu.max, and an enabled cpu controller with no cap
would only make each sandbox weigh as much as the whole trainer in the scheduler. cpu.stat's usage_usec exists
without it.

Nothing here may make a sandbox fail where it ran before: any refusal turns the cgroups off for this process with
one warning naming the file and errno, and the runs go on under the per-process caps they always had.

Tested: tests/test_sandbox_cgroup.py against a fake tree (this repo's CI host binds memory and cpu to cgroup v1);
tests/test_sandbox_cgroup_real.py on a real kernel, run by `python benchmarks/cgroup_v2_vm.py` in a VM (Linux
6.1.0-57-amd64, QEMU TCG, cgroup_no_v1=all): 9 passed as root and 9 as a uid 65534 in a delegated cgroup (memory of
many processes, tmpfs and memfd pages OOM-stopped at memory.max, pids.max, detached CPU seconds, removal, sweep).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno as errnos
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from skyrl_stepwise.sandbox.base import Limits, RunResult, StopReason, pid_alive
from skyrl_stepwise.sandbox.caps import cgroup_v2_missing, own_cgroup_dir

logger = logging.getLogger(__name__)
LEAF = "trainer"  # the leaf this process moves into so that its own cgroup may hand controllers down
PREFIX = "sandbox-"  # + this process's pid + "-" + a counter: a dead trainer's cgroups are swept by the next one
# bwrap and the sandbox's init live in the run's cgroup beside the `processes` the command may have
_PIDS_HEADROOM = 2
_RMDIR_WAIT_S = 1.0  # a killed cgroup is empty once its processes have exited: rmdir is retried this long


@dataclasses.dataclass(frozen=True)
class CgroupUsage:
    """What a run's cgroup counted for all its processes: the most memory held at once (None: no memory.peak
    before Linux 5.19), processes the OOM killer killed, and CPU seconds (None: no cpu.stat)."""

    memory_peak_bytes: int | None
    oom_kills: int
    cpu_s: float | None


def account(result: RunResult, usage: CgroupUsage) -> RunResult:
    """The run's result with what its cgroup counted: CPU seconds of every process (detached ones included) where
    that is more than the runner saw, the memory peak, and MEMORY_LIMIT where the cgroup's OOM killer killed a
    process of a run that then failed without another reason (the runner reads a SIGKILL as `killed`, and a
    shell's 137 as an exit). A run the reader stopped (timeout, output, disk) keeps that reason; one that exited 0
    despite a killed child succeeded."""
    reason = result.stop_reason
    if usage.oom_kills and reason in (StopReason.EXITED, StopReason.KILLED) and not result.ok:
        reason = StopReason.MEMORY_LIMIT
    return dataclasses.replace(result, stop_reason=reason, cpu_s=max(result.cpu_s, usage.cpu_s or 0.0),
                               memory_peak_bytes=usage.memory_peak_bytes)


class InTheWay(OSError):
    """The kernel's EBUSY on subtree_control, its message naming the processes left in the trainer's cgroup."""


class RunCgroup:
    """One run's cgroup. `join` runs in the run's child before exec (`joining_first`); `joined` tells the parent
    afterwards whether it got in, over a pipe, so a refused join is noticed, never guessed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._procs = os.fsencode(path / "cgroup.procs")  # encoded here: the child only writes
        self._report_read, self._report_write = os.pipe()  # close-on-exec: the child's copy goes with its exec

    def joining_first(self, preexec: Callable[[], None]) -> Callable[[], None]:
        """The run's child set-up (runner.make_preexec) with the join first: before the uid change, which would
        take a root trainer's right to write cgroup.procs; before exec, so nothing the run forks starts outside."""

        def join_then_set_up() -> None:
            self.join()
            preexec()

        return join_then_set_up

    def join(self) -> None:
        """In the child, before it drops its uid and execs bwrap: write its pid into the cgroup, and the outcome
        (0 or the errno) on the pipe. Never raises: a run left outside keeps its per-process caps."""
        try:
            fd = os.open(self._procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
            code = 0
        except OSError as e:
            code = e.errno or errnos.EIO
        with contextlib.suppress(OSError):
            os.write(self._report_write, b"%d\n" % code)

    def joined(self) -> str | None:
        """After the spawn: None where the child joined, else why not (the child wrote its errno before exec, so
        the pipe holds it by the time the spawn returned)."""
        self.close_write_end()
        try:
            os.set_blocking(self._report_read, False)
            data = os.read(self._report_read, 16)
        except OSError:
            data = b""
        if not data:
            return f"{self.path / 'cgroup.procs'}: the run's process never reported joining"
        code = int(data.split(b"\n", 1)[0])
        return None if code == 0 else f"{self.path / 'cgroup.procs'}: {_name(code)}"

    def close_write_end(self) -> None:
        if self._report_write >= 0:
            os.close(self._report_write)
            self._report_write = -1

    def close(self) -> None:
        """Close both ends of the pipe (idempotent)."""
        self.close_write_end()
        if self._report_read >= 0:
            os.close(self._report_read)
            self._report_read = -1


class SandboxCgroups:
    """This process's per-run cgroups: prepared once (the delegation layout above), then one cgroup per run.

    `base`: the cgroup to make them under; None (the default) is this process's own cgroup v2, found on first use.
    A test passes a fake tree, and overrides `_mkdir` / `_rmdir` / `_write`, the kernel's side."""

    def __init__(self, base: Path | None = None, pid: int | None = None) -> None:
        self._given_base = base
        self._given_pid = pid
        self._prepared = False
        self._base: Path | None = None
        self._why_not: str | None = None
        self._pids = False  # whether the pids controller was enabled
        self._after_fork()

    def _after_fork(self) -> None:
        """A forked child keeps what its parent prepared (it sits in the same leaf, beside the runs' cgroups), with
        a lock of its own and its own pid in its runs' names (the sweep goes by that pid)."""
        self._pid = self._given_pid if self._given_pid is not None else os.getpid()
        self._lock = threading.RLock()
        self._ids = itertools.count()

    def status(self) -> tuple[Path | None, str | None]:
        """(where the runs' cgroups are made, None) once prepared, else (None, why there are none)."""
        with self._lock:
            if not self._prepared:
                self._prepared = True
                self._prepare()
            return self._base, self._why_not

    @contextlib.contextmanager
    def for_run(self, limits: Limits, tmpfs_bytes: int = 0) -> Iterator[RunCgroup | None]:
        """A fresh cgroup capped at `limits` (memory: `memory_bytes` + `tmpfs_bytes`, the size caps of the run's
        tmpfs dirs) for one run, killed and removed when the block ends; None where there are no cgroups (or making
        this one failed: then they are off for this process, with one warning)."""
        run = self._make(limits, tmpfs_bytes)
        try:
            yield run
        finally:
            if run is not None:
                run.close()
                self._remove(run.path)

    def account(self, run: RunCgroup, result: RunResult) -> RunResult:
        """`result` with what the run's cgroup counted (see `account`); unchanged, and the cgroups turned off, where
        the run's process could not join it."""
        why = run.joined()
        if why is not None:
            self._give_up(why)
            return result
        return account(result, self.usage(run.path))

    def usage(self, path: Path) -> CgroupUsage:
        """memory.peak, memory.events' oom_kill and cpu.stat's usage_usec of a run's cgroup (absent files: None/0)."""
        peak = _read(path / "memory.peak")
        events = _keyed(path / "memory.events")
        usec = _keyed(path / "cpu.stat").get("usage_usec")
        return CgroupUsage(memory_peak_bytes=int(peak) if peak and peak.strip().isdigit() else None,
                           oom_kills=events.get("oom_kill", 0), cpu_s=usec / 1e6 if usec is not None else None)

    def sweep(self, base: Path) -> list[Path]:
        """Kill and remove the run cgroups under `base` of a process of ours that died without removing them (a
        SIGKILLed trainer); never those of a live process (one may be between making a cgroup and joining it)."""
        removed = []
        for path in sorted(base.glob(f"{PREFIX}*-*")):
            owner = path.name[len(PREFIX):].split("-", 1)[0]
            if not owner.isdigit() or not path.is_dir() or int(owner) == self._pid or pid_alive(int(owner)):
                continue
            if self._remove(path):
                removed.append(path)
        return removed

    # -- the kernel's side (a test's fake tree overrides these) --

    def _mkdir(self, path: Path, exist_ok: bool = False) -> None:
        """Make a cgroup (the kernel fills it with its interface files)."""
        path.mkdir(exist_ok=exist_ok)

    def _rmdir(self, path: Path) -> None:
        """Remove an empty cgroup (its interface files go with it)."""
        os.rmdir(path)

    def _write(self, path: Path, text: str) -> None:
        """Write one interface file; never creates one (a missing file is the kernel saying no)."""
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    # -- internals --

    def _prepare(self) -> None:
        """Find the base, sweep what a dead trainer left, and enable the controllers for its children (moving this
        process into a leaf first where the base lists it); on any refusal, no cgroups, and one warning."""
        base = self._given_base
        if base is None:
            self._why_not = cgroup_v2_missing()
            base = own_cgroup_dir()
            if self._why_not is not None or base is None:
                self._why_not = self._why_not or "this process is in no cgroup v2"
                return
        step = base / "cgroup.controllers"
        try:
            if base.name == LEAF and "memory" in (base.parent / "cgroup.subtree_control").read_text().split():
                base = base.parent  # a process started by a prepared trainer: its layout is this one's too
            available = (base / "cgroup.controllers").read_text().split()
            if "memory" not in available:
                self._why_not = f"cgroup v2 at {base} has no memory controller for this process"
                return
            wanted = ["memory", *(["pids"] if "pids" in available else [])]
            self.sweep(base)
            step = base / "cgroup.subtree_control"
            if not set(wanted) <= set(step.read_text().split()):
                self._enable(base, wanted)
        except OSError as e:
            self._give_up(f"{e.filename or step}: {_name(e.errno)}" + (f" ({e.strerror})" if isinstance(e, InTheWay)
                                                                      else ""))
            return
        self._base, self._pids = base, "pids" in wanted

    def _enable(self, base: Path, wanted: list[str]) -> None:
        """Write the controllers into `base`'s subtree_control, first moving this process and every process it
        started that `base` lists into `base`/trainer (a non-root cgroup with processes may not enable controllers;
        the root cgroup, which has no cgroup.type, may). Where that fails, they are moved back and the error raised;
        an EBUSY names the processes left in `base` (not started by this one: not ours to move)."""
        moved: list[int] = []
        if (base / "cgroup.type").exists():
            ours = _descendants(self._pid, _listed(base / "cgroup.procs"))
            if ours:
                self._mkdir(base / LEAF, exist_ok=True)
            for pid in ours:
                try:
                    self._write(base / LEAF / "cgroup.procs", str(pid))
                    moved.append(pid)
                except ProcessLookupError:  # a child that exited meanwhile
                    continue
                except OSError:
                    if pid == self._pid:
                        raise
        try:
            self._write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        except OSError as e:
            for pid in moved:  # best effort: leave them where they were found
                with contextlib.suppress(OSError):
                    self._write(base / "cgroup.procs", str(pid))
            others = [p for p in _listed(base / "cgroup.procs") if p not in moved]
            if e.errno == errnos.EBUSY and others:
                raise InTheWay(e.errno, f"pids {' '.join(map(str, others[:8]))} left in it (not started by this "
                               "process, or not movable): start the trainer alone in its scope", e.filename) from e
            raise

    def _make(self, limits: Limits, tmpfs_bytes: int) -> RunCgroup | None:
        """Make and cap one run's cgroup; None (and cgroups off, warned) where the kernel refuses."""
        base, _ = self.status()
        if base is None:
            return None
        path = base / f"{PREFIX}{self._pid}-{next(self._ids)}"
        step = path
        try:
            self._mkdir(path)
            step = path / "memory.max"
            self._write(step, str(limits.memory_bytes + tmpfs_bytes))
            step = path / "memory.swap.max"
            if step.exists():  # swap accounting on: no swap, or the cap would hold twice the memory
                self._write(step, "0")
            if self._pids:
                step = path / "pids.max"
                self._write(step, str(limits.processes + _PIDS_HEADROOM))
            return RunCgroup(path)
        except OSError as e:
            self._give_up(f"{e.filename or step}: {_name(e.errno)}")
            self._remove(path)
            return None

    def _remove(self, path: Path) -> bool:
        """Kill whatever is left in a run's cgroup and remove it; a warning (never an exception) where it stays."""
        if not path.is_dir():
            return True
        if (path / "cgroup.kill").exists():  # Linux 5.14+: kills every process of the cgroup at once
            with contextlib.suppress(OSError):
                self._write(path / "cgroup.kill", "1")
        else:
            for pid in (_read(path / "cgroup.procs") or "").split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + _RMDIR_WAIT_S
        while True:
            try:
                self._rmdir(path)
                return True
            except FileNotFoundError:
                return True
            except OSError as e:
                if e.errno != errnos.EBUSY or time.monotonic() >= deadline:
                    logger.warning("sandbox cgroup %s could not be removed: %s", path, _name(e.errno))
                    return False
                time.sleep(0.01)

    def _give_up(self, why: str) -> None:
        """Turn the cgroups off for this process: one loud warning, then per-process caps only."""
        with self._lock:
            if self._why_not is None:
                logger.warning("SANDBOX CAPS DEGRADED: the per-sandbox cgroup v2 could not be set up (%s); memory "
                               "and processes are capped per process only from now on", why)
                self._why_not = f"per-sandbox cgroup v2 refused: {why}"
            self._base = None


def _name(code: int | None) -> str:
    """`EBUSY (Device or resource busy)` for an errno."""
    if code is None:
        return "unknown error"
    return f"{errnos.errorcode.get(code, str(code))} ({os.strerror(code)})"


def _listed(path: Path) -> list[int]:
    """The pids a cgroup.procs lists ([] where it cannot be read)."""
    return [int(p) for p in (_read(path) or "").split() if p.isdigit()]


def _descendants(root: int, pids: list[int]) -> list[int]:
    """`root` (first, where listed) and those of `pids` that descend from it (its children, theirs...), by /proc's
    parent pids: the processes this one may move along with itself."""

    def descends(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            seen.add(pid)
            pid = _parent(pid)
            if pid == root:
                return True
        return False

    return [root] * (root in pids) + [p for p in pids if p != root and descends(p)]


def _parent(pid: int) -> int:
    """The parent pid of a process from /proc (0 where it is gone)."""
    fields = (_read(Path(f"/proc/{pid}/stat")) or "").rpartition(")")[2].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _keyed(path: Path) -> dict[str, int]:
    """A flat-keyed cgroup file (`key value` per line) as a dict; {} where it is absent."""
    out = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


SANDBOX_CGROUPS = SandboxCgroups()  # this process's: found and prepared on the first run
os.register_at_fork(after_in_child=SANDBOX_CGROUPS._after_fork)
