"""How updated weights travel from the trainer to the engines: safetensors in the engine's dtype.

Two carriers. On the same node (every run on one machine), the trainer's rank 0 writes one file in shared
memory (`/dev/shm`) and each engine maps it: the weights never pass through the driver, and the bytes are the
engine's dtype (bf16: half of the fp32 master weights). Across nodes the same tensors go as safetensors bytes.
safetensors keeps names, dtypes and shapes without pickle, and vLLM's msgpack RPC passes bytes and paths intact.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch


def engine_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """CPU, contiguous, in the engine's dtype; tied tensors (shared storage) cloned since safetensors refuses
    aliases; a name given twice is an error (the second would silently win)."""
    tensors, seen = {}, set()
    for name, tensor in named_tensors:
        if name in tensors:
            raise ValueError(f"update_weights: parameter {name!r} given twice")
        tensor = tensor.detach().to("cpu", dtype).contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        tensors[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return tensors


def pack_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> bytes:
    """Safetensors bytes (the cross-node carrier)."""
    from safetensors.torch import save

    return save(engine_tensors(named_tensors, dtype))


class WrittenInPlace(Protocol):
    """A tensor the weights file computes straight into its own bytes instead of holding it first: a LoRA layer's
    W + scaling * B @ A (policy/lora.LowRankSum). Merging into a tensor of its own and then copying it into the file
    was a second pass over every adapted weight, and the reason LoRA's export was slower than full's."""

    shape: torch.Size
    dtype: torch.dtype

    def write_into(self, out: torch.Tensor) -> None: ...


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_weights_file(named_tensors: Iterable[tuple[str, torch.Tensor | WrittenInPlace]], dtype: torch.dtype,
                       path: str | Path) -> int:
    """Write a safetensors file in `dtype` atomically (a reader never sees half a file); returns its size in bytes.

    Each tensor goes to the file from its own memory, or (a dtype cast, a `WrittenInPlace` value) from one reused
    buffer it is computed into: no tensor-sized allocation per entry (a thread writing one buffer while the next is
    merged measured no faster on 2 cores). safetensors' own writer first copies every tensor into a bytes object,
    and the caller's dtype cast was one more copy: both gone. The file is what safetensors reads (an 8-byte
    header length, the JSON header padded with spaces to 8 bytes, then the data in header order, contiguous); tied
    tensors are written twice (safetensors refuses aliases); a name given twice is an error."""
    path = Path(path)
    entries: dict[str, torch.Tensor | WrittenInPlace] = {}
    for name, value in named_tensors:
        if name in entries:
            raise ValueError(f"update_weights: parameter {name!r} given twice")
        entries[name] = value
    size = torch.empty(0, dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, value in entries.items():
        nbytes = math.prod(value.shape) * size
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    start = 8 + len(encoded)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two writers on one host (a simulated cluster) never mix
    scratch = torch.empty(0, dtype=dtype)  # one buffer, grown to the largest tensor that needs a cast or a merge
    try:
        with open(tmp, "wb") as file, torch.no_grad():
            file.write(struct.pack("<Q", len(encoded)) + encoded)
            for value in entries.values():
                if isinstance(value, torch.Tensor) and value.dtype == dtype and value.device.type == "cpu" \
                        and value.is_contiguous():
                    data = value.detach()
                else:
                    numel = math.prod(value.shape)
                    if scratch.numel() < numel:
                        scratch = torch.empty(numel, dtype=dtype)
                    data = scratch[:numel].view(tuple(value.shape))
                    if isinstance(value, torch.Tensor):
                        data.copy_(value.detach())
                    else:
                        value.write_into(data)
                file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def weights_target(path: str | Path, nbytes: int, fallback_dir: str | Path | None = None) -> tuple[Path, str | None]:
    """Where an update of `nbytes` goes: `path` when its filesystem has room for it (and the .tmp written first,
    so a small margin), else the same name in `fallback_dir` (default: the disk-backed temp dir), with a warning
    naming both sizes. Docker's default /dev/shm is 64 MiB: a 135M-parameter model in bf16 is ~270 MB, and a
    full /dev/shm would fail the write mid-run or starve every process that maps shared memory."""
    import shutil

    path = Path(path)
    free = shutil.disk_usage(path.parent).free
    if free >= nbytes * 1.02 + (1 << 20):
        return path, None
    target = Path(fallback_dir or tempfile.gettempdir()) / path.name
    return target, (f"weight sync: {path.parent} has {free / 2**20:.0f} MiB free but an update is "
                    f"{nbytes / 2**20:.0f} MiB; writing it to {target.parent} instead (slower; give the container "
                    f"more shared memory, e.g. `docker run --shm-size=2g`)")


def load_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, named as the trainer's HF state dict names them."""
    from safetensors.torch import load_file

    return load_file(str(path))


def current_node_id() -> str:
    """The Ray node this process runs on (the hostname without Ray): a file written here is readable here."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    import socket

    return socket.gethostname()


def shared_memory_dir() -> Path:
    """RAM-backed where the OS has it (Linux /dev/shm), else the temp dir: the file is read once, right away."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@contextlib.contextmanager
def weights_file() -> Iterator[Path]:
    """A fresh path for one update's weights, removed afterwards, also when the update fails."""
    path = shared_memory_dir() / f"skyrl_stepwise_weights_{uuid.uuid4().hex}.safetensors"
    try:
        yield path
    finally:
        for stale in (path, *path.parent.glob(path.name + ".*.tmp")):
            stale.unlink(missing_ok=True)
