"""Token-in/token-out inference engines: vLLM (Ray actor), transformers, a sticky pool, scripted (tests)."""

from __future__ import annotations

import dataclasses

from skyrl_stepwise.inference.base import GenerationResult, InferenceEngine, SamplingParams, validate_prompt
from skyrl_stepwise.inference.config import EngineConfig
from skyrl_stepwise.inference.hf_engine import HFEngine
from skyrl_stepwise.inference.pool import EnginePool
from skyrl_stepwise.inference.vllm_engine import VLLMEngine


def create_engine(cfg: EngineConfig, actor_options: list[dict] | None = None) -> InferenceEngine:
    """Build what the config asks for; several engines come back as one sticky-routing pool.

    Engine i gets seed `cfg.seed + i` so unseeded requests do not sample identically across engines, and
    `actor_options[i]` (its placement-group bundle and GPU share, see placement.py) when given.
    """
    if actor_options is not None:
        if cfg.backend != "vllm":
            raise ValueError("placement on GPUs places vLLM engine actors; engine.backend=transformers runs in the "
                             "driver process (use placement.mode=none)")
        engines = [VLLMEngine(dataclasses.replace(cfg, seed=cfg.seed + i, num_engines=1), actor_options[i])
                   for i in range(cfg.num_engines)]
        return engines[0] if len(engines) == 1 else EnginePool(engines)
    backend = VLLMEngine if cfg.backend == "vllm" else HFEngine
    engines = [backend(dataclasses.replace(cfg, seed=cfg.seed + i, num_engines=1)) for i in range(cfg.num_engines)]
    return engines[0] if len(engines) == 1 else EnginePool(engines)


__all__ = [
    "EngineConfig", "EnginePool", "GenerationResult", "HFEngine", "InferenceEngine", "SamplingParams",
    "VLLMEngine", "create_engine", "validate_prompt",
]
