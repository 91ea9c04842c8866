"""A kernel-capped working dir for a trainer that may not mount (not root: every laptop).

Why: as root the working dir is a size-capped tmpfs mounted on the host (workdir_fs.py). A non-root trainer may not
mount in its own namespace, so its working dir was a plain host dir: the cap was the watchdog's poll (soft by what a
writer writes in 20 ms, blind to unlinked-but-open files) and `/proc/self/mountinfo` inside showed the dir's host
path. But any user may make a user namespace and mount a tmpfs inside it. So each sandbox gets a holder: a small
process (util-linux's `unshare`, then `cat`) in a user + mount namespace of its own (the trainer's uid mapped to 0,
nothing else), which mounts the tmpfs at the working dir's path there and then waits on its stdin. Then:
- each run's bwrap is started inside the holder's namespaces (through `nsenter`, which the namespace's owner may
  run), so `--bind <workdir> /work` binds the tmpfs: the kernel refuses the write past the cap (ENOSPC), counts
  unlinked-but-open pages, and mountinfo shows `/ /work ... tmpfs`, no host path;
- the host side (the file API, the copy-back, the watchdog, graders' copies) reads and writes the same tmpfs through
  `/proc/<holder>/root/<workdir>` (`view`): the trainer owns the namespace, so the kernel lets it in (the file API
  resolves paths itself under that root: files._resolve_inside);
- a per-run `workdir_bytes` is a remount, run in the holder's namespaces;
- closing its stdin (close(), or the trainer's death: the pipe's only other end closes) ends the holder, its mount
  namespace and the tmpfs with it.
Where the kernel refuses the namespace or the mount (user namespaces off, an AppArmor restriction), `available()`
is False and the working dir stays a plain dir with the watchdog as the cap, which the start-up line says.
"""

from __future__ import annotations

import errno
import functools
import os
import select
import shutil
import subprocess
import tempfile
from pathlib import Path

from skyrl_stepwise.sandbox.workdir_fs import MAX_INODES

_START_TIMEOUT_S = 30.0

# The holder: util-linux's `unshare` makes the namespaces (the caller's uid/gid mapped to 0, mounts private), the shell
# mounts the tmpfs, says "ok" and becomes `cat`, which reads its stdin until EOF (close(), or the trainer's death:
# only the trainer holds the pipe's other end, opened close-on-exec); then the namespace and the tmpfs are gone.
HOLDER_SCRIPT = 'mount -t tmpfs -o "$2" tmpfs "$1" && echo ok && exec cat > /dev/null'


class WorkdirHolder:
    """The holder of one sandbox's capped working dir (see the module docstring): `view` is where the host reads
    and writes it, `enter_argv()` the prefix that starts a command in its namespaces."""

    def __init__(self, workdir: Path, size_bytes: int) -> None:
        """Mount a tmpfs of `size_bytes` at the (empty) `workdir` inside a new holder's namespaces. OSError naming
        what the kernel refused."""
        self.workdir = Path(os.path.realpath(workdir))
        self._proc = subprocess.Popen(
            [_util("unshare"), "--user", "--map-root-user", "--mount", "--propagation", "private", "sh", "-c",
             HOLDER_SCRIPT, "holder", str(self.workdir), _options(size_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PATH": _PATH},
            close_fds=True, text=True)
        ready, _, _ = select.select([self._proc.stdout], [], [], _START_TIMEOUT_S)  # a hung mount never hangs us
        if not ready or self._proc.stdout.readline().strip() != "ok":
            self._proc.kill()
            self._proc.wait()
            why = self._proc.stderr.read().strip()[:300]
            self.close()
            gone = "it exited" if ready else f"no answer within {_START_TIMEOUT_S:g} s"
            raise OSError(f"the working dir's holder could not cap {workdir}: {why or gone}")
        self.view = Path(f"/proc/{self._proc.pid}/root") / self.workdir.relative_to("/")

    def resize(self, size_bytes: int) -> None:
        """Set the cap (a run with its own `Limits.workdir_bytes`); below what the dir holds, the cap becomes what
        it holds (full: the run stops as a disk_limit), as workdir_fs.resize does."""
        if self._remount(size_bytes).returncode == 0:
            return
        st = os.statvfs(self.view)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        done = self._remount(max(used, st.f_frsize))
        if done.returncode != 0:
            raise OSError(f"remount {self.workdir} with size={size_bytes}: {done.stderr.strip()[:300]}")

    def _remount(self, size_bytes: int) -> subprocess.CompletedProcess:
        # the type and source named: `mount -o remount DIR` alone looks the mount up in a table and misses it here
        return subprocess.run([*self.enter_argv(), _util("mount"), "-t", "tmpfs", "-o",
                               f"remount,{_options(size_bytes)}", "tmpfs", str(self.workdir)],
                              capture_output=True, text=True, env={"PATH": _PATH}, timeout=_START_TIMEOUT_S)

    def enter_argv(self) -> list[str]:
        """The prefix that starts a command inside the holder's user and mount namespaces: `nsenter`, which the
        namespace's owner may run and which execs the command in place (same pid, inherited fds). Not a setns in
        the child between fork and exec: in a trainer some library's at-fork hook leaves that child with a second
        thread, and the kernel refuses a threaded process a user namespace (EINVAL). The uid stays the trainer's
        (0 inside the holder's namespace)."""
        return [_util("nsenter"), f"--target={self._proc.pid}", "--user", "--mount", "--preserve-credentials", "--"]

    def close(self) -> None:
        """End the holder: its namespace and the tmpfs (and every page in it) go with it."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            stream.close()


_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _options(size_bytes: int) -> str:
    """The tmpfs's mount options: the cap, a bounded inode count (workdir_fs's), the root of the holder's namespace
    (the trainer's own uid) as its owner."""
    return f"size={size_bytes},nr_inodes={MAX_INODES},mode=0700,uid=0,gid=0,nosuid,nodev"


def _util(name: str) -> str:
    """A util-linux program (every Linux distribution's base system); OSError naming it where it is missing."""
    found = shutil.which(name, path=_PATH)
    if found is None:
        raise OSError(errno.ENOENT, f"{name} (util-linux) not found: no working dir holder can be made")
    return found


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether this process can have a holder (tried once on a scratch dir, then closed): a non-root trainer's
    kernel cap. Root mounts on the host instead (workdir_fs.mount_allowed) and never needs one."""
    scratch = tempfile.mkdtemp(prefix="skyrl-holder-probe-")
    holder = None
    try:
        holder = WorkdirHolder(Path(scratch), 1 << 20)
        entered = subprocess.run([*holder.enter_argv(), "true"], capture_output=True, timeout=_START_TIMEOUT_S)
        return os.path.ismount(holder.view) and entered.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        if holder is not None:
            holder.close()
        os.rmdir(scratch)
