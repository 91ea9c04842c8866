"""What every sandbox backend shares: the limits a run gets, what a run returns, why it stopped, the counters, and
the `Sandbox` protocol (bubblewrap by default, Docker/Podman in container.py; a remote backend such as E2B/Modal
plugs in by implementing the same methods and a branch of backends.open_sandbox).

A sandbox is started once per trajectory with a private working directory holding a copy of the task's files;
commands run inside it, one at a time, and `close()` kills whatever is left and removes the directory.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Protocol, runtime_checkable


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start on this machine (not Linux, no user namespaces, bwrap missing or failing; no docker
    daemon, no image). Raised
    instead of ever running the code on the host: the message names the reason and what to do about it."""


class SandboxPathError(ValueError):
    """A file path the caller (e.g. the model, through a tool) gave leaves the working directory (absolute path,
    `..`, or a symlink pointing outside). A clear message for the model, never a host file read or written."""


class StopReason(str, enum.Enum):
    """Why a run ended. Everything but EXITED is a limit or a kill the sandbox imposed."""

    EXITED = "exited"  # the command finished on its own (any exit code)
    TIMEOUT = "timeout"  # wall-clock limit: the sandbox killed every process of the run
    CPU_LIMIT = "cpu_limit"  # RLIMIT_CPU: SIGXCPU / SIGKILL from the kernel
    MEMORY_LIMIT = "memory_limit"  # RLIMIT_AS: an allocation failed (MemoryError, ENOMEM)
    OUTPUT_LIMIT = "output_limit"  # stdout+stderr passed the cap: the sandbox killed the run, the reader kept the cap
    PROCESS_LIMIT = "process_limit"  # RLIMIT_NPROC: fork/clone failed (EAGAIN)
    FILE_SIZE_LIMIT = "file_size_limit"  # RLIMIT_FSIZE: a write past the per-file cap (EFBIG / SIGXFSZ)
    DISK_LIMIT = "disk_limit"  # the working dir or /tmp passed its size cap (ENOSPC, or the watchdog killed the run)
    KILLED = "killed"  # ended by a signal none of the above explains


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-run limits. Defaults suit a unit-test-sized Python program; a task may ask for more."""

    wall_s: float = 10.0  # wall clock, then the whole run is killed
    cpu_s: int = 10  # RLIMIT_CPU per process (soft; hard = soft + 1 → SIGKILL)
    memory_bytes: int = 1 << 30  # RLIMIT_AS per process (address space)
    processes: int = 64  # RLIMIT_NPROC inside the sandbox's own user namespace
    file_size_bytes: int = 64 << 20  # RLIMIT_FSIZE: largest file a run may write
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 64 << 10  # stdout + stderr kept; past it the run is killed (never read into memory)
    workdir_bytes: int = 256 << 20  # the working dir's total size (disk_watch.py during the run, checked after)
    tmp_bytes: int = 64 << 20  # size of the private tmpfs /tmp

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox Limits.{field.name} must be a positive number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one command gave. `stdout`/`stderr` are decoded text, cut at the output cap (`truncated` says so)."""

    stdout: str
    stderr: str
    exit_code: int | None  # None where the run was killed by a signal (see `signal`)
    signal: int | None
    stop_reason: StopReason
    wall_s: float
    cpu_s: float  # user + system time of the run's processes
    truncated: bool
    # the most memory the run's processes held together (cgroup v2 memory.peak, tmpfs/shmem pages included), where
    # the run had a cgroup of its own (cgroup.py); a measurement, so results are compared without it
    memory_peak_bytes: int | None = dataclasses.field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        """The command ran to its end and exited 0."""
        return self.stop_reason is StopReason.EXITED and self.exit_code == 0

    def describe(self) -> str:
        """One line naming how the run ended, for the tool message and the trajectory's record."""
        if self.stop_reason is StopReason.EXITED:
            return f"exit code {self.exit_code}"
        how = f"signal {self.signal}" if self.signal is not None else f"exit code {self.exit_code}"
        return f"stopped: {self.stop_reason.value} ({how}, wall {self.wall_s:.2f}s, cpu {self.cpu_s:.2f}s)"


@dataclasses.dataclass
class SandboxMetrics:
    """Counters shared by the sandboxes of one run (thread-safe): how many started/closed/ran, and runs by why
    they stopped, so an attack or a runaway program shows up in the run's metrics, not only in its trajectory."""

    started: int = 0
    closed: int = 0
    runs: int = 0
    stops: Counter = dataclasses.field(default_factory=Counter)
    path_refusals: int = 0
    # wall seconds inside runs (the host waiting on sandboxed commands): summed over a step's trajectories and
    # divided by the step's seconds, the sandbox's share of an RL step
    seconds: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def count_run(self, reason: StopReason, wall_s: float = 0.0) -> None:
        """Count one finished run under its stop reason, and the wall seconds it took."""
        with self._lock:
            self.runs += 1
            self.stops[reason.value] += 1
            self.seconds += wall_s

    def count(self, field: str) -> None:
        """Increment a plain counter (`started`, `closed`, `path_refusals`)."""
        with self._lock:
            setattr(self, field, getattr(self, field) + 1)

    def as_dict(self) -> dict[str, float]:
        """Flat `sandbox/...` keys for the run's metrics."""
        with self._lock:
            out = {"sandbox/started": self.started, "sandbox/closed": self.closed, "sandbox/runs": self.runs,
                   "sandbox/path_refusals": self.path_refusals, "sandbox/seconds": self.seconds}
            out.update({f"sandbox/stop/{reason}": n for reason, n in sorted(self.stops.items())})
            return out


@runtime_checkable
class Sandbox(Protocol):
    """One trajectory's sandbox. Backends: `BwrapSandbox` (default, Linux), `ContainerSandbox` (docker/podman); a
    remote backend implements the same methods. Open one with backends.open_sandbox; use it as a context manager
    so it closes also when the trajectory fails."""

    workdir: Path  # the host directory backing the sandbox's working directory

    def run(self, command: str, stdin: str | bytes | None = None, limits: Limits | None = None) -> RunResult:
        """Run a shell command inside the sandbox, cwd = the working directory."""
        ...

    def read_file(self, path: str, max_bytes: int = ...) -> str:
        """Read a file of the working directory (path relative to it); SandboxPathError outside it."""
        ...

    def write_file(self, path: str, content: str | bytes) -> None:
        """Write a file of the working directory (path relative to it); SandboxPathError outside it."""
        ...

    def close(self) -> None:
        """Kill every process the sandbox started and remove its working directory. Idempotent."""
        ...

    def __enter__(self) -> Sandbox: ...

    def __exit__(self, *exc: object) -> None: ...


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (any owner): the sweeps of a dead trainer's dirs and cgroups ask it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
