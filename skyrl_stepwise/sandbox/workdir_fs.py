"""A working dir whose size the kernel caps: a tmpfs of `Limits.workdir_bytes` (and a bounded inode count) mounted on
the host at the sandbox's working dir, where the trainer may mount (root, or CAP_SYS_ADMIN in the initial user
namespace).

Why: a host directory has no total-size limit, so the cap was a watchdog's poll, and a poll is soft. A trainer busy in
other threads, or a faster host, let a fill loop write 100-200 MiB past a 16 MiB cap, and an unlinked file still held
open was never counted. A size-capped tmpfs refuses the write (ENOSPC) at the cap and counts every page, open-unlinked
ones included. Files stay where the host side (the file API, graders, the copy-back) reads them. The mount's root
also hides the host path: `/proc/self/mountinfo` inside shows `/ /work ... tmpfs`, not `/tmp/skyrl-sandbox-.../work`.
Where no mount is allowed (a non-root trainer on a laptop), the dir is a plain one and the watchdog (disk_watch.py) is
the cap, which the start-up line and docs/sandbox.md say. The watchdog stays as a second line everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
from pathlib import Path

_MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 0x2, 0x4, 0x20
_MNT_DETACH = 2
MAX_INODES = 100_000  # as tree_size's entry cap: an inode-filling loop meets ENOSPC too


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _options(size_bytes: int, owner: tuple[int, int] | None) -> bytes:
    uid, gid = owner if owner is not None else (os.geteuid(), os.getegid())
    return f"size={size_bytes},nr_inodes={MAX_INODES},mode=0700,uid={uid},gid={gid}".encode()


def mount_capped(workdir: Path, size_bytes: int, owner: tuple[int, int] | None) -> bool:
    """Mount a tmpfs of `size_bytes` at the (empty) `workdir`, owned by `owner` (the sandbox's uid/gid) or by us;
    False where this process may not mount (the caller keeps the plain dir)."""
    if not mount_allowed():
        return False
    return _libc().mount(b"tmpfs", os.fsencode(str(workdir)), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                         _options(size_bytes, owner)) == 0


def resize(workdir: Path, size_bytes: int, owner: tuple[int, int] | None) -> None:
    """Set the mounted working dir's cap (a run with its own `Limits.workdir_bytes`). Below what the dir already
    holds the kernel refuses: the cap is then what it holds, so the dir is full and the run stops as a disk_limit."""
    if _remount(workdir, size_bytes, owner) == 0:
        return
    st = os.statvfs(workdir)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    if _remount(workdir, max(used, st.f_frsize), owner) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"remount {workdir} with size={size_bytes}: {os.strerror(err)}")


def _remount(workdir: Path, size_bytes: int, owner: tuple[int, int] | None) -> int:
    return _libc().mount(b"tmpfs", os.fsencode(str(workdir)), b"tmpfs", _MS_REMOUNT | _MS_NOSUID | _MS_NODEV,
                         _options(size_bytes, owner))


def unmount(workdir: Path) -> None:
    """Detach the working dir's tmpfs (its pages are freed once nothing holds them); nothing if none is mounted."""
    if os.path.ismount(workdir):
        _libc().umount2(os.fsencode(str(workdir)), _MNT_DETACH)


def is_full(workdir: Path) -> bool:
    """Whether the working dir is a mount with no block or no inode left (the kernel's cap was reached: a write or
    a create now fails with ENOSPC, so the run is stopped as a disk_limit, not left looping on errors)."""
    try:
        if not os.path.ismount(workdir):
            return False
        st = os.statvfs(workdir)
    except OSError:
        return False
    return st.f_bavail == 0 or st.f_favail == 0


@functools.lru_cache(maxsize=1)
def mount_allowed() -> bool:
    """Whether this process can mount a tmpfs (tried once on a scratch dir, then undone)."""
    scratch = tempfile.mkdtemp(prefix="skyrl-mount-probe-")
    try:
        libc = _libc()
        if libc.mount(b"tmpfs", os.fsencode(scratch), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=4096") != 0:
            return False
        libc.umount2(os.fsencode(scratch), _MNT_DETACH)
        return True
    finally:
        os.rmdir(scratch)
