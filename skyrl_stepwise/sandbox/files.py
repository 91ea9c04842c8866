"""Host-side file access to a sandbox's working directory, confined to it.

The working directory was written by sandboxed code, so every name in it is untrusted: a path given by the model
may be absolute or climb with `..`, and a file may be a symlink planted to point at a host file. These helpers
resolve a path fully and refuse anything outside the directory; copying files in or out never follows a symlink.
No sandboxed process runs between two runs (each run's PID namespace dies with it), so a path checked here cannot
be swapped underneath us.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

from skyrl_stepwise.sandbox.base import SandboxPathError
from skyrl_stepwise.sandbox.workdir_fs import is_full

LOCK_MARGIN_S = 30.0  # past a run's wall clock: its reap (5 s), namespace teardown (5 s), the watchdog's answer (5 s)


class SandboxBusy(SandboxPathError):
    """The sandbox's lock could not be had in time (a run holds it): a tool error for the model, never a hang."""


def confined_path(workdir: Path, path: str) -> Path:
    """`path` (relative to the working dir; a leading `/work/` is accepted as the in-sandbox name) resolved on the
    host, symlinks followed, and checked to stay inside `workdir`."""
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        raise SandboxPathError(f"invalid path {path!r}: give a file name relative to the working directory")
    rel = path[len("/work/"):] if path.startswith("/work/") else path
    if os.path.isabs(rel):
        raise SandboxPathError(f"path {path!r} is outside the working directory: use a relative path")
    inside = _resolve_inside(str(workdir), rel, path)
    if inside is None:
        raise SandboxPathError(f"path {path!r} leaves the working directory (resolves outside it)")
    return Path(workdir, *inside)


_MAX_LINKS = 40  # as the kernel's own limit on the symlinks one lookup follows (ELOOP)


def _resolve_inside(root: str, rel: str, path: str) -> list[str] | None:
    """The components of `rel` under `root` with every symlink in it followed, or None where it leaves `root` (a
    `..` above it, an absolute link); SandboxPathError (naming `path`) past _MAX_LINKS links, a loop. The root itself is never resolved: a non-root trainer's working dir is seen
    through `/proc/<holder>/root/...` (workdir_holder.py), a link that os.path.realpath would turn into the empty
    host dir, so realpath would check (and open) the wrong tree."""
    parts, resolved, links = rel.split("/"), [], 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            if not resolved:
                return None
            resolved.pop()
            continue
        try:
            target = os.readlink(os.path.join(root, *resolved, name))
        except OSError:  # not a link (or not there yet: a file about to be written)
            resolved.append(name)
            continue
        links += 1
        if links > _MAX_LINKS:
            raise SandboxPathError(f"path {path!r} goes through more than {_MAX_LINKS} symbolic links (a loop)")
        if os.path.isabs(target):
            return None
        parts = target.split("/") + parts
    return resolved


_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_regular(target: Path, path: str, flags: int, mode: int = 0o644) -> int:
    """Open a working-dir file by fd, never blocking and never through a final symlink, and refuse what is not a
    regular file. A FIFO opened with a blocking open() waits for a writer forever, holding the sandbox's lock (the
    issue's `edit` + `rm f && mkfifo f`); a device or socket is no file the model's tools should touch."""
    try:
        fd = os.open(target, flags | _OPEN_FLAGS, mode)
    except FileNotFoundError:
        raise SandboxPathError(f"no file {path!r} in the working directory") from None
    except IsADirectoryError:
        raise SandboxPathError(f"path {path!r} is a directory") from None
    except OSError as e:  # ELOOP (a symlink swapped in), ENXIO (a socket, or a FIFO with no reader)...
        raise SandboxPathError(f"path {path!r} is not a regular file ({os.strerror(e.errno)})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise SandboxPathError(f"path {path!r} is {kind}")
    os.set_blocking(fd, True)
    return fd


def read_confined(workdir: Path, path: str, max_bytes: int) -> str:
    """A working-dir file's text, at most `max_bytes` (a note says when it was cut); regular files only."""
    target = confined_path(workdir, path)
    with os.fdopen(_open_regular(target, path, os.O_RDONLY), "rb") as handle:
        data = handle.read(max_bytes + 1)
    text = data[:max_bytes].decode("utf-8", errors="replace")
    return text + (f"\n[... truncated at {max_bytes} bytes]" if len(data) > max_bytes else "")


def write_confined(workdir: Path, path: str, content: str | bytes, owner: tuple[int, int] | None) -> Path:
    """Write a working-dir file (parents created), owned by the sandbox's user where it runs as its own uid; an
    existing file must be a regular one (it is truncated only once that is checked)."""
    target = confined_path(workdir, path)
    if target.is_dir():
        raise SandboxPathError(f"path {path!r} is a directory")
    root = Path(workdir)
    made = [p for p in reversed(target.parents) if root in p.parents and not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    fd = _open_regular(target, path, os.O_WRONLY | os.O_CREAT)
    with os.fdopen(fd, "wb") as handle:
        handle.truncate(0)
        handle.write(data)
    if owner is not None:
        for p in [*made, target]:
            os.lchown(p, *owner)
    return target


def copy_in(source: Path, workdir: Path) -> None:
    """Copy a task's files into the (empty) working dir: symlinks copied as links, never followed."""
    for entry in Path(source).iterdir():
        dest = workdir / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dest)
        elif entry.is_dir():
            shutil.copytree(entry, dest, symlinks=True)
        else:
            shutil.copy2(entry, dest, follow_symlinks=False)


def export_files(workdir: Path, dest: Path, max_bytes: int) -> list[str]:
    """Copy the working dir's regular files to `dest` (the copy-back after a trajectory): a symlink, wherever it
    points, is skipped and so is anything past `max_bytes` in total. Returns the relative paths copied."""
    copied: list[str] = []
    total = 0
    root = Path(workdir)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not (here / d).is_symlink()]
        for name in sorted(filenames):
            src = here / name
            st = os.lstat(src)
            if not _is_regular(st.st_mode) or total + st.st_size > max_bytes:
                continue
            rel = src.relative_to(root)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = _open_regular(src, str(rel), os.O_RDONLY)
            except SandboxPathError:
                continue
            with os.fdopen(fd, "rb") as fin, open(dest / rel, "wb") as fout:
                shutil.copyfileobj(fin, fout)
            total += st.st_size
            copied.append(str(rel))
    return copied


_FLATTEN_DEPTH = 32  # deeper dirs are moved up to the top before they are emptied: bounded fds, no recursion
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: Path) -> None:
    """Remove `path` and everything under it, whatever the depth and the modes the sandboxed code left. Iterative
    and by dir fd (never a path longer than one name, never a symlink followed); a dir is given u+rwx before it is
    opened (a `chmod 000` dir, which shutil.rmtree skips for a non-root trainer); a dir deeper than _FLATTEN_DEPTH
    is renamed to the top (same file system) and emptied from there, so a 1,500-level tree needs 32 fds, not a
    RecursionError. OSError where something could not be removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    os.chmod(path, 0o700)
    top = os.open(path, _DIR_FLAGS)
    try:
        _empty_dir(top)
    finally:
        os.close(top)
    os.rmdir(path)


def _empty_dir(top: int) -> None:
    """Delete everything in the directory open at `top` (see remove_tree)."""
    stack: list[tuple[int, str]] = [(top, "")]
    moved = 0
    try:
        while stack:
            fd = stack[-1][0]
            sub = _unlink_all_but_a_dir(fd)
            if sub is None:
                if len(stack) == 1:
                    return
                done, name = stack.pop()
                os.close(done)
                os.rmdir(name, dir_fd=stack[-1][0])
                continue
            os.chmod(sub, 0o700, dir_fd=fd)
            if len(stack) >= _FLATTEN_DEPTH:
                moved += 1
                try:
                    os.rename(sub, f".flat-{moved}", src_dir_fd=fd, dst_dir_fd=top)
                except OSError:  # that name is taken by a non-empty dir or a file: the next number
                    continue
                continue
            stack.append((os.open(sub, _DIR_FLAGS, dir_fd=fd), sub))
    finally:
        for fd, _ in stack[1:]:
            os.close(fd)


def _unlink_all_but_a_dir(fd: int) -> str | None:
    """Unlink every non-directory in the dir open at `fd`; the name of one subdirectory left, or None."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
            os.unlink(entry.name, dir_fd=fd)
    return None


def over_cap(workdir: Path, cap_bytes: int) -> bool:
    """Whether a run's working dir passed its cap: a kernel-capped dir that is full (workdir_fs: the write that
    reached the cap failed with ENOSPC), or a plain dir whose files add up to more than `cap_bytes`."""
    return is_full(workdir) or tree_size(workdir) > cap_bytes


def tree_size(root: Path, max_entries: int = 100_000) -> int:
    """Bytes used by a directory tree (no symlink followed); a tree with more than `max_entries` entries counts as
    infinitely large, so an inode-filling attack is caught as cheaply as a byte-filling one."""
    total = 0
    entries = 0
    stack = [str(root)]
    opened: set[str] = set()
    while stack:
        path = stack.pop()
        try:
            with os.scandir(path) as it:
                for entry in it:
                    entries += 1
                    if entries > max_entries:
                        return 1 << 62
                    st = entry.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except PermissionError:  # a `chmod 000` dir of the sandbox (a non-root trainer owns it): open it, count it
            if path in opened or not _open_up(path):
                return 1 << 62  # a dir that cannot be counted counts as over any cap
            opened.add(path)
            stack.append(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total


def _open_up(path: str) -> bool:
    """Give a dir the scan could not read u+rwx (by an O_PATH fd: a symlink swapped in is never followed); False
    where that is refused."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(os.fstat(fd).st_mode) | 0o700)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_regular(mode: int) -> bool:
    return stat.S_ISREG(mode)


class HostWorkdir:
    """What every backend does on the host side of a sandbox: read, write and export its working dir, confined to
    it and never beside a run (under the sandbox's lock), counting refused paths, and close once. A backend sets
    `workdir`, `metrics`, `_lock`, `_closed`, `_finalizer` (kills its processes, removes the dir) and `_owner` (the
    uid/gid a written file gets, or None)."""

    def read_file(self, path: str, max_bytes: int = 64 << 10) -> str:
        """A working-dir file's text (path relative to /work); SandboxPathError outside it or not a regular file."""
        try:
            with self._locked():
                return read_confined(self.workdir, path, max_bytes)
        except SandboxBusy:
            raise
        except ValueError:
            self.metrics.count("path_refusals")
            raise

    def write_file(self, path: str, content: str | bytes) -> None:
        """Write a working-dir file (path relative to /work); SandboxPathError outside it or not a regular file."""
        try:
            with self._locked():
                write_confined(self.workdir, path, content, self._owner)
        except SandboxBusy:
            raise
        except ValueError:
            self.metrics.count("path_refusals")
            raise

    def export(self, dest: Path, max_bytes: int = 64 << 20) -> list[str]:
        """Copy the working dir's regular files out (symlinks skipped, never followed)."""
        with self._locked():
            return export_files(self.workdir, Path(dest), max_bytes)

    @contextlib.contextmanager
    def _locked(self):
        """The sandbox's lock, waited for no longer than a run can hold it (its wall clock, plus the reap and the
        watchdog's answer): a tool call gets SandboxBusy instead of hanging its rollout. File access itself never
        blocks (non-blocking opens, regular files only), so it holds the lock for milliseconds."""
        limits = getattr(self, "limits", None)
        timeout = (limits.wall_s if limits is not None else 10.0) + LOCK_MARGIN_S
        if not self._lock.acquire(timeout=timeout):
            raise SandboxBusy(f"the working directory stayed busy for {timeout:.0f} s (a command still running); "
                              "try again")
        try:
            yield
        finally:
            self._lock.release()

    def close(self) -> None:
        """Kill every process of the sandbox and remove its working dir; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self.metrics.count("closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
