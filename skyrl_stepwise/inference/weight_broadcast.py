"""Weights from the trainer's rank 0 straight into every engine worker: a torch.distributed broadcast.

The carrier for engines the trainer cannot hand a file to (another node, or a run that asks for it): rank 0
and each engine worker form their own small process group (gloo on CPU, NCCL on GPU), apart from the
trainer's FSDP group and vLLM's own, and rank 0 broadcasts the weights in buckets of the engines' dtype. The
driver only passes the manifest (names, shapes, dtype, bucket boundaries: a few KB) and the group's address.

A bucket is one flat byte buffer holding whole tensors, so one broadcast moves many small tensors and the
receiver rebuilds each as a view; a tensor larger than the bucket size gets a bucket of its own. NCCL refuses
two ranks on one GPU, so colocated engines get their weights from the shared-memory file (weights.py) instead.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
_STORE_PREFIX = "skyrl_stepwise/weights"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a bucket, as the receiver must rebuild it (dtype is torch's name: "bfloat16")."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * getattr(torch, self.dtype).itemsize


def plan_buckets(named_shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: str,
                 bucket_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (a bigger tensor travels alone).

    Order matters: the sender walks the state dict in the same order, and vLLM rebuilds a fused layer once
    all of its pieces have arrived, wherever the bucket boundaries fall.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[TensorSpec]] = [[]]
    filled = 0
    for name, shape in named_shapes:
        spec = TensorSpec(name, tuple(int(s) for s in shape), dtype)
        if buckets[-1] and filled + spec.nbytes > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(spec)
        filled += spec.nbytes
    return [b for b in buckets if b]


def manifest_to_wire(buckets: list[list[TensorSpec]]) -> list[list[list]]:
    """Plain lists (vLLM's collective_rpc msgpack-encodes its arguments without type info)."""
    return [[[s.name, list(s.shape), s.dtype] for s in bucket] for bucket in buckets]


def manifest_from_wire(wire: list[list[list]]) -> list[list[TensorSpec]]:
    """Inverse of `manifest_to_wire`."""
    return [[TensorSpec(str(name), tuple(int(x) for x in shape), str(dtype)) for name, shape, dtype in bucket]
            for bucket in wire]


def node_ip() -> str:
    """The address other nodes reach this process at (Ray's view of the node), else loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def open_store(host: str, world_size: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Rank 0's rendezvous store on a free port, open before the members join (they need its port)."""
    store = dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, store.port


class WeightBroadcastGroup:
    """A process group of rank 0 (the trainer) and the engine workers (ranks 1..N), outside any default group.

    Built from the backend classes directly, so neither the trainer's FSDP group nor vLLM's parallel state is
    touched; constructing it blocks until every member has joined (or `timeout_s` passes).
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                 store: dist.TCPStore | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"weight broadcast backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight broadcast rank {rank} is outside a group of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        self.store = store  # rank 0 keeps the server alive as long as the group
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        if backend == "gloo":
            from torch.distributed.distributed_c10d import ProcessGroupGloo

            self.backend = ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")
        else:
            from torch.distributed.distributed_c10d import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.backend = ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world_size = rank, world_size

    def _broadcast(self, buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.backend.broadcast([buffer], options).wait()

    def send(self, buckets: list[list[TensorSpec]], tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: cast each tensor to the manifest's dtype, pack it into its bucket, broadcast each bucket as it
        fills; returns the bytes sent. `tensors` must yield exactly the manifest's names, in its order."""
        stream = iter(tensors)
        sent = 0
        for bucket in buckets:
            buffer = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8, device=self.device)
            offset = 0
            for spec in bucket:
                name, tensor = next(stream, (None, None))
                if name != spec.name or tuple(tensor.shape) != spec.shape:
                    got = None if name is None else (name, tuple(tensor.shape))
                    raise ValueError(f"weight broadcast: expected {spec.name} {spec.shape}, got {got}")
                flat = tensor.detach().to(self.device, getattr(torch, spec.dtype)).contiguous().view(-1)
                buffer[offset:offset + spec.nbytes].copy_(flat.view(torch.uint8))
                offset += spec.nbytes
            self._broadcast(buffer)
            sent += buffer.numel()
        leftover = next(stream, None)
        if leftover is not None:
            raise ValueError(f"weight broadcast: tensor {leftover[0]!r} is not in the manifest")
        return sent

    def receive(self, buckets: list[list[TensorSpec]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks 1..N: yield (name, tensor) bucket by bucket; a bucket is received when its first tensor is
        asked for, so a consumer that loads as it goes holds one bucket at a time."""
        for bucket in buckets:
            buffer = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8, device=self.device)
            self._broadcast(buffer)
            offset = 0
            for spec in bucket:
                raw = buffer[offset:offset + spec.nbytes]
                yield spec.name, raw.view(getattr(torch, spec.dtype)).view(spec.shape)
                offset += spec.nbytes

    def close(self) -> None:
        """Leave the group (the next sync builds a new one)."""
        shutdown = getattr(self.backend, "shutdown", None)
        if shutdown is not None:
            shutdown()
