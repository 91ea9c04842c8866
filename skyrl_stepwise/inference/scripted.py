"""A scripted engine for exact, deterministic unit tests and overhead benchmarks.

It is NOT a model: it replays token ids chosen by the test, so tests can control exactly which ids
were "sampled" (including sequences that do not survive decode -> re-encode). Real-model tests use
the vLLM and transformers engines.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from skyrl_stepwise.inference.base import GenerationResult, SamplingParams

# (prompt_ids, session_id, call_index_for_session) -> sampled ids
Script = Callable[[list[int], str | None, int], list[int]]


class ScriptedEngine:
    """Replays scripted ids, applying max_tokens and stop strings the way a real engine does."""

    def __init__(self, script: Script, tokenizer, logprob: float = -0.5) -> None:
        self.script = script
        self.tokenizer = tokenizer
        self.logprob = logprob
        self.calls: list[tuple[str | None, list[int]]] = []
        self.sampled: list[list[int]] = []  # what each call returned, for exactness checks
        self.weight_updates = 0
        self._per_session: dict[str | None, int] = {}

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       session_id: str | None = None) -> GenerationResult:
        index = self._per_session.get(session_id, 0)
        self._per_session[session_id] = index + 1
        self.calls.append((session_id, list(prompt_ids)))
        ids = list(self.script(list(prompt_ids), session_id, index))
        finish, stop_string = "stop", None
        stops = {self.tokenizer.eos_token_id, *sampling.stop_token_ids}
        for end in range(1, len(ids) + 1):  # whichever comes first, token by token, as a real engine sees them
            if ids[end - 1] in stops:
                ids = ids[:end]
                break
            if sampling.stop:  # a stop string is kept in the output, like vLLM does
                text = self.tokenizer.decode(ids[:end])
                hit = next((s for s in sampling.stop if s in text), None)
                if hit:
                    ids, stop_string = ids[:end], hit
                    break
        if len(ids) > sampling.max_tokens:
            ids, finish, stop_string = ids[: sampling.max_tokens], "length", None
        elif stop_string is None and (not ids or ids[-1] not in stops):
            finish = "length"
        logprobs = [self.logprob] * len(ids) if sampling.logprobs else None
        self.sampled.append(list(ids))
        return GenerationResult(ids, logprobs, finish, stop_string)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """No weights to load: counts the update, so a real training loop can run against a script."""
        list(named_tensors)
        self.weight_updates += 1

    async def health(self) -> bool:
        return True
