"""A LoRA adapter as bytes (trainer.lora.sync=adapter): what travels from policy rank 0 to every engine, and the
engine's own folder it is written to before vLLM's LoRARequest or peft's load_adapter read it.

The adapter (peft's `adapter_config.json` + `adapter_model.safetensors`, megabytes) moves through Ray as a method
argument, never as a path: an engine on another node, or in another container, cannot read a folder the driver or
the policy wrote. Each engine writes the bytes into a folder of its own on its own node (its /dev/shm when there is
one, else the temp dir), keeps it while that version is loaded (vLLM reads the path again if it evicts and reloads an
adapter) and removes it when the version is unloaded, and every one left at shutdown. One path for local and remote
engines.

An engine killed outright (SIGKILL, the OOM killer, its trainer's lifeline) removes nothing, and /dev/shm is memory.
So each folder's name carries its owner (pid namespace, pid and start time: host/lifeline.py's ProcessIdentity), and
every engine that starts on a node removes the folders whose owner no longer runs there.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from skyrl_stepwise.host.lifeline import ProcessIdentity, process_identity
from skyrl_stepwise.inference.weights import shared_memory_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_MODEL = "adapter_model.safetensors"
ADAPTER_FILE_NAMES = (ADAPTER_CONFIG, ADAPTER_MODEL)  # what peft's save_pretrained writes and vLLM/peft read
FOLDER_PREFIX = "skyrl_stepwise_adapter_"  # + <owner tag>_<8 hex>_v<version>


@dataclass(frozen=True)
class AdapterFiles:
    """One policy version's adapter as the bytes of peft's two files: picklable, so Ray carries it to an actor on
    any node (the object store for anything above its inline limit)."""

    files: dict[str, bytes]

    def __post_init__(self) -> None:
        """Only peft's two file names, plain names (no path: a name must never write outside the engine's folder)."""
        if set(self.files) != set(ADAPTER_FILE_NAMES):
            raise ValueError(f"an adapter is exactly {list(ADAPTER_FILE_NAMES)}, got {sorted(self.files)}")

    @property
    def nbytes(self) -> int:
        """Bytes that travel per engine."""
        return sum(len(b) for b in self.files.values())

    @classmethod
    def read(cls, folder: str | Path) -> "AdapterFiles":
        """The bytes of a peft adapter folder (what policy rank 0 wrote into its own temp folder)."""
        return cls({name: (Path(folder) / name).read_bytes() for name in ADAPTER_FILE_NAMES})

    def write(self, folder: str | Path) -> Path:
        """Write the files into `folder` (created); each under a temporary name first, then renamed, so a reader
        never sees half a file."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            tmp = folder / f"{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, folder / name)
        return folder


class AdapterFolders:
    """An engine's own adapter folders, one per loaded policy version, on the engine's node: written from the bytes
    the sync sends, removed when the version is unloaded, and all of them at shutdown."""

    def __init__(self, root: str | Path | None = None) -> None:
        """`root`: where the folders go (default: this node's /dev/shm, else the temp dir). Folders left there by
        owners that died are removed first."""
        self.root = Path(root) if root is not None else shared_memory_dir()
        # the owner, and a name of its own: several engines (or runs) on one node never share a folder
        owner = process_identity()  # None off Linux: then no folder names an owner, and none is ever swept
        self.tag = f"{owner.tag if owner else 'unowned'}_{uuid.uuid4().hex[:8]}"
        self.folders: dict[int, Path] = {}
        remove_orphaned_folders(self.root)

    def write(self, version: int, adapter: AdapterFiles) -> Path:
        """Version `version`'s folder with the adapter's files in it; returns its path."""
        folder = self.root / f"{FOLDER_PREFIX}{self.tag}_v{int(version)}"
        self.folders[int(version)] = adapter.write(folder)
        return folder

    def remove(self, version: int) -> None:
        """The folder of an unloaded version (nothing if it has none)."""
        folder = self.folders.pop(int(version), None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def remove_all(self) -> None:
        """Every folder still held (the engine shuts down, or its adapters were dropped)."""
        for version in list(self.folders):
            self.remove(version)


def remove_orphaned_folders(root: str | Path) -> list[Path]:
    """Remove the adapter folders under `root` whose owning process no longer runs; returns them. A folder whose
    name names no owner (written before owners were named) or an owner in another pid namespace is left alone."""
    removed = []
    for folder in Path(root).glob(f"{FOLDER_PREFIX}*"):
        owner = ProcessIdentity.from_tag(folder.name[len(FOLDER_PREFIX):].split("_")[0])
        if owner is not None and not owner.is_alive():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def as_adapter_files(adapter: "AdapterFiles | str | Path") -> AdapterFiles:
    """The adapter's bytes; a folder path is read here, in the caller's process (whose node can see it), so only
    bytes ever reach an engine."""
    return adapter if isinstance(adapter, AdapterFiles) else AdapterFiles.read(adapter)
