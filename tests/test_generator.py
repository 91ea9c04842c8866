"""Generator invariants on the real SmolLM2 tokenizer and chat template, with a scripted engine
(exact control over which ids were "sampled")."""

from __future__ import annotations

import pytest

from qwen_vocab import qwen_fast_tokenizer
from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import (GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator,
                                      TrajectoryID, merge_stepwise_output)
from skyrl_stepwise.inference.scripted import ScriptedEngine

PROMPT = [{"role": "system", "content": "You are a search agent."},
          {"role": "user", "content": "Who painted the Mona Lisa?"}]


class ScriptedEnv:
    """Observation i is a fixed user message; done after `turns` actions. Records what it saw."""

    def __init__(self, turns: int = 3, observation: str = "<information>Doc 1: Leonardo</information>"):
        self.turns, self.observation, self.actions = turns, observation, []

    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        self.actions.append(action_text)
        done = len(self.actions) >= self.turns
        obs = [] if done else [{"role": "user", "content": f"{self.observation} #{len(self.actions)}"}]
        return StepResult(obs, reward=1.0 if done else 0.0, done=done)


def make_generator(tokenizer, script, turns=3, envs=None, **overrides):
    sampling = overrides.pop("sampling", GeneratorSamplingConfig(max_generate_length=64, stop=["</search>"]))
    cfg = GeneratorConfig(max_turns=overrides.pop("max_turns", 5), max_input_length=overrides.pop("max_input_length", 4096),
                          sampling=sampling, show_progress=False, **overrides)
    registry = EnvRegistry()
    created = envs if envs is not None else []
    registry.register("scripted", lambda: created.append(ScriptedEnv(turns)) or created[-1])
    engine = ScriptedEngine(script, tokenizer)
    return StepwiseGenerator(tokenizer, engine, registry, cfg), engine, created


async def run(generator, n=1):
    ids = [TrajectoryID("q0", i) for i in range(n)]
    return await generator.generate([PROMPT] * n, ["scripted"] * n, [{}] * n, ids)


def char_level_ids(tokenizer, text):
    """Non-canonical tokenization: one token per character; decode->encode merges them back."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in text]
    assert tokenizer.unk_token_id not in ids
    return ids


def canonical(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_non_round_trip_sequence_is_trained_exactly(tokenizer):
    eos = tokenizer.eos_token_id
    sampled = char_level_ids(tokenizer, "Search") + [eos]
    assert canonical(tokenizer, tokenizer.decode(sampled)) != sampled  # really does not round-trip
    gen, engine, _ = make_generator(tokenizer, lambda p, s, i: sampled, turns=2)
    out = await run(gen)
    assert out.response_ids == [sampled, sampled]
    assert out.loss_masks[0] == [1] * len(sampled)
    # step 2's prompt starts with step 1's prompt + the ids exactly as sampled
    assert out.prompt_token_ids[1][: len(out.prompt_token_ids[0]) + len(sampled)] == out.prompt_token_ids[0] + sampled
    assert engine.calls[1][1] == out.prompt_token_ids[1]  # and that is what the engine received


async def test_bridge_starts_with_newline_after_im_end(tokenizer):
    eos = tokenizer.eos_token_id
    newline = canonical(tokenizer, "\n")
    assert len(newline) == 1
    gen, _, envs = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, "<search> Mona Lisa </search>"), turns=2)
    out = await run(gen)
    p1, r1, p2 = out.prompt_token_ids[0], out.response_ids[0], out.prompt_token_ids[1]
    assert r1[-1] == eos and out.loss_masks[0][-1] == 0 and out.rollout_logprobs[0][-1] == 0.0  # appended EOS
    assert p2[: len(p1) + len(r1)] == p1 + r1
    bridge = p2[len(p1) + len(r1):]
    assert bridge[0] == newline[0]
    assert tokenizer.decode(bridge) == "\n<|im_start|>user\n<information>Doc 1: Leonardo</information> #1<|im_end|>\n<|im_start|>assistant\n"
    assert envs[0].actions[0] == "<search> Mona Lisa </search>"  # the env sees text, without EOS


async def test_gen_only_responses_and_rewards(tokenizer):
    texts = ["<search> a </search>", "<search> b </search>", "<answer> Leonardo </answer>"]
    eos = tokenizer.eos_token_id
    # no stop strings: a real engine would stop at "</search>" before the EOS (then the EOS is ours, masked)
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, texts[i]) + [eos], turns=3,
                               sampling=GeneratorSamplingConfig(max_generate_length=64))
    out = await run(gen)
    assert len(out) == 3 and out.is_last_step == [False, False, True]
    for i, text in enumerate(texts):
        assert out.response_ids[i] == canonical(tokenizer, text) + [eos]  # nothing but the sampled ids
        assert "information" not in tokenizer.decode(out.response_ids[i])
        assert out.loss_masks[i] == [1] * len(out.response_ids[i])  # the model's own EOS is trained
        assert out.rewards[i][:-1] == [0.0] * (len(out.rewards[i]) - 1)
    assert [r[-1] for r in out.rewards] == [0.0, 0.0, 1.0]
    assert all(t == TrajectoryID("q0", 0) for t in out.trajectory_ids)


async def test_merged_sample_equals_rendered_conversation(tokenizer):
    texts = ["<search> a </search>", "<search> b </search>", "<answer> Leonardo </answer>"]
    gen, _, envs = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, texts[i]), turns=3,
                                  merge_stepwise_output=True)
    out = await run(gen)
    assert len(out) == 1 and out.rollout_metrics["generate/bridge_fallbacks"] == 0
    history = list(PROMPT)
    for i, text in enumerate(texts):
        history.append({"role": "assistant", "content": text})
        if i < 2:
            history.append({"role": "user", "content": f"<information>Doc 1: Leonardo</information> #{i + 1}"})
    rendered = canonical(tokenizer, tokenizer.apply_chat_template(history, tokenize=False))
    assert rendered[-1] == canonical(tokenizer, "\n")[0]
    assert out.prompt_token_ids[0] + out.response_ids[0] == rendered[:-1]  # all but the final newline
    # observation tokens are in the merged response but never trained
    trained = [t for t, m in zip(out.response_ids[0], out.loss_masks[0]) if m]
    assert trained == [t for text in texts for t in canonical(tokenizer, text)]


async def test_whole_trajectory_mode_masks_observations(tokenizer):
    texts = ["<search> a </search>", "<answer> x </answer>"]
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, texts[i]), turns=2,
                               step_wise_trajectories=False)
    out = await run(gen, n=2)
    assert len(out) == 2 and out.is_last_step == [True, True]
    decoded_trained = tokenizer.decode([t for t, m in zip(out.response_ids[0], out.loss_masks[0]) if m])
    assert decoded_trained == "".join(texts)
    assert "<information>" in tokenizer.decode(out.response_ids[0])


async def test_length_check_runs_on_the_current_prompt(tokenizer):
    long_obs = "word " * 300
    first = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    limit = len(canonical(tokenizer, first)) + 50  # turn 1 fits, turn 2 (with the observation) does not
    registry_env = ScriptedEnv(turns=4, observation=long_obs)
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, "<search> q </search>"),
                               envs=None, max_input_length=limit)
    gen.env_registry = EnvRegistry()
    gen.env_registry.register("scripted", lambda: registry_env)
    out = await run(gen)
    assert len(out) == 1
    assert len(out.prompt_token_ids[0]) <= limit
    # the history outgrew the context: a stop reason of its own, not the per-turn `length`
    assert out.stop_reasons == ["context_exhausted"] and out.is_last_step == [True]
    assert out.rollout_metrics["context/exhausted_trajectories"] == 1
    assert out.response_ids[0][-1] == tokenizer.eos_token_id and out.loss_masks[0][-1] == 0


async def test_step_length_bound_holds(tokenizer):
    eos = tokenizer.eos_token_id
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, "blah " * 100),
                               max_input_length=300, turns=10, max_turns=10,
                               sampling=GeneratorSamplingConfig(max_generate_length=40))
    out = await run(gen, n=2)
    for p, r, m, reason, last in zip(out.prompt_token_ids, out.response_ids, out.loss_masks, out.stop_reasons,
                                     out.is_last_step):
        assert len(p) <= 300 and len(p) + len(r) <= 300 + 40 + 1
        assert r[-1] == eos and m[-1] == 0  # cut at max_tokens: the closing EOS is ours, masked
        assert reason == ("context_exhausted" if last else "length")  # the last turn's history outgrew the context


async def test_single_message_mode_appends_raw_observation(tokenizer):
    texts = ["<search> a </search>", "<answer> x </answer>"]
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, texts[i]), turns=2,
                               use_conversation_multi_turn=False, sampling=GeneratorSamplingConfig(
                                   max_generate_length=64, stop=["</search>", "</answer>"]))
    out = await run(gen)
    p1, r1, p2 = out.prompt_token_ids[0], out.response_ids[0], out.prompt_token_ids[1]
    assert r1 == canonical(tokenizer, texts[0])  # mid-message: no EOS appended
    obs = canonical(tokenizer, "<information>Doc 1: Leonardo</information> #1")
    assert p2 == p1 + r1 + obs
    eos = tokenizer.eos_token_id
    assert out.response_ids[1] == canonical(tokenizer, texts[1]) + [eos] and out.loss_masks[1][-1] == 0
    merged = merge_stepwise_output(out)
    assert len(merged) == 1


async def test_retokenize_mode_reports_drift(tokenizer):
    eos = tokenizer.eos_token_id
    sampled = char_level_ids(tokenizer, "Search") + [eos]
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: sampled, turns=3, history="retokenize")
    out = await run(gen)
    assert out.rollout_metrics["generate/retokenize_drift_steps"] == 2
    first = out.prompt_token_ids[0]
    assert out.rollout_metrics["generate/retokenize_first_divergence_min"] == len(first)
    # what the common behaviour trains on next turn is not what was sampled
    assert out.prompt_token_ids[1][len(first): len(first) + len(sampled)] != sampled


async def test_qwen3_style_template_falls_back_and_stays_correct():
    tok = qwen_fast_tokenizer()
    texts = ["<think>\nI should search.\n</think>\n\n<search> Mona Lisa </search>",
             "<think>\nFound it.\n</think>\n\n<answer> Leonardo </answer>"]
    gen, _, _ = make_generator(tok, lambda p, s, i: canonical(tok, texts[i]), turns=2, merge_stepwise_output=True)
    out = await run(gen)
    assert out.rollout_metrics["generate/bridge_fallbacks"] == 1
    assert len(out) == 2  # the fallback started a new chain: the merger cannot (and must not) join them
    history = list(PROMPT) + [{"role": "assistant", "content": texts[0]},
                              {"role": "user", "content": "<information>Doc 1: Leonardo</information> #1"}]
    expected_prompt2 = canonical(tok, tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True))
    assert out.prompt_token_ids[1] == expected_prompt2  # what the real template gives: no <think> in history
    assert "<think>" not in tok.decode(out.prompt_token_ids[1])
    eos = tok.eos_token_id
    assert out.response_ids == [canonical(tok, texts[0]) + [eos], canonical(tok, texts[1]) + [eos]]


async def test_qwen_chatml_without_think_extends_exactly():
    tok = qwen_fast_tokenizer()
    gen, _, _ = make_generator(tok, lambda p, s, i: canonical(tok, "<search> q </search>"), turns=3,
                               merge_stepwise_output=True)
    out = await run(gen)
    assert out.rollout_metrics["generate/bridge_fallbacks"] == 0 and len(out) == 1


def test_config_rejects_merge_without_stepwise():
    with pytest.raises(ValueError, match="merge_stepwise_output"):
        GeneratorConfig(step_wise_trajectories=False, merge_stepwise_output=True).validate()
    with pytest.raises(ValueError, match="generator.history"):
        GeneratorConfig(history="text").validate()


async def test_no_logprobs_means_none_not_zeros(tokenizer):
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, "<search> a </search>"), turns=2,
                               sampling=GeneratorSamplingConfig(max_generate_length=64, logprobs=False))
    out = await run(gen)
    assert len(out) == 2 and out.rollout_logprobs is None
    assert merge_stepwise_output(out).rollout_logprobs is None


def test_tis_without_rollout_logprobs_is_rejected_at_config_time():
    from skyrl_stepwise.run.config import RunConfig

    cfg = RunConfig()
    cfg.generator.sampling.logprobs = False
    with pytest.raises(ValueError, match=r"trainer.algorithm.tis_ratio_clip_high=2.0.*generator.sampling.logprobs"):
        cfg.validate()
    cfg.trainer.algorithm.tis_ratio_clip_high = None
    cfg.validate()


async def test_stop_string_turn_without_appended_eos_extends_exactly(tokenizer):
    texts = ["<search> a </search>", "<search> b </search>", "<answer> x </answer>"]
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, texts[i]), turns=3,
                               append_eos_after_stop_str=False, merge_stepwise_output=True)
    out = await run(gen)
    assert out.rollout_metrics["generate/bridge_fallbacks"] == 0 and len(out) == 1
    eos = tokenizer.eos_token_id
    trained = [t for t, m in zip(out.response_ids[0], out.loss_masks[0]) if m]
    assert trained == [t for text in texts for t in canonical(tokenizer, text)]  # the template's EOS is not trained
    # two closing the open turns (in the bridges, untrained), two closing the observations, the final appended one
    assert out.response_ids[0].count(eos) == 5
    assert [m for t, m in zip(out.response_ids[0], out.loss_masks[0]) if t == eos] == [0] * 5


async def test_single_message_mode_ends_on_a_sampled_eos(tokenizer):
    eos = tokenizer.eos_token_id
    gen, _, envs = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, "I am done.") + [eos], turns=3,
                                  use_conversation_multi_turn=False, step_wise_trajectories=False)
    out = await run(gen)
    assert len(envs[0].actions) == 1  # the model closed its only message: the trajectory is over
    assert len(out) == 1 and out.response_ids[0] == canonical(tokenizer, "I am done.") + [eos]
    assert out.loss_masks[0][-1] == 1  # sampled, so trained
    assert out.rollout_metrics["generate/chain_breaks"] == 0


async def test_overlong_filtering_masks_trajectories_cut_by_length(tokenizer):
    eos = tokenizer.eos_token_id
    # rep 0 answers with EOS, rep 1 rambles past max_generate_length on its last turn
    script = lambda p, s, i: canonical(tokenizer, "<answer> x </answer>") + [eos] if s.endswith("_0") \
        else canonical(tokenizer, "blah " * 40)
    for flag, masked in ((False, 0), (True, 1)):
        gen, _, _ = make_generator(tokenizer, script, turns=1, apply_overlong_filtering=flag,
                                   sampling=GeneratorSamplingConfig(max_generate_length=16))
        out = await run(gen, n=2)
        assert out.stop_reasons == ["stop", "length"]
        assert out.rollout_metrics["generate/overlong_filtered_trajectories"] == masked
        assert sum(out.loss_masks[0]) == len(out.response_ids[0])
        assert sum(out.loss_masks[1]) == (0 if flag else 16)
