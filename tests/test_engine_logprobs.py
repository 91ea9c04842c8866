"""The weight-sync probe: engine logprobs vs the trainer's at the training temperature, and its pool session."""

from __future__ import annotations

import pytest
import torch

from skyrl_stepwise.inference import EnginePool, GenerationResult, SamplingParams
from skyrl_stepwise.inference.truncation import truncation_keep_mask
from skyrl_stepwise.policy.batching import TrainBatch, gather_logprobs
from skyrl_stepwise.policy.weight_sync import PROBE_SESSION, probe_logprobs


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
    """A trainer group scoring like FSDPWorker.compute_logprobs: logits / its own temperature, truncated by its own
    top-k / top-p."""

    def __init__(self, model, temperature: float, top_k: int = -1, top_p: float = 1.0) -> None:
        self.model, self.temperature, self.top_k, self.top_p = model, temperature, top_k, top_p

    def call(self, method: str, batch: TrainBatch):
        assert method == "compute_logprobs"
        prompt, ids = batch.prompt_ids[0], batch.response_ids[0]
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + ids])).logits[0].float()
        start = len(prompt) - 1
        return [gather_logprobs(logits[start:start + len(ids)], torch.tensor(ids), self.temperature,
                                top_k=self.top_k, top_p=self.top_p)[0].tolist()]


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


@pytest.mark.integration
@pytest.mark.parametrize("top_k, top_p", [(-1, 0.9), (20, 1.0)])
@pytest.mark.parametrize("engine_name", ["hf_engine", "vllm_engine"])
async def test_on_policy_tis_weight_is_one_under_top_p_and_top_k(engine_name, top_k, top_p, hf_engine, tokenizer,
                                                                 request):
    """Both engines return logprobs of the truncated distribution they drew from; the trainer scoring the full
    softmax made every TIS weight the kept mass (0.91 at top_p=0.9). Scored with the same truncation, every
    on-policy weight exp(trainer - rollout) is 1 within 1e-3; the probe runs with the run's own parameters."""
    engine = request.getfixturevalue(engine_name)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                           add_generation_prompt=True, return_dict=False)
    probe = await probe_logprobs(ForwardGroup(hf_engine.model, 1.0, top_k, top_p), engine, prompt, max_tokens=24,
                                 top_k=top_k, top_p=top_p)
    assert probe.num_tokens > 0
    assert probe.max_abs_diff < 1e-3, probe  # |log w| < 1e-3 on every token
    untruncated = await probe_logprobs(ForwardGroup(hf_engine.model, 1.0), engine, prompt, max_tokens=24,
                                       top_k=top_k, top_p=top_p)
    assert untruncated.mean_abs_diff > 5e-3  # what the trainer reported before: the kept mass, not 1


def _reference_keep(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p, one token at a time, as vLLM's sampler defines them."""
    keep = torch.ones_like(row, dtype=torch.bool)
    if top_k > 0:
        keep &= row >= sorted(row.tolist(), reverse=True)[top_k - 1]
    probs = row.masked_fill(~keep, float("-inf")).softmax(-1)
    for i in range(len(row)):
        # dropped when the mass of the tokens ranked at or below it (ascending order) stays <= 1 - top_p
        if keep[i] and probs[probs <= probs[i]].sum() <= 1 - top_p and probs[i] < probs.max():
            keep[i] = False
    return keep


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (-1, 0.7), (5, 0.8), (-1, 1.0)])
def test_truncated_logprobs_and_gradients_match_a_masked_log_softmax(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    targets = torch.tensor([0, 1, 2, 3, 4, 5])
    keep = truncation_keep_mask(logits.detach() / 0.8, top_k, top_p)
    if top_k <= 0 and top_p >= 1:
        assert keep is None
        keep = torch.ones(6, 11, dtype=torch.bool)
    for r in range(6):
        assert torch.equal(keep[r], _reference_keep(logits.detach()[r] / 0.8, top_k, top_p))
    keep = keep.clone().scatter_(-1, targets[:, None], True)  # a target outside the kept set still scores finitely
    expected = (logits / 0.8).masked_fill(~keep, float("-inf")).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    weights = torch.arange(1.0, 7.0)
    (grad_expected,) = torch.autograd.grad((expected * weights).sum(), logits)
    got, _ = gather_logprobs(logits, targets, 0.8, chunk_rows=4, top_k=top_k, top_p=top_p)
    (grad_got,) = torch.autograd.grad((got * weights).sum(), logits)
    assert torch.allclose(got, expected, atol=1e-6) and torch.isfinite(got).all()
    assert torch.allclose(grad_got, grad_expected, atol=1e-6)
