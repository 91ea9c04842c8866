"""Trainer -> engines after each update, then proof that the engine now scores like the trainer."""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_stepwise.inference.base import InferenceEngine, SamplingParams
from skyrl_stepwise.inference.weights import current_node_id, weights_file
from skyrl_stepwise.trainer.batching import TrainBatch


@dataclass
class ProbeResult:
    max_abs_diff: float
    mean_abs_diff: float
    num_tokens: int


def engine_dtype(engine) -> str:
    """The dtype the engines run in (a pool's engines share one config)."""
    first = engine.engines[0] if hasattr(engine, "engines") else engine
    return getattr(getattr(first, "cfg", None), "dtype", "float32")


def can_sync_through_a_file(group, engine) -> bool:
    """Every engine can read a weights file and runs on the node where the trainer's rank 0 writes it."""
    trainer_node = getattr(group, "node_id", None) or current_node_id()
    engines = engine.engines if hasattr(engine, "engines") else [engine]
    return all(hasattr(e, "update_weights_from_file") and getattr(e, "node_id", None) == trainer_node
               for e in engines)


async def sync_weights(group, engine: InferenceEngine) -> int:
    """Load the trainer's current weights into every engine; returns the number of parameters.

    Same node: rank 0 writes one safetensors file in the engines' dtype to shared memory and the engines read
    it, so the driver only passes a path. Otherwise (an engine on another node, or one that cannot read files)
    the full state dict goes through the driver as before.
    """
    if can_sync_through_a_file(group, engine):
        with weights_file() as path:
            exported = group.call("export_weights", str(path), engine_dtype(engine))
            await engine.update_weights_from_file(str(path))
        return exported["params"]
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
