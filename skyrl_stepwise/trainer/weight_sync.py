"""Trainer -> engines after each update, then proof that the engine now scores like the trainer."""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_stepwise.inference.base import InferenceEngine, SamplingParams
from skyrl_stepwise.trainer.batching import TrainBatch


@dataclass
class ProbeResult:
    max_abs_diff: float
    mean_abs_diff: float
    num_tokens: int


async def sync_weights(group, engine: InferenceEngine) -> int:
    """Gather the full state dict from the FSDP shards (rank 0) and load it into every engine."""
    state = group.call("full_state_dict")
    await engine.update_weights(list(state.items()))
    return sum(t.numel() for t in state.values())


async def probe_logprobs(group, engine: InferenceEngine, probe_ids: list[int], max_tokens: int = 16) -> ProbeResult:
    """Greedy-generate from the engine and rescore the same ids with the trainer: the two must agree."""
    result = await engine.generate(probe_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True),
                                   session_id="weight-sync-probe")
    ids = list(result.token_ids)
    batch = TrainBatch(prompt_ids=[probe_ids], response_ids=[ids], loss_masks=[[1] * len(ids)],
                       instance_ids=["probe"])
    trainer_lp = group.call("compute_logprobs", batch)[0]
    diffs = [abs(a - b) for a, b in zip(trainer_lp, result.logprobs or [])]
    return ProbeResult(max(diffs, default=0.0), sum(diffs) / max(len(diffs), 1), len(diffs))
