"""Token exactness on the real chat templates of eight model families (tests/templates, offline tokenizers).

Each family runs a 4-turn trajectory through the real generator with a scripted engine: a tool call in the
family's own format (hermes, Llama 3.1 JSON, harmony, Mistral) or a plain turn (DeepSeek), a response that does not survive decode -> encode ending on a stop string, a turn cut
by length, and a final answer. Observations are tool results (where the family's tool calls parse) and user
messages. Invariants, for both thinking-retention policies:
- trained tokens are exactly the sampled ones, every observation reaches the next prompt, nothing escapes;
- `all`: no fallback at all; `template`: a fallback only where the template really rewrites the history
  (checked by rendering it), each counted with its reason.
"""

from __future__ import annotations

import json

import pytest
from family_tokenizers import FAMILIES, family_tokenizer, tokenizer_copy

from skyrl_stepwise.chat import create_renderer
from skyrl_stepwise.chat.tool_parsers import mistral_call_id
from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.envs.tool import ToolEnv, ToolEnvConfig
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.tools.builtin import CalculatorTool
from skyrl_stepwise.tools.executor import decode_arguments

HERMES = {"qwen2.5", "qwen3", "hermes-3", "smollm2"}
# the first turn is a tool call in the family's own format (the calls are parsed from the sampled ids)
TOOL_CALLS = {**{f: '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
                 for f in HERMES},
              "llama-3.1": '{"name": "calculator", "parameters": {"expression": "2+3"}}',
              "gpt-oss": '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "2+3"}',
              # tokenizer v13 samples no [CALL_ID]; the template renders one, so only `all` keeps the turn
              "mistral-small-3.2": '[TOOL_CALLS]calculator[ARGS]{"expression": "2+3"}'}
# the id a tool result answers: Mistral's template demands 9 alphanumeric characters (the parser's made-up id)
CALL_IDS = {"mistral-small-3.2": mistral_call_id(0)}
CALL_ENDS = {"llama-3.1": "<|eom_id|>", "gpt-oss": "<|call|>"}  # the token a real model ends a call turn with
THINKING = {"qwen3", "deepseek-r1-distill-qwen"}
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]
PROMPT = [{"role": "system", "content": "You are a careful assistant."},
          {"role": "user", "content": "What is 2+3, and who painted the Mona Lisa?"}]


class ConformanceEnv:
    """Tool result after a tool call, a user message otherwise; done after 4 actions."""

    tool_schemas = TOOLS

    def __init__(self, family: str) -> None:
        self.family, self.actions = family, []

    async def reset(self, prompt, extras):
        return list(prompt)

    async def step(self, action_text):
        self.actions.append(action_text)
        n = len(self.actions)
        if n >= 4:
            return StepResult([], 1.0, True)
        if "calculator" in action_text:
            return StepResult([{"role": "tool", "content": "5", "name": "calculator",
                                "tool_call_id": CALL_IDS.get(self.family, "call_0")}], 0.0, False)
        return StepResult([{"role": "user", "content": f"Observation {n}: keep going."}], 0.0, False)


def _script(family: str, tok, close_id: int):
    think = "<think>\nLet me think.\n</think>\n\n" if family in THINKING else ""
    generation_prompt = tok.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False,
                                                add_generation_prompt=True, **FAMILIES[family].render_kwargs)
    if generation_prompt.endswith("<think>\n"):  # the template opens the reasoning: the model closes it
        think = "Let me think.\n</think>\n\n"
    if family == "gpt-oss":
        think = "<|channel|>final<|message|>"

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    call_end = tok.convert_tokens_to_ids(CALL_ENDS[family]) if family in CALL_ENDS else close_id
    first = (TOOL_CALLS[family] if family == "gpt-oss" else think + TOOL_CALLS[family]) if family in TOOL_CALLS \
        else think + "I will look it up."
    # one token per character: decode -> encode merges them, so only exact ids survive
    chars = [tok.convert_tokens_to_ids(c) for c in "Search"]
    turns = [enc(first) + [call_end], enc(think) + chars + enc(" it </search>") + enc(" ignored"),
             enc(think + "thinking " * 40), enc(think + "Leonardo da Vinci; 2+3 = 5.") + [close_id]]
    return lambda prompt, session, index: turns[index]


def _generator(family: str, retention: str):
    spec, tok = FAMILIES[family], family_tokenizer(family)
    kwargs = dict(spec.render_kwargs)  # hermes-3 needs `tools` (even []), mistral and gpt-oss a fixed date
    cfg = GeneratorConfig(max_turns=4, max_input_length=8192, show_progress=False, thinking_retention=retention,
                          chat_template_kwargs=kwargs,
                          sampling=GeneratorSamplingConfig(max_generate_length=24, stop=["</search>"]))
    chat = create_renderer(tok, "auto", kwargs, retention)
    engine = ScriptedEngine(_script(family, tok, chat.close_id), tok)
    registry = EnvRegistry()
    registry.register("conformance", lambda: ConformanceEnv(family))
    return StepwiseGenerator(tokenizer=tok, engine=engine, env_registry=registry, cfg=cfg), chat, engine


@pytest.mark.parametrize("retention", ["template", "all"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_conformance(family, retention):
    gen, chat, engine = _generator(family, retention)
    out = await gen.generate([PROMPT], ["conformance"], [{}], [TrajectoryID("q", 0)])
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 0 and len(out) == 4, m
    sampled = [list(call) for call in engine.sampled]
    for i in range(4):
        trained = [t for t, k in zip(out.response_ids[i], out.loss_masks[i]) if k]
        assert trained == sampled[i], f"{family} step {i}: trained ids differ from sampled ids"
        assert out.response_ids[i][:len(sampled[i])] == sampled[i]
    assert out.stop_reasons[2] == "length"
    observations = ["5" if family in TOOL_CALLS else "Observation 1: keep going.", "Observation 2: keep going.",
                    "Observation 3: keep going."]
    fallbacks = 0
    for i, obs in enumerate(observations):
        prev, nxt = out.prompt_token_ids[i] + out.response_ids[i], out.prompt_token_ids[i + 1]
        text = chat.decode(nxt[len(prev):] if nxt[:len(prev)] == prev else nxt)
        assert obs in text, f"{family}: observation {i + 1} lost"
        if nxt[:len(prev)] != prev:
            fallbacks += 1
            if chat.name.startswith("template"):  # the template really rewrites what was sampled
                assert not chat.decode(nxt).startswith(chat.decode(prev))
    assert m["generate/bridge_fallbacks"] == fallbacks
    assert sum(v for k, v in m.items() if k.startswith("generate/bridge_fallbacks/")) == fallbacks
    if retention == "all":
        assert fallbacks == 0, f"{family}: {m}"


# --- Tool calls on every family: each call as the family's own template renders it -------------------------------
# A turn is the text the template renders for an assistant message with `tool_calls` (after the generation prompt),
# cut at the first stop token, so no family needs a hand-written call format; templates that do not render calls
# get what their tools block asks for (hermes `<tool_call>` where we add the block; Granite 3.3's own).
CALC = "calculator"
TURNS = (  # (kind, content, [(name, arguments)])
    ("one_call", "", [(CALC, {"expression": "1200+34"})]),
    ("parallel_calls", "", [(CALC, {"expression": "4321*2"}), (CALC, {"expression": "999-1"})]),
    ("text_then_call", "I will compute it.", [(CALC, {"expression": "7000+77"})]),
    ("invalid_json", "", [(CALC, {"expression": "SKYRLBAD"})]),  # the value's quotes removed (or the call cut)
    ("unknown_tool", "", [("weather", {"city": "Paris"})]),
    ("invalid_arguments", "", [(CALC, {"expr": "1+1"})]),  # misses the required `expression`
    ("answer", "The answers are 1234, 8642, 998 and 7077.", []),
)
# what each turn's results start with (a parser that checks tools and schemas refuses the call itself: "Error: tool
# call not understood (unknown_tool)", where the executor says "Error: unknown tool 'weather'")
RESULTS = {"one_call": ["1234"], "parallel_calls": ["8642", "998"], "text_then_call": ["7077"],
           "invalid_json": ["Error: tool call not understood"], "unknown_tool": ["Error: "],
           "invalid_arguments": ["Error: "]}
# templates that do not render `tool_calls`: the format their tools block asks for
INSTRUCTED = {"granite-3.3": lambda calls: "<|tool_call|>" + json.dumps(
    [{"name": n, "arguments": a} for n, a in calls]),
    "lfm2": lambda calls: "<|tool_call_start|>[" + ", ".join(
        f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")" for n, a in calls)
    + "]<|tool_call_end|>"}
# families whose call format has no parser yet (issue 28 part A adds them): checked once it lands
AWAITING_PARSER: set[str] = set()
TOOL_PROMPT = [{"role": "system", "content": "You are a careful assistant."},
               {"role": "user", "content": "Compute 1200+34, 4321*2, 999-1 and 7000+77."}]


def _apply(tok, messages, add_generation_prompt, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k != "tools"}
    return tok.apply_chat_template(messages, tools=TOOL_SCHEMAS, tokenize=False,
                                   add_generation_prompt=add_generation_prompt, **kwargs)


def _assistant(content, calls, string_args=False):
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"type": "function", "id": f"call{i:05d}", "function": {
            "name": n, "arguments": json.dumps(a) if string_args else a}} for i, (n, a) in enumerate(calls)]
    return msg


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _rendered_turn(tok, kwargs, content, calls, chat) -> list[int] | None:
    """The ids the template renders for this assistant turn after the generation prompt (ids in common with it
    dropped), up to and including the first stop token, looking into the next message where the turn itself has
    none (GLM's <|observation|>); where no rendering has one (DeepSeek R1 closes no call turn), the renderer's close."""
    user = [{"role": "user", "content": "U"}]
    prompt_text = _apply(tok, user, True, kwargs)
    prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
    follow = {"role": "tool", "tool_call_id": "call00000", "name": CALC, "content": "R"} if calls else \
        {"role": "user", "content": "V"}
    unclosed = None
    for string_args, content in ((False, content), (True, content), (True, content or None)):  # R1: None
        for after in ([], [follow], [{"role": "user", "content": "V"}]):
            try:
                full = _apply(tok, user + [_assistant(content, calls, string_args)] + after, False, kwargs)
            except Exception:  # noqa: BLE001 - the template refuses this shape; try the next
                continue
            if full.startswith(prompt_text):  # the text after the generation prompt
                ids = tok(full[len(prompt_text):], add_special_tokens=False)["input_ids"]
            else:  # it rewrites the generation prompt (Gemma 4 drops an empty thought channel): the ids after it
                ids = tok(full, add_special_tokens=False)["input_ids"]
                ids = ids[_common_prefix(prompt, ids):]
            if calls and not all(n in chat.decode(ids) for n, _ in calls):
                break  # this template does not render the calls this way
            end = next((i for i, t in enumerate(ids) if t in chat.stop_ids), None)
            if end is not None and calls and not all(n in chat.decode(ids[:end]) for n, _ in calls):
                continue  # a final turn rendered as two (Nemotron Nano 2: its text, then its calls): not this way
            if end is not None:
                return ids[:end + 1]
            if not after:
                unclosed = ids + [chat.close_id]
    return unclosed


def _sampled_turn(family, tok, chat, kind, content, calls) -> list[int] | None:
    """What the scripted model samples for one turn; None where the template cannot hold it (parallel calls)."""
    kwargs = dict(FAMILIES[family].render_kwargs)
    if kind == "parallel_calls":  # only where the template renders two calls in one turn
        try:
            two = _apply(tok, [{"role": "user", "content": "U"}, _assistant("", calls)], False, kwargs)
        except Exception:  # noqa: BLE001
            return None
        if two.count(CALC) < 2:
            return None
    ids = _rendered_turn(tok, kwargs, content, calls, chat) if (calls or content) else None
    if calls and ids is None and content and _rendered_turn(tok, kwargs, "", calls, chat) is not None:
        return None  # the template renders calls only without text (DeepSeek R1)
    if calls and ids is None:  # the template does not render calls: what its tools block asks for
        emit = INSTRUCTED.get(family, lambda cs: "\n".join(
            "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in cs))
        ids = tok(((content + "\n") if content else "") + emit(calls), add_special_tokens=False)["input_ids"]
        ids.append(chat.close_id)
    if kind == "parallel_calls" and not all(a["expression"] in chat.decode(ids) for _, a in calls):
        return None  # the model stops after the first call (harmony's <|call|>): no parallel calls in one turn
    if kind == "invalid_json":
        text = chat.decode(ids)
        if '"SKYRLBAD"' in text:
            text = text.replace('"SKYRLBAD"', "SKYRLBAD")
        else:  # a format without JSON values (XML-style parameters): the call is cut after its value
            text = text[:text.index("SKYRLBAD") + len("SKYRLBAD")]
        last = ids[-1]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if not ids or ids[-1] != last:
            ids.append(last if last in chat.stop_ids else chat.close_id)
    return ids


TOOL_SCHEMAS = [CalculatorTool().schema]


class RecordingToolEnv(ToolEnv):
    """The real tool env, keeping each turn as parsed from the sampled ids."""

    def __init__(self, *args):
        super().__init__(*args)
        self.parsed = []

    async def step_turn(self, turn):
        self.parsed.append(turn)
        return await super().step_turn(turn)


def _tool_generator(family: str, retention: str):
    spec, tok = FAMILIES[family], family_tokenizer(family)
    kwargs = dict(spec.render_kwargs)
    chat = create_renderer(tok, "auto", kwargs, retention)
    turns = [(kind, ids) for kind, content, calls in TURNS
             if (ids := _sampled_turn(family, tok, chat, kind, content, calls)) is not None]
    engine = ScriptedEngine(lambda prompt, session, index: turns[index][1], tok)
    envs = []

    def make_env():
        envs.append(RecordingToolEnv({CALC: CalculatorTool()}, ToolEnvConfig(max_turns=len(turns))))
        return envs[-1]

    registry = EnvRegistry()
    registry.register("tool", make_env)
    cfg = GeneratorConfig(max_turns=len(turns), max_input_length=16384, show_progress=False,
                          thinking_retention=retention, chat_template_kwargs=kwargs,
                          sampling=GeneratorSamplingConfig(max_generate_length=256))
    return StepwiseGenerator(tokenizer=tok, engine=engine, env_registry=registry, cfg=cfg), chat, engine, turns, envs


async def run_tool_trajectory(family: str, retention: str):
    """One tool-calling trajectory on the family's real template; (output, renderer, sampled, turn kinds, parsed)."""
    gen, chat, engine, turns, envs = _tool_generator(family, retention)
    extras = {"reward_spec": {"ground_truth": {"target": ["1234"]}}}
    out = await gen.generate([TOOL_PROMPT], ["tool"], [extras], [TrajectoryID("q", 0)])
    return out, chat, [list(s) for s in engine.sampled], [k for k, _ in turns], envs[0].parsed


def observation_text(content: str) -> list[str]:
    """How a result can appear in a prompt: as is, or JSON-escaped (gpt-oss, Gemma 4 quote tool results)."""
    head = content[:40]
    return [head, json.dumps(head)[1:-1]]


@pytest.mark.parametrize("retention", ["template", "all"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_tool_calls(family, retention):
    """One call, two parallel calls (where the template renders them), text then a call, each malformed kind, then
    an answer: every call parsed to what was emitted, every result in the next prompt, trained ids = sampled ids,
    every malformed call answered, the trajectory not failed; a re-render only where the template rewrites."""
    if family in AWAITING_PARSER:
        pytest.skip(f"{family}: its call format has no parser yet (issue 28 part A)")
    out, chat, sampled, kinds, parsed = await run_tool_trajectory(family, retention)
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 0 and len(out) == len(kinds), (family, m)
    for i, kind in enumerate(kinds):
        trained = [t for t, k in zip(out.response_ids[i], out.loss_masks[i]) if k]
        assert trained == sampled[i], f"{family} {kind}: trained ids differ from sampled ids"
        if sampled[i][-1] in chat.stop_ids:  # the family's own turn end (<|call|>, <|observation|>, ...): nothing after
            assert out.response_ids[i] == sampled[i], (family, kind)
    emitted = {kind: calls for kind, _, calls in TURNS}
    for kind, turn, ids in zip(kinds, parsed, sampled):
        got = [(c.name, decode_arguments(c.arguments)[0]) for c in turn.tool_calls]
        if kind == "invalid_json":
            assert len(turn.tool_calls) == 1 and turn.tool_calls[0].error, (family, turn)
        else:  # an unknown tool or bad arguments may be refused by the parser already (it knows the schemas)
            refused = kind in ("unknown_tool", "invalid_arguments")
            assert got == emitted[kind] and all(refused or c.error is None for c in turn.tool_calls), \
                (family, kind, turn)
        sampled_text = chat.decode(ids)
        if kind == "text_then_call" and -1 < sampled_text.find("I will compute it.") < sampled_text.find(CALC):
            # (Mistral, Llama drop the text; Gemma 4 writes it after the call)
            # exactly the text before the call where the template renders calls (no separator it adds again)
            renders_calls = getattr(chat, "renders_tool_calls", True)
            text = (turn.content or turn.reasoning or "").split("</think>")[-1]  # harmony: text before a call is analysis
            assert (text.lstrip() == "I will compute it.") if renders_calls else \
                text.strip().startswith("I will compute it."), (family, turn)
    for i, kind in enumerate(kinds[:-1]):
        prev, nxt = out.prompt_token_ids[i] + out.response_ids[i], out.prompt_token_ids[i + 1]
        extended = nxt[:len(prev)] == prev
        new_text = chat.decode(nxt[len(prev):] if extended else nxt)
        for result in RESULTS[kind]:
            assert any(t in new_text for t in observation_text(result)), (family, kind, result, new_text[-400:])
        if kind == "invalid_json":  # a call no message can reproduce is never re-rendered
            assert extended, (family, kind, m)
        if not extended:  # a re-render only where the template really rewrites what was sampled
            assert not chat.decode(nxt).startswith(chat.decode(prev)), (family, kind)
        if extended and kind in ("one_call", "parallel_calls", "text_then_call"):  # no second copy of the call
            assert emitted[kind][-1][1]["expression"] not in new_text, (family, kind, new_text)
    assert m["environment/tool/calculator/ok"] * len(out) >= 3
    if retention == "all":
        assert m["generate/bridge_fallbacks"] == 0 or chat.name.startswith("renderers"), (family, m)


class SearchStyleEnv:
    """A Search-R1-style env that answers plain turns with `tool` messages (no call, no call id)."""

    async def reset(self, prompt, extras):
        return list(prompt)

    async def step(self, action_text):
        return StepResult([{"role": "tool", "content": "<information>Doc 1(Title: Mona Lisa) Leonardo.</information>"}],
                          0.0, False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_observations_go_in_a_role_the_template_renders(family):
    """Mistral, Gemma, Phi-3.5 and gpt-oss refuse or drop a `tool` message that answers no call: it is rendered
    as a user turn instead (merged where roles must alternate), counted, never dropped, never a failed batch."""
    spec, tok = FAMILIES[family], family_tokenizer(family)
    kwargs = dict(spec.render_kwargs)
    chat = create_renderer(tok, "auto", kwargs, "all")
    text = tok("I will search.", add_special_tokens=False)["input_ids"] + [chat.close_id]
    engine = ScriptedEngine(lambda prompt, session, index: text, tok)
    registry = EnvRegistry()
    registry.register("search", SearchStyleEnv)
    cfg = GeneratorConfig(max_turns=3, max_input_length=8192, show_progress=False, thinking_retention="all",
                          chat_template_kwargs=kwargs, sampling=GeneratorSamplingConfig(max_generate_length=32))
    gen = StepwiseGenerator(tokenizer=tok, engine=engine, env_registry=registry, cfg=cfg)
    out = await gen.generate([PROMPT], ["search"], [{}], [TrajectoryID("q", 0)])
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 0 and len(out) == 3, (family, m)
    assert m["generate/observation_role_fallbacks"] == (0 if chat.roles.tool_without_call else 2), (family, m)
    for i in range(2):
        assert "Leonardo." in chat.decode(out.prompt_token_ids[i + 1][len(out.prompt_token_ids[i]):]), family
        assert [t for t, k in zip(out.response_ids[i], out.loss_masks[i]) if k] == engine.sampled[i]
    if family in ("mistral-small-3.2", "gemma-4", "phi-3.5", "gpt-oss", "gemma-2"):  # the ones the issue names
        assert m["generate/observation_role_fallbacks"] == 2, (family, m)


class SeveralResultsEnv:
    """A Search-R1-style env answering each plain turn with two `tool` messages (no call, no call id), each turn's
    texts distinct: the shape two held-out templates refused (consecutive tool messages after a turn without
    calls) or dropped (Command R7B: a later turn's results after two earlier ones)."""

    def __init__(self):
        self.turn = 0

    async def reset(self, prompt, extras):
        return list(prompt)

    async def step(self, action_text):
        self.turn += 1
        return StepResult([{"role": "tool", "content": f"<information>Doc {i} of turn {self.turn}.</information>"}
                           for i in (1, 2)], 0.0, False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_several_observations_after_a_plain_turn_reach_every_later_prompt(family):
    """Issue 36 item 6: role probing covers every shape the generator sends (one and several tool messages, after
    a call and after none, first and later turns), so no shape fails the batch or loses a result."""
    spec, tok = FAMILIES[family], family_tokenizer(family)
    kwargs = dict(spec.render_kwargs)
    chat = create_renderer(tok, "auto", kwargs, "all")
    text = tok("I will search.", add_special_tokens=False)["input_ids"] + [chat.close_id]
    engine = ScriptedEngine(lambda prompt, session, index: text, tok)
    registry = EnvRegistry()
    registry.register("search", SeveralResultsEnv)
    cfg = GeneratorConfig(max_turns=3, max_input_length=8192, show_progress=False, thinking_retention="all",
                          chat_template_kwargs=kwargs, sampling=GeneratorSamplingConfig(max_generate_length=32))
    gen = StepwiseGenerator(tokenizer=tok, engine=engine, env_registry=registry, cfg=cfg)
    out = await gen.generate([PROMPT], ["search"], [{}], [TrajectoryID("q", 0)])
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 0 and len(out) == 3, (family, m)
    final = chat.decode(out.prompt_token_ids[2])
    assert all(f"Doc {i} of turn {t}." in final for i in (1, 2) for t in (1, 2)), (family, final[-600:])
    if family == "command-r7b":  # it drops a later turn's results: they go in the fallback role
        assert not chat.roles.tool_without_call and m["generate/observation_role_fallbacks"] == 4, m


def test_role_probing_routes_a_shape_a_template_refuses_to_the_fallback():
    """A template that refuses consecutive `tool` messages after a turn without calls (Ministral 3 Reasoning's
    rule, written here as its own check) but renders one: observations after no call go in the fallback role;
    those after a call stay tool messages."""
    from skyrl_stepwise.chat.base import probe_role_support
    from jinja2 import Template

    template = Template(
        "{% for m in messages %}{% if m.role == 'tool' and loop.previtem.role == 'tool' and "
        "not messages[loop.index0 - 2].tool_calls %}{{ raise_exception('consecutive tool messages') }}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}<call {{ c.function.name }}>{% endfor %}"
        "{% endfor %}")

    def render(messages):
        def fail(why):
            raise ValueError(why)
        return template.render(messages=messages, raise_exception=fail)

    support = probe_role_support(render)
    assert support.tool_after_call and not support.tool_without_call


def test_tool_turn_stop_tokens_come_from_the_template(tmp_path):
    """The token a call turn ends with is found by rendering one (GLM <|observation|>, harmony <|call|>, Llama 3.1's
    ipython <|eom_id|>, Gemma 4 <|tool_response>), never a token between two calls (DeepSeek's
    <｜tool▁call▁end｜>); GLM's plain turns end with the <|user|> that opens the next one."""

    def stops(family, renderer="template"):
        tok = family_tokenizer(family)
        chat = create_renderer(tok, renderer, dict(FAMILIES[family].render_kwargs))
        return {tok.convert_ids_to_tokens(i) for i in chat.stop_ids}, tok.convert_ids_to_tokens(chat.close_id)

    assert stops("glm-4.6") == ({"<|endoftext|>", "<|user|>", "<|observation|>"}, "<|user|>")
    assert stops("gpt-oss") == ({"<|return|>", "<|call|>"}, "<|return|>")
    assert stops("llama-3.1") == ({"<|eot_id|>", "<|eom_id|>"}, "<|eot_id|>")
    assert stops("gemma-4")[0] == {"<turn|>", "<|tool_response>"}
    assert stops("deepseek-v3.1")[0] == {"<｜end▁of▁sentence｜>"}
    assert stops("qwen2.5")[0] == {"<|im_end|>"}
    # a local model folder's generation_config.json adds the ids its model stops on (Llama 3.2: <|eom_id|>)
    tok = tokenizer_copy(family_tokenizer("llama-3.2"))
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eom, tok.eos_token_id]}))
    tok.name_or_path = str(tmp_path)
    assert eom not in create_renderer(family_tokenizer("llama-3.2"), "template").stop_ids
    assert eom in create_renderer(tok, "template").stop_ids


def test_a_template_without_system_role_gets_the_system_prompt_and_tools_in_the_first_user_turn():
    tok = family_tokenizer("gemma-2")
    chat = create_renderer(tok, "auto")
    assert not chat.roles.system
    text = chat.decode(chat.prompt_ids(TOOL_PROMPT, TOOL_SCHEMAS))
    assert text.startswith("<bos><start_of_turn>user\nYou are a careful assistant.\n\n# Tools"), text
    assert '"name": "calculator"' in text and text.endswith("Compute 1200+34, 4321*2, 999-1 and 7000+77.<end_of_turn>"
                                                             "\n<start_of_turn>model\n")


class _FixedObservationEnv:
    """One observation (the given text, as a user message) after each of two turns, then done."""

    def __init__(self, text: str) -> None:
        self.text, self.n = text, 0

    async def reset(self, prompt, extras):
        return list(prompt)

    async def step(self, action_text):
        self.n += 1
        return StepResult([] if self.n >= 3 else [{"role": "user", "content": self.text}], float(self.n >= 3),
                          self.n >= 3)


@pytest.mark.parametrize(("family", "retention"), [("qwen2.5", "template"), ("qwen3", "all")])
async def test_text_the_tokenizer_normalises_is_kept_and_extends_exactly(family, retention):
    """Decomposed accents (`a` + U+0308) in the prompt and in observations: Qwen's tokenizer encodes NFC, so the ids
    decode to another spelling than the template rendered. That is neither a lost observation (it failed the
    trajectory on `renderers` qwen3) nor a history rewrite (it re-rendered every turn on the Qwen2.5 template)."""
    tok = family_tokenizer(family)
    kwargs = dict(FAMILIES[family].render_kwargs)
    chat = create_renderer(tok, "auto", kwargs, retention)
    turn = tok("Noted.", add_special_tokens=False)["input_ids"] + [chat.close_id]
    engine = ScriptedEngine(lambda prompt, session, index: turn, tok)
    registry = EnvRegistry()
    registry.register("fixed", lambda: _FixedObservationEnv("Re\u0301sultat: a\u0308 \u00e4 \u8ba1\u7b97 \U0001f600"))
    cfg = GeneratorConfig(max_turns=3, max_input_length=4096, show_progress=False, thinking_retention=retention,
                          chat_template_kwargs=kwargs, sampling=GeneratorSamplingConfig(max_generate_length=16))
    gen = StepwiseGenerator(tokenizer=tok, engine=engine, env_registry=registry, cfg=cfg)
    prompt = [{"role": "user", "content": "Cafe\u0301 \u00fcber?"}]
    out = await gen.generate([prompt], ["fixed"], [{}], [TrajectoryID("q", 0)])
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 0 and m["generate/bridge_fallbacks"] == 0, m
    assert out.prompt_token_ids == [p for _, p in engine.calls]
    for i in range(2):
        prev = out.prompt_token_ids[i] + out.response_ids[i]
        assert out.prompt_token_ids[i + 1][:len(prev)] == prev
        assert "R\u00e9sultat" in chat.decode(out.prompt_token_ids[i + 1][len(prev):])
