"""Host-side file access to a sandbox's working directory, confined to it.

The working directory was written by sandboxed code, so every name in it is untrusted: a path given by the model
may be absolute or climb with `..`, and a file may be a symlink planted to point at a host file. These helpers
resolve a path fully and refuse anything outside the directory; copying files in or out never follows a symlink.
No sandboxed process runs between two runs (each run's PID namespace dies with it), so a path checked here cannot
be swapped underneath us.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from skyrl_stepwise.sandbox.base import SandboxPathError


def confined_path(workdir: Path, path: str) -> Path:
    """`path` (relative to the working dir; a leading `/work/` is accepted as the in-sandbox name) resolved on the
    host, symlinks followed, and checked to stay inside `workdir`."""
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        raise SandboxPathError(f"invalid path {path!r}: give a file name relative to the working directory")
    rel = path[len("/work/"):] if path.startswith("/work/") else path
    if os.path.isabs(rel):
        raise SandboxPathError(f"path {path!r} is outside the working directory: use a relative path")
    root = Path(os.path.realpath(workdir))
    target = Path(os.path.realpath(root / rel))
    if target != root and root not in target.parents:
        raise SandboxPathError(f"path {path!r} leaves the working directory (resolves outside it)")
    return target


def read_confined(workdir: Path, path: str, max_bytes: int) -> str:
    """A working-dir file's text, at most `max_bytes` (a note says when it was cut)."""
    target = confined_path(workdir, path)
    if not target.is_file():
        raise SandboxPathError(f"no file {path!r} in the working directory")
    with open(target, "rb") as handle:
        data = handle.read(max_bytes + 1)
    text = data[:max_bytes].decode("utf-8", errors="replace")
    return text + (f"\n[... truncated at {max_bytes} bytes]" if len(data) > max_bytes else "")


def write_confined(workdir: Path, path: str, content: str | bytes, owner: tuple[int, int] | None) -> Path:
    """Write a working-dir file (parents created), owned by the sandbox's user where it runs as its own uid."""
    target = confined_path(workdir, path)
    if target.is_dir():
        raise SandboxPathError(f"path {path!r} is a directory")
    root = Path(os.path.realpath(workdir))
    made = [p for p in reversed(target.parents) if root in p.parents and not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as handle:
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
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as fin, open(dest / rel, "wb") as fout:
                shutil.copyfileobj(fin, fout)
            total += st.st_size
            copied.append(str(rel))
    return copied


def tree_size(root: Path, max_entries: int = 100_000) -> int:
    """Bytes used by a directory tree (no symlink followed); a tree with more than `max_entries` entries counts as
    infinitely large, so an inode-filling attack is caught as cheaply as a byte-filling one."""
    total = 0
    entries = 0
    stack = [str(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    if entries > max_entries:
                        return 1 << 62
                    st = entry.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
    return total


def _is_regular(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)


class HostWorkdir:
    """What every backend does on the host side of a sandbox: read, write and export its working dir, confined to
    it and never beside a run (under the sandbox's lock), counting refused paths, and close once. A backend sets
    `workdir`, `metrics`, `_lock`, `_closed`, `_finalizer` (kills its processes, removes the dir) and `_owner` (the
    uid/gid a written file gets, or None)."""

    def read_file(self, path: str, max_bytes: int = 64 << 10) -> str:
        """A working-dir file's text (path relative to /work); SandboxPathError outside it."""
        try:
            with self._lock:
                return read_confined(self.workdir, path, max_bytes)
        except ValueError:
            self.metrics.count("path_refusals")
            raise

    def write_file(self, path: str, content: str | bytes) -> None:
        """Write a working-dir file (path relative to /work); SandboxPathError outside it."""
        try:
            with self._lock:
                write_confined(self.workdir, path, content, self._owner)
        except ValueError:
            self.metrics.count("path_refusals")
            raise

    def export(self, dest: Path, max_bytes: int = 64 << 20) -> list[str]:
        """Copy the working dir's regular files out (symlinks skipped, never followed)."""
        with self._lock:
            return export_files(self.workdir, Path(dest), max_bytes)

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
