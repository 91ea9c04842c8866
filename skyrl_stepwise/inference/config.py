"""How to build inference engines: one typed config shared by the vLLM and transformers backends."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

Backend = Literal["vllm", "transformers"]
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    """Everything needed to start engines; Hydra fills it from `conf/`, tests build it directly.

    dtype is explicit (not "auto") because vLLM's "auto" silently downcasts float32 checkpoints
    while transformers keeps them: both backends must run the same precision to agree.
    """

    backend: str = "vllm"  # vllm | transformers
    model_path: str | None = None  # None / "smollm2" -> the embedded SmolLM2, else a folder or hub id
    num_engines: int = 1
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    seed: int = 0
    # vLLM knobs
    gpu_memory_utilization: float = 0.5  # GPU only: leaves room for the trainer on the same device
    enforce_eager: bool = True  # skip torch.compile / CUDA graphs: fast start, weights reload cleanly
    # CPU only: KV cache size in GiB, fractions allowed (vLLM's kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE only
    # takes whole GiB). SmolLM2-135M in bf16 keeps 23 KiB per token: 0.5 GiB holds ~23k tokens.
    cpu_kvcache_gib: float = 1.0
    num_gpus_per_engine: float | None = None  # None -> 1 if CUDA is visible, else 0
    # CPU threads the engine computes with. Ray gives an actor that reserves no CPU one OpenMP thread, so
    # without this the engine decodes on one core of a multi-core box. None -> every core of the node.
    num_threads: int | None = None
    # CPU: return the idle KV cache's pages to the OS while the trainer updates (vLLM's sleep mode is CUDA-only;
    # on one box the update and the cache share RAM). It refills on the next rollout.
    release_kv_during_update: bool = True
    # transformers knobs
    max_batch_size: int = 32  # requests decoded together by one HFEngine forward
    batch_wait_s: float = 0.005  # how long the first request of a batch waits for company
    device: str | None = None  # None -> cuda if available, else cpu

    def __post_init__(self) -> None:
        if self.backend not in ("vllm", "transformers"):
            raise ValueError(f"EngineConfig.backend must be 'vllm' or 'transformers', got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_engines < 1:
            raise ValueError(f"EngineConfig.num_engines must be >= 1, got {self.num_engines}")
        if self.max_model_len < 1:
            raise ValueError(f"EngineConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1 (or null for every core), got {self.num_threads}")
        if self.cpu_kvcache_gib <= 0:
            raise ValueError(f"EngineConfig.cpu_kvcache_gib must be > 0, got {self.cpu_kvcache_gib}")
        if self.max_batch_size < 1:
            raise ValueError(f"EngineConfig.max_batch_size must be >= 1, got {self.max_batch_size}")

    def threads(self) -> int:
        """The engine's thread budget on this node: the configured count, else every core."""
        return self.num_threads or os.cpu_count() or 1
