"""Which of the sandbox's caps the kernel enforces on this host, for the start-up line and the docs.

Why: the same code holds differently per host. As root, the working dir is a size-capped tmpfs (workdir_fs.py); a
laptop's non-root trainer mounts it in a user namespace of its own (workdir_holder.py), and only where the kernel
refuses that (user namespaces off or restricted) is the cap the watchdog's poll. Total memory and processes per sandbox need a cgroup v2
with the memory controller delegated to this process (cgroup.py sets one up per run where it can). Without
one, the memory and CPU caps are per process (RLIMIT_AS, RLIMIT_CPU): N processes may hold N x `memory_bytes` (at
most `processes` of them). A user must see which case they are in at start-up, not find out from an incident.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class CapsReport:
    """What holds on this host: the working-dir cap's kind, why there is no cgroup (None: one could be had), and
    the cgroup the sandboxes' per-run cgroups are made under where they are (cgroup.SandboxCgroups)."""

    kernel_disk_cap: bool
    cgroup_missing: str | None
    cgroup_at: Path | None = None

    def line(self) -> str:
        """The start-up line: each cap and who enforces it; what is per-process only is said so."""
        disk = ("working dir: kernel-capped tmpfs (unlinked-but-open files count)" if self.kernel_disk_cap else
                "working dir: a watchdog poll only (no tmpfs could be mounted: not root, and no user + mount "
                "namespace of its own), so a fast writer can overshoot the cap by what it writes in 20 ms")
        if self.cgroup_at is not None:
            mem = (f"memory/CPU/processes: per-sandbox cgroup v2 totals at {self.cgroup_at} (memory.max = "
                   "`memory_bytes` + the tmpfs caps for all of a run's processes together, tmpfs/shmem pages "
                   "included, no swap; pids.max where the pids controller is delegated; `cpu_s` from cpu.stat for "
                   "every process, RLIMIT_CPU still per process)")
        elif self.cgroup_missing is None:
            mem = ("memory/CPU: a cgroup v2 with the memory controller is available, not yet set up for "
                   "the sandboxes: caps are per process until it is")
        else:
            mem = (f"memory/CPU: per-process only ({self.cgroup_missing}): each process has its own address-space "
                   "and CPU-time cap, so up to `processes` of them may hold that many times `memory_bytes`; memfd "
                   "and SysV shared memory are refused by the seccomp filter, /dev/shm is read-only")
        return f"sandbox caps: seccomp filter on; own hostname and session keyring; {disk}; {mem}"


def cgroup_v2_missing() -> str | None:
    """Why no cgroup v2 with the memory controller can be had here, or None where the trainer's own cgroup offers it.
    The cpu controller is not asked for: cgroup.py sets no cpu.max (Limits has no CPU share), and cpu.stat, whence
    a run's CPU seconds, exists without it."""
    mount = _cgroup2_mount()
    if mount is None:
        return "no cgroup v2 file system mounted"
    here = own_cgroup_dir()
    if here is None:
        return "this process is in no cgroup v2 (a cgroup v1 host)"
    try:
        controllers = (here / "cgroup.controllers").read_text().split()
    except OSError as e:
        return f"cgroup v2 at {mount} unreadable for this process ({e.strerror})"
    missing = [c for c in ("memory",) if c not in controllers]
    if missing:
        return (f"cgroup v2 at {mount} has no {' or '.join(missing)} controller for this process "
                "(bound to cgroup v1, or not delegated)")
    return None


def own_cgroup_dir() -> Path | None:
    """The directory of this process's own cgroup v2 (mount point + /proc/self/cgroup's `0::` path), or None."""
    mount, own = _cgroup2_mount(), _own_cgroup()
    if mount is None or own is None:
        return None
    return Path(mount) / own.lstrip("/")


def _cgroup2_mount() -> str | None:
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup2":
                return left.split()[4]
    except OSError:
        pass
    return None


def _own_cgroup() -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    except OSError:
        pass
    return None
