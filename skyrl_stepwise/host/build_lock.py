"""One process at a time builds a shared cache entry (a converted model, the embedded data, a retrieval index).

Why: every process that started on an empty cache (two test workers, a retriever beside a trainer) built the same
entry at once, each paying its minutes of CPU. The lock file lives in the system's temp dir, named by the entry's
path, so the cache folders hold nothing but their entries (a lock file beside them read as a leftover)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from filelock import FileLock


def build_lock(target: Path) -> FileLock:
    """A lock for building `target`: the holder builds, the others wait, then find it built."""
    key = hashlib.sha256(str(Path(target).expanduser().resolve()).encode()).hexdigest()[:24]
    folder = Path(tempfile.gettempdir()) / "skyrl_stepwise-build-locks"
    try:
        folder.mkdir()
        folder.chmod(0o1777)  # like /tmp: every user of a shared machine can lock in it
    except FileExistsError:
        pass
    return FileLock(folder / f"{key}.lock")
