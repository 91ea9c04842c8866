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


PROBE_SESSION = "weight-sync-probe"


async def probe_logprobs(group, engine: InferenceEngine, probe_ids: list[int], max_tokens: int = 16,
                         temperature: float = 1.0) -> ProbeResult:
    """Sample from the engine and rescore the same ids with the trainer: the two must agree.

    `temperature` must be the trainer's (= the rollout's): the engine returns logprobs of the distribution
    it sampled from and the trainer scores logits / its cfg.temperature, so any other temperature
    (greedy included, which vLLM scores at T=1) reports a mismatch that is not there.
    """
    if temperature <= 0:
        raise ValueError(f"probe_logprobs: temperature must be > 0 (the trainer's temperature), got {temperature}")
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=True)
    try:
        result = await engine.generate(probe_ids, sampling, session_id=PROBE_SESSION)
    finally:
        if hasattr(engine, "end_session"):  # an EnginePool would otherwise keep the probe's routing entry
            engine.end_session(PROBE_SESSION)
    ids = list(result.token_ids)
    batch = TrainBatch(prompt_ids=[probe_ids], response_ids=[ids], loss_masks=[[1] * len(ids)],
                       instance_ids=["probe"])
    trainer_lp = group.call("compute_logprobs", batch)[0]
    diffs = [abs(a - b) for a, b in zip(trainer_lp, result.logprobs or [])]
    return ProbeResult(max(diffs, default=0.0), sum(diffs) / max(len(diffs), 1), len(diffs))
