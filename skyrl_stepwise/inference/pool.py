"""Several engines behind one InferenceEngine: a trajectory's turns stay on one engine.

Sticky sessions keep a multi-turn prompt's growing prefix in one engine's prefix cache; new
sessions go to the engine with the fewest requests in flight (then the fewest sessions).
"""

from __future__ import annotations

import asyncio
from typing import Iterable, Sequence

import torch

from skyrl_stepwise.inference.base import GenerationResult, InferenceEngine, SamplingParams


class EnginePool:
    """Routes by session_id; `result.meta["engine_index"]` says which engine answered."""

    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.inflight = [0] * len(self.engines)
        self.session_counts = [0] * len(self.engines)
        self.sessions: dict[str, int] = {}

    def route(self, session_id: str | None) -> int:
        """Same session -> same engine; otherwise the least-loaded engine (recorded for the session)."""
        if session_id is not None and session_id in self.sessions:
            return self.sessions[session_id]
        index = min(range(len(self.engines)), key=lambda i: (self.inflight[i], self.session_counts[i]))
        if session_id is not None:
            self.sessions[session_id] = index
            self.session_counts[index] += 1
        return index

    def end_session(self, session_id: str) -> None:
        """Forget a finished trajectory so the routing table does not grow forever."""
        index = self.sessions.pop(session_id, None)
        if index is not None:
            self.session_counts[index] -= 1

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       session_id: str | None = None) -> GenerationResult:
        """Forward to the session's engine, counting the request as in flight there while it runs."""
        index = self.route(session_id)
        self.inflight[index] += 1
        try:
            result = await self.engines[index].generate(prompt_ids, sampling, session_id)
        finally:
            self.inflight[index] -= 1
        result.meta["engine_index"] = index
        return result

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every engine gets the same weights; the iterable is materialised once and shared."""
        tensors = list(named_tensors)
        await asyncio.gather(*(engine.update_weights(tensors) for engine in self.engines))

    async def update_weights_from_file(self, path: str) -> None:
        """Every engine reads the same file."""
        await asyncio.gather(*(engine.update_weights_from_file(path) for engine in self.engines))

    async def load_adapter(self, adapter, version: int) -> list[int]:
        """Every engine serves the same adapter (inference/adapter_files.py: its bytes, or a folder the caller can
        read) as policy version `version` (trainer.lora.sync=adapter)."""
        loaded = await asyncio.gather(*(engine.load_adapter(adapter, version) for engine in self.engines))
        return loaded[0]

    async def release_memory(self) -> int:
        """Engines that can free idle memory between rollouts do (vLLM on CPU); returns the bytes released."""
        released = await asyncio.gather(*(e.release_memory() for e in self.engines if hasattr(e, "release_memory")))
        return sum(released)

    async def health(self) -> bool:
        """Healthy only if every engine is: a dead engine would silently strand its sessions."""
        return all(await asyncio.gather(*(engine.health() for engine in self.engines)))

    def shutdown(self) -> None:
        """Shut down the engines that need it (vLLM actors); in-process engines have nothing to stop."""
        for engine in self.engines:
            if hasattr(engine, "shutdown"):
                engine.shutdown()
