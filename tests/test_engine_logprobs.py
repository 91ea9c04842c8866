"""The weight-sync probe: engine logprobs vs the trainer's at the training temperature, and its pool session."""

from __future__ import annotations

import pytest
import torch

from skyrl_stepwise.inference import EnginePool, GenerationResult, SamplingParams
from skyrl_stepwise.trainer.batching import TrainBatch, gather_logprobs
from skyrl_stepwise.trainer.weight_sync import PROBE_SESSION, probe_logprobs


class ScriptedEngine:
    """Records the sampling params it is asked for; fails when told to."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[SamplingParams, str | None]] = []

    async def generate(self, prompt_ids, sampling, session_id=None) -> GenerationResult:
        self.calls.append((sampling, session_id))
        if self.fail:
            raise RuntimeError("engine died")
        return GenerationResult([5, 6, 7], [-0.5, -0.25, -1.0], "length")

    async def update_weights(self, named_tensors) -> None:
        pass

    async def health(self) -> bool:
        return True


class ConstantGroup:
    """A trainer group whose compute_logprobs returns fixed values."""

    def __init__(self, logprobs: list[float]) -> None:
        self.logprobs = logprobs

    def call(self, method: str, batch: TrainBatch):
        assert method == "compute_logprobs"
        return [self.logprobs]


class ForwardGroup:
    """A trainer group scoring like FSDPWorker.compute_logprobs: logits / its own temperature."""

    def __init__(self, model, temperature: float) -> None:
        self.model, self.temperature = model, temperature

    def call(self, method: str, batch: TrainBatch):
        assert method == "compute_logprobs"
        prompt, ids = batch.prompt_ids[0], batch.response_ids[0]
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + ids])).logits[0].float()
        start = len(prompt) - 1
        return [gather_logprobs(logits[start:start + len(ids)], torch.tensor(ids), self.temperature)[0].tolist()]


async def test_probe_samples_at_the_given_temperature_and_releases_its_pool_session():
    engine = ScriptedEngine()
    pool = EnginePool([engine, ScriptedEngine()])
    probe = await probe_logprobs(ConstantGroup([-0.5, -0.5, -1.0]), pool, [1, 2, 3], max_tokens=3, temperature=0.7)
    assert (probe.max_abs_diff, probe.num_tokens) == (0.25, 3)
    sampling, session = engine.calls[0]
    assert (sampling.temperature, sampling.max_tokens, sampling.logprobs, session) == (0.7, 3, True, PROBE_SESSION)
    assert pool.sessions == {} and pool.session_counts == [0, 0]

    failing = EnginePool([ScriptedEngine(fail=True)])
    with pytest.raises(RuntimeError, match="engine died"):
        await probe_logprobs(ConstantGroup([]), failing, [1, 2, 3])
    assert failing.sessions == {} and failing.session_counts == [0]

    class NoLogprobs(ScriptedEngine):
        async def generate(self, prompt_ids, sampling, session_id=None) -> GenerationResult:
            return GenerationResult([5, 6, 7], None, "length")

    # an engine that returns no logprobs compared nothing: the probe must not read as a perfect match
    vacuous = await probe_logprobs(ConstantGroup([-0.5, -0.25, -1.0]), NoLogprobs(), [1])
    assert vacuous.num_tokens == 0 and vacuous.max_abs_diff != vacuous.max_abs_diff  # NaN
    assert not vacuous.max_abs_diff < 1e-3

    bare = ScriptedEngine()  # a single engine has no end_session: nothing to release
    assert (await probe_logprobs(ConstantGroup([-0.5, -0.25, -1.0]), bare, [1])).max_abs_diff == 0.0
    assert bare.calls[0][0].temperature == 1.0
    with pytest.raises(ValueError, match="got 0"):
        await probe_logprobs(ConstantGroup([]), bare, [1], temperature=0.0)


@pytest.mark.integration
async def test_probe_agrees_with_a_trainer_at_temperature_07(hf_engine, tokenizer):
    # Before: a greedy probe compared T=1 engine logprobs with the trainer's logits / 0.7 and reported a mismatch.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}],
                                           add_generation_prompt=True, return_dict=False)
    pool = EnginePool([hf_engine])
    probe = await probe_logprobs(ForwardGroup(hf_engine.model, 0.7), pool, prompt, max_tokens=16, temperature=0.7)
    assert probe.num_tokens > 0
    assert probe.max_abs_diff < 1e-3, probe
    assert pool.sessions == {}
