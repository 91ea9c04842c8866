"""How to build inference engines: one typed config shared by the vLLM and transformers backends."""

from __future__ import annotations

import math
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
    num_engines: int = 1  # engine replicas: a trajectory stays on one, a new one goes to the least loaded
    # float32 | bfloat16 | float16; on a CPU host without native bf16, bfloat16 runs as float32 (the log says so)
    dtype: str = "bfloat16"
    max_model_len: int = 4096  # tokens one sequence may hold (prompt + generation): the engine's context
    # the engines' sampling seed (engine i: seed + i) for requests without generator.sampling.seed
    seed: int = 0
    # vLLM knobs
    gpu_memory_utilization: float = 0.5  # GPU only: leaves room for the trainer on the same device
    enforce_eager: bool = True  # skip torch.compile / CUDA graphs: fast start, weights reload cleanly
    # CPU only: KV cache size in GiB, fractions allowed (vLLM's kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE only
    # takes whole GiB). SmolLM2-135M in bf16 keeps 23 KiB per token: 0.5 GiB holds ~23k tokens. None: a run sizes
    # it to what it keeps in flight, clamped to what the host accepts (resource_plan.py); an engine started on its own takes 1 GiB.
    cpu_kvcache_gib: float | None = None
    num_gpus_per_engine: float | None = None  # None -> 1 if CUDA is visible, else 0
    # CPU threads the engine computes with. Ray gives an actor that reserves no CPU one OpenMP thread, so
    # without this the engine decodes on one core of a multi-core box. None -> every core of the node.
    num_threads: int | None = None
    # CPU: return the idle KV cache's pages to the OS while the trainer updates (vLLM's sleep mode is CUDA-only;
    # on one box the update and the cache share RAM). It refills on the next rollout.
    release_kv_during_update: bool = True
    # GPU: vLLM's sleep mode through the update (level 1: KV cache freed, weights offloaded to host memory), so a
    # colocated trainer gets the GPU's memory; weights wake for the sync, the KV cache after it. Ignored on CPU.
    # Unverified on GPUs so far (no session with vLLM on a GPU): off by default.
    sleep_during_update: bool = False
    # LoRA served by version (trainer.lora.sync=adapter sets both): the largest adapter rank the engine accepts
    # (None: no LoRA in the engine) and how many adapters it keeps loaded at once (the staleness window + probe)
    max_lora_rank: int | None = None
    max_loras: int = 1  # adapters the engine keeps loaded at once (trainer.lora.sync=adapter)
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
        if self.cpu_kvcache_gib is not None and self.cpu_kvcache_gib <= 0:
            raise ValueError(f"EngineConfig.cpu_kvcache_gib must be > 0 (or null: sized to the run), "
                             f"got {self.cpu_kvcache_gib}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"EngineConfig.max_lora_rank must be >= 1 (or null: no LoRA), got {self.max_lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"EngineConfig.max_loras must be >= 1, got {self.max_loras}")
        if self.max_batch_size < 1:
            raise ValueError(f"EngineConfig.max_batch_size must be >= 1, got {self.max_batch_size}")

    def kv_cache_bytes(self) -> int:
        """The CPU KV cache in bytes: configured (or sized by the run), else 1 GiB for an engine on its own."""
        return int((self.cpu_kvcache_gib or 1.0) * (1 << 30))

    def threads(self) -> int:
        """The engine's thread budget on this node: the configured count, else every core."""
        return self.num_threads or os.cpu_count() or 1


def kv_bytes_per_token(hf_config, dtype: str) -> int:
    """K and V of every layer for one token: 2 x layers x kv heads x head dim x the engine dtype's size."""
    import torch

    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * heads * head_dim * getattr(torch, dtype).itemsize


def kv_cache_gib(tokens: int, hf_config, dtype: str) -> float:
    """GiB for `tokens` tokens of KV, rounded up to 1/16 GiB (vLLM then carves whole blocks out of it)."""
    return math.ceil(tokens * kv_bytes_per_token(hf_config, dtype) / (1 << 30) * 16) / 16


# The ranks vLLM's LoRA accepts (vllm.config.lora.MaxLoRARanks): its engine rounds a limit up to one of these.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_limits(cfg: EngineConfig, lora_rank: int, max_staleness: int) -> tuple[int, int]:
    """(max_lora_rank, max_loras) an engine needs to serve a policy's adapters by version
    (trainer.lora.sync=adapter): a rank limit of at least `lora_rank` (engine.max_lora_rank, default the adapter's
    own; vLLM's rounded up to a rank it accepts), and room for every version bounded staleness can still sample
    with (max_staleness + 1) plus the one the probe checks. A rank above the limit is refused, naming the keys."""
    limit = cfg.max_lora_rank if cfg.max_lora_rank is not None else lora_rank
    if cfg.backend == "vllm":
        accepted = [r for r in VLLM_LORA_RANKS if r >= limit]
        if not accepted:
            raise ValueError(f"trainer.lora.rank={lora_rank} (engine.max_lora_rank={limit}): vLLM serves LoRA "
                             f"ranks up to {VLLM_LORA_RANKS[-1]} only; use trainer.lora.sync=merged")
        limit = accepted[0]
    if lora_rank > limit:
        raise ValueError(f"trainer.lora.rank={lora_rank} is above the engine's LoRA rank limit "
                         f"engine.max_lora_rank={limit}: raise engine.max_lora_rank (or lower trainer.lora.rank)")
    return limit, max(cfg.max_loras, max_staleness + 2)
