"""The token-in/token-out engine contract every inference backend implements.

Engines never see text prompts: re-tokenizing text is the drift this project exists to avoid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs; stop strings stay in the returned tokens so history stays exact."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    # Token ids that end the turn besides the model's EOS (a chat template's turn terminator, e.g. <|im_end|> on a
    # base model whose EOS is <|endoftext|>); kept in the output like EOS.
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class GenerationResult:
    """What one request produced: the sampled ids exactly, with one logprob per id when asked."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    stop_string: str | None = None
    meta: dict = field(default_factory=dict)


@runtime_checkable
class InferenceEngine(Protocol):
    """Anything that turns prompt ids into sampled ids; vLLM, transformers and scripted engines."""

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        """Sample one turn from ids, not text, and return the ids as sampled: the generator keeps history as
        ids, so nothing is re-tokenized. `session_id` routes a trajectory's turns to one engine (prefix cache)."""
        ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's new weights in place, so the next rollouts are on-policy without a restart."""
        ...

    async def health(self) -> bool:
        """False (or raise) when the engine cannot serve: the generator fails the step loudly instead of waiting
        on a dead engine."""
        ...


def validate_prompt(prompt_ids: list[int], vocab_size: int, max_model_len: int | None = None) -> None:
    """Reject prompts an engine would choke on, with a message that names the bad value."""
    if max_model_len is not None and len(prompt_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens, engine.max_model_len is {max_model_len}: "
                         "no room left to generate")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: an engine needs at least one prompt token")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids contains token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}")
