"""The renderer layer on its own: real-history bridge, thinking retention, dropped observations, base-model
tokenizers, reasons for every re-render. Scripted engine, real tokenizers."""

from __future__ import annotations


import pytest
from family_tokenizers import tokenizer_copy
from qwen_vocab import qwen_fast_tokenizer
from test_generator import PROMPT, canonical, make_generator, run

from skyrl_stepwise.chat import RenderError, TemplateRenderer, create_renderer
from skyrl_stepwise.generator import TrajectoryID

THINK = ["<think>\nI should search.\n</think>\n\n<search> Mona Lisa </search>",
         "<think>\nFound it.\n</think>\n\n<answer> Leonardo </answer>"]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("retention, fallbacks, samples", [("template", 1, 2), ("all", 0, 1)])
async def test_thinking_retention_on_a_template_that_strips_past_reasoning(retention, fallbacks, samples):
    tok = qwen_fast_tokenizer()
    gen, _, _ = make_generator(tok, lambda p, s, i: canonical(tok, THINK[i]), turns=2, merge_stepwise_output=True,
                               thinking_retention=retention)
    out = await run(gen)
    m = out.rollout_metrics
    assert m["generate/bridge_fallbacks"] == fallbacks and len(out) == samples
    if fallbacks:
        assert m["generate/bridge_fallbacks/template_rewrites_history"] == 1
    else:  # one chain whose trained tokens are exactly the sampled ones, reasoning included
        trained = [t for t, k in zip(out.response_ids[0], out.loss_masks[0]) if k]
        assert trained == canonical(tok, THINK[0]) + canonical(tok, THINK[1])
        assert tok.decode(out.prompt_token_ids[0] + out.response_ids[0]).count("<think>") == 2


def test_base_model_tokenizer_whose_turns_end_with_another_token(tokenizer):
    base = tokenizer_copy(tokenizer)
    base.eos_token = "<|endoftext|>"  # a base model: text ends with <|endoftext|>, chat turns with <|im_end|>
    chat = create_renderer(base, "template")
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    assert chat.close_id == im_end and chat.stop_ids == {im_end, base.eos_token_id}


async def test_base_model_tokenizer_in_both_modes(tokenizer):
    base = tokenizer_copy(tokenizer)
    base.eos_token = "<|endoftext|>"
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    for conversation in (True, False):
        gen, _, _ = make_generator(base, lambda p, s, i: canonical(base, "<search> q </search>"), turns=3,
                                   merge_stepwise_output=True, use_conversation_multi_turn=conversation)
        out = await run(gen)
        assert len(out) == 1 and out.rollout_metrics["generate/bridge_fallbacks"] == 0
        assert out.response_ids[0][-1] == im_end and out.loss_masks[0][-1] == 0  # closed by the turn terminator


class _DropsToolTemplate:
    """A ChatML template that silently skips `tool` messages (as some real ones do)."""

    TEMPLATE = ("{%- for m in messages -%}{%- if m['role'] != 'tool' -%}"
                "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


async def test_a_template_that_drops_tool_messages_gets_them_in_the_role_it_renders_counted(tokenizer):
    """The renderer never lets an observation vanish (handed a `tool` message the template drops, it raises, naming
    it); the generator, knowing from the probe that this template drops `tool`, renders the observation as a user
    turn instead: the trajectory goes on, the observation reaches the model, the fallback is counted."""
    tok = tokenizer_copy(tokenizer)
    tok.chat_template = _DropsToolTemplate.TEMPLATE
    chat = create_renderer(tok, "template")
    assert not chat.roles.tool_without_call and not chat.roles.tool_after_call and chat.roles.system
    history = PROMPT + [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "42 degrees"}]
    with pytest.raises(RenderError, match="drops 'tool' messages: '42 degrees'"):
        chat.next_prompt(chat.prompt_ids(PROMPT), canonical(tok, "x") + [tok.eos_token_id], history, history[-1:])

    from skyrl_stepwise.envs.base import EnvRegistry, StepResult

    class ToolEnv:
        async def reset(self, prompt, extras):
            return list(prompt)

        async def step(self, action):
            return StepResult([{"role": "tool", "content": "42 degrees"}], 0.0, False)

    gen, engine, _ = make_generator(tok, lambda p, s, i: canonical(tok, "call") + [tok.eos_token_id], turns=3,
                                    max_turns=3)
    gen.env_registry = EnvRegistry()
    gen.env_registry.register("scripted", ToolEnv)
    out = await run(gen)
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 0 and m["generate/observation_role_fallbacks"] == 2, m
    assert m["generate/bridge_fallbacks"] == 0
    assert "<|im_start|>user\n42 degrees<|im_end|>" in tok.decode(engine.calls[1][1])


def test_template_without_chat_template_or_unknown_renderer_fails_naming_it(tokenizer):
    tok = tokenizer_copy(tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat_template"):
        TemplateRenderer(tok)
    from skyrl_stepwise.generator import GeneratorConfig

    with pytest.raises(ValueError, match="generator.renderer='qwen9'"):
        GeneratorConfig(renderer="qwen9").validate()
    with pytest.raises(ValueError, match="generator.thinking_retention"):
        GeneratorConfig(thinking_retention="some").validate()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_the_engine_is_told_to_stop_at_the_turn_terminator(tokenizer):
    base = tokenizer_copy(tokenizer)
    base.eos_token = "<|endoftext|>"
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    sampled = canonical(base, "<answer> x </answer>") + [im_end]
    gen, engine, _ = make_generator(base, lambda p, s, i: sampled + canonical(base, " and more"), turns=3)
    out = await run(gen)
    assert out.response_ids[0] == sampled and out.loss_masks[0] == [1] * len(sampled)  # the model closed its turn

    from skyrl_stepwise.inference.base import SamplingParams
    from skyrl_stepwise.inference.vllm_engine import to_vllm_sampling

    assert to_vllm_sampling(SamplingParams(stop_token_ids=(im_end,))).stop_token_ids == [im_end]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a quiet 2-core box)
def test_hermes_tool_calls_parse_from_text_and_from_single_tokens(tokenizer):
    from tokenizers import AddedToken

    from skyrl_stepwise.chat.tool_parsers import parse_hermes_text

    content, calls = parse_hermes_text('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": '
                                       '"2+3"}}</tool_call>\n<tool_call>{oops}</tool_call><tool_call>{"arguments": {}}'
                                       '</tool_call><tool_call>{"name": "x"')
    assert content == "Let me compute. "
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+3"}, None), (None, None, "invalid_json"), (None, {}, "missing_name"),
        (None, None, "unclosed_block")]
    qwen = qwen_fast_tokenizer()
    qwen.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    for tok in (tokenizer, qwen):  # SmolLM2 spells <tool_call> in pieces; Qwen has one token for it
        chat = create_renderer(tok, "template")
        text = 'ok <tool_call>{"name": "search", "arguments": {"query": "Mona Lisa"}}</tool_call>'
        turn = chat.parse(canonical(tok, text) + [chat.close_id], [], tools=[{"type": "function", "function": {
            "name": "search"}}])
        assert [(c.name, c.arguments) for c in turn.tool_calls] == [("search", {"query": "Mona Lisa"})]
        # neither template renders `tool_calls`: the calls stay in the content, or a re-render would lose them
        assert not chat.renders_tool_calls and turn.content == text
        assert turn.message()["tool_calls"][0]["function"]["name"] == "search"


def test_mistral_tool_calls_parse_in_every_tokenizer_generation():
    from skyrl_stepwise.chat.tool_parsers import parse_mistral_text

    # v13 (Mistral Small 3.2): no sampled id, so one is made in the 9-character form the template requires
    content, calls = parse_mistral_text('Checking. [TOOL_CALLS]search[ARGS]{"query": "Mona Lisa"}'
                                        '[TOOL_CALLS]calculator[CALL_ID]a1B2c3D4e[ARGS]{"expression": "2+3"}'
                                        '[TOOL_CALLS]search[ARGS]{"query": [TOOL_CALLS][ARGS]{"x": 1}[TOOL_CALLS]search')
    assert content == "Checking. "
    assert [(c.name, c.arguments, c.error, c.id) for c in calls] == [
        ("search", {"query": "Mona Lisa"}, None, "call00000"), ("calculator", {"expression": "2+3"}, None, "a1B2c3D4e"),
        ("search", None, "invalid_json", "call00002"), (None, {"x": 1}, "missing_name", "call00003"),
        (None, None, "missing_arguments", "call00004")]
    # v3-v7 (Mistral 7B v0.3, Nemo): one JSON list after the marker
    content, calls = parse_mistral_text('[TOOL_CALLS] [{"name": "search", "arguments": {"query": "x"}, "id": '
                                        '"abcdefghi"}, {"name": "calculator", "arguments": {"expression": "1"}}]')
    assert content == "" and [(c.name, c.arguments, c.id) for c in calls] == [
        ("search", {"query": "x"}, "abcdefghi"), ("calculator", {"expression": "1"}, "call00001")]
    assert parse_mistral_text("no calls here") == ("no calls here", [])
    assert [c.error for c in parse_mistral_text("[TOOL_CALLS][{oops")[1]] == ["invalid_json"]


def test_tool_schemas_reach_the_prompt_even_when_the_template_ignores_tools(tokenizer):
    from family_tokenizers import family_tokenizer

    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    for tok in (tokenizer, family_tokenizer("qwen2.5")):  # SmolLM2 ignores tools=, Qwen2.5 renders them itself
        chat = create_renderer(tok, "template")
        text = chat.decode(chat.prompt_ids(PROMPT, tools))
        assert text.count('"name": "calculator"') == 1 and "<tool_call>" in text
        assert chat.renders_tools == (tok is not tokenizer)


@pytest.mark.parametrize("family, renders_developer", [("mistral-small-3.2", False), ("gemma-2", False),
                                                       ("gpt-oss", True)])
async def test_a_developer_prompt_reaches_every_family(family, renders_developer):
    """OpenAI's `developer` role: a template that renders it keeps it; one that raises on it (Mistral) or has no
    system role at all (Gemma 2) gets it as `system` (folded into the first user turn there), as the agent endpoint
    does, instead of failing every trajectory."""
    from family_tokenizers import FAMILIES, family_tokenizer

    tok = family_tokenizer(family)
    chat = create_renderer(tok, "template", dict(FAMILIES[family].render_kwargs))
    assert chat.roles.developer is renders_developer
    prompt = [{"role": "developer", "content": "Answer in French."}, PROMPT[1]]
    gen, engine, _ = make_generator(tok, lambda p, s, i: tok("Leonardo.", add_special_tokens=False)["input_ids"]
                                    + [chat.close_id], turns=1, chat_template_kwargs=FAMILIES[family].render_kwargs)
    out = await gen.generate([prompt], ["scripted"], [{}], [TrajectoryID("q0", 0)])
    assert out.rollout_metrics["generate/failed_trajectories"] == 0 and len(out) == 1
    assert "Answer in French." in tok.decode(engine.calls[0][1])
