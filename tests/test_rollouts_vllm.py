"""Real rollouts: the generator with the real vLLM engine and SmolLM2, on the 3-turn keyword env and on
Search-R1 against the real retrieval server over the embedded data. Every generator invariant is checked
on the real samples."""

from __future__ import annotations

import pytest

from skyrl_stepwise.data.dataset import load_prompt_dataset
from skyrl_stepwise.data.embedded import build_embedded_search_r1
from skyrl_stepwise.envs.base import EnvRegistry
from skyrl_stepwise.envs.search import SearchEnvConfig, register_search_env
from skyrl_stepwise.envs.toy import KeywordEnv
from skyrl_stepwise.generator import (GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID,
                                      merge_stepwise_output)

pytestmark = pytest.mark.integration


def check_invariants(out, cfg: GeneratorConfig, eos: int, n_trajectories: int) -> None:
    """Everything the generator promises, on real samples."""
    out.validate()
    assert len({t for t in out.trajectory_ids}) == n_trajectories
    seen, prev = set(), None
    for i, (p, r, m, lp) in enumerate(zip(out.prompt_token_ids, out.response_ids, out.loss_masks,
                                         out.rollout_logprobs)):
        tid = out.trajectory_ids[i]
        assert tid == prev or tid not in seen, "steps of a trajectory must be contiguous"
        seen.add(tid)
        assert len(p) <= cfg.max_input_length
        assert len(p) + len(r) <= cfg.max_input_length + cfg.sampling.max_generate_length + 1
        assert r[-1] == eos or not out.is_last_step[i] or not cfg.use_conversation_multi_turn
        for token, mask, logprob in zip(r, m, lp):
            if mask == 0:  # only an EOS we appended is ever masked in a gen-only response
                assert token == eos and logprob == 0.0
            else:
                assert logprob <= 0.0
        if prev == tid:  # step i extends step i-1 exactly (prompt + sampled + bridge)
            pp, pr = out.prompt_token_ids[i - 1], out.response_ids[i - 1]
            assert p[: len(pp) + len(pr)] == pp + pr
        if i + 1 < len(out) and out.trajectory_ids[i + 1] != tid:
            assert out.is_last_step[i]
        prev = tid
    assert out.is_last_step[-1]
    merged = merge_stepwise_output(out)
    assert len(merged) == n_trajectories  # exact history: one chain per trajectory
    assert out.rollout_metrics["generate/bridge_fallbacks"] == 0


async def test_keyword_env_three_turns(vllm_engine, tokenizer):
    cfg = GeneratorConfig(max_turns=3, max_input_length=1024, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=32, temperature=1.0, seed=1))
    registry = EnvRegistry()
    registry.register("keyword", KeywordEnv)
    gen = StepwiseGenerator(tokenizer, vllm_engine, registry, cfg)
    prompt = [{"role": "user", "content": "Say the word blue."}]
    ids = [TrajectoryID("blue", i) for i in range(8)]
    out = await gen.generate([prompt] * 8, ["keyword"] * 8, [{"target": "blue", "turns": 3}] * 8, ids)
    check_invariants(out, cfg, tokenizer.eos_token_id, 8)
    assert out.rollout_metrics["generate/turns_per_trajectory_mean"] == 3  # 3-turn env, nothing cut short
    assert len(out) == 24
    assert out.rollout_metrics["generate/engine_seconds"] > 0


async def test_search_r1_rollouts_against_real_server(vllm_engine, tokenizer, embedded_retriever_url):
    data = build_embedded_search_r1()
    rows = load_prompt_dataset(data.validation)[:4]
    cfg = GeneratorConfig(max_turns=3, max_input_length=1536, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=64, stop=["</search>", "</answer>"],
                                                           seed=3))
    registry = EnvRegistry()
    register_search_env(registry, SearchEnvConfig(search_url=embedded_retriever_url))
    gen = StepwiseGenerator(tokenizer, vllm_engine, registry, cfg)
    prompts = [r.prompt for r in rows for _ in range(2)]
    extras = [r.env_extras() for r in rows for _ in range(2)]
    ids = [TrajectoryID(r.instance_id, k) for r in rows for k in range(2)]
    out = await gen.generate(prompts, ["search"] * 8, extras, ids)
    check_invariants(out, cfg, tokenizer.eos_token_id, 8)
    assert all(r in (0.0, 1.0) for r in out.trajectory_rewards())
    assert out.rollout_metrics["generate/failed_trajectories"] == 0


async def test_tool_env_rollouts_with_search_and_calculator(vllm_engine, tokenizer, embedded_retriever_url):
    """Search-R1 as function calling: real engine, real retrieval server, search + calculator tools."""
    from skyrl_stepwise.envs.tool import ToolEnvConfig, register_tool_env

    data = build_embedded_search_r1()
    rows = load_prompt_dataset(data.validation)[:4]
    cfg = GeneratorConfig(max_turns=3, max_input_length=1536, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=64, seed=5))
    registry = EnvRegistry()
    register_tool_env(registry, ToolEnvConfig(question_only=True, system_prompt="Use the tools, then answer."),
                      search_url=embedded_retriever_url)
    gen = StepwiseGenerator(tokenizer, vllm_engine, registry, cfg)
    prompts = [r.prompt for r in rows for _ in range(2)]
    extras = [r.env_extras() for r in rows for _ in range(2)]
    ids = [TrajectoryID(r.instance_id, k) for r in rows for k in range(2)]
    out = await gen.generate(prompts, ["tool"] * 8, extras, ids)
    check_invariants(out, cfg, tokenizer.eos_token_id, 8)
    assert out.rollout_metrics["generate/failed_trajectories"] == 0
    assert all(r in (0.0, 1.0) for r in out.trajectory_rewards())
    assert '"name": "search"' in tokenizer.decode(out.prompt_token_ids[0])  # the schemas are in the prompt
