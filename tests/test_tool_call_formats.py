"""Tool calls in each family's own format (chat/tool_formats/): the format is detected from what the family's real
template renders, and the calls the template renders (one call, two parallel calls) parse back to the same names
and arguments; malformed calls are kept with an error kind; an unknown format is refused at startup."""

from __future__ import annotations

import json
import os

import pytest
from family_tokenizers import FAMILIES, family_tokenizer, tokenizer_copy

from skyrl_stepwise.chat import create_renderer
from skyrl_stepwise.chat.template import TemplateRenderer
from skyrl_stepwise.chat.tool_formats import FORMATS, ToolParser
from skyrl_stepwise.chat.tool_formats.detect import UnknownToolFormat
from skyrl_stepwise.generator import GeneratorConfig

# family -> the format its template renders (or, without a rendering of calls, instructs; else our hermes block)
EXPECTED = {
    "qwen2.5": "hermes", "qwen3": "hermes", "hermes-3": "hermes", "smollm2": "hermes", "granite-4.0": "hermes",
    "gemma-2": "hermes", "phi-3.5": "hermes", "llama-3.1": "llama_json", "llama-3.2": "llama_json",
    "mistral-small-3.2": "mistral", "mistral-nemo": "mistral", "gpt-oss": "harmony", "glm-4.6": "glm",
    "granite-3.3": "granite", "gemma-4": "gemma4", "deepseek-r1-distill-qwen": "deepseek_v3",
    "deepseek-v3.1": "deepseek_v31", "qwen3-coder": "qwen_xml", "qwen3.5": "qwen_xml", "nemotron-3-nano": "qwen_xml",
    "minimax-m2": "minimax", "seed-oss": "seed_xml", "command-r7b": "command_r",
    "kimi-k2": "kimi_k2", "lfm2": "pythonic", "functionary-v3.1": "functionary", "firefunction-v2": "firefunction",
    "nemotron-nano-v2": "nemotron_toolcall", "smollm3": "hermes", "qwq-32b": "hermes",
    "apriel-1.6": "marked_json", "gigachat3.1": "marked_json", "minimax-m1": "marked_json", "lfm2.5-8b": "pythonic",
    "cohere2moe": "command_r",
    # issue 59: Llama 4 writes its JSON after <|python_start|><|python_end|>; Falcon-H1 asks for a Python dict in
    # <tool_call> tags; xLAM-2 writes a bare JSON list
    "llama-4": "llama_json", "falcon-h1": "hermes_dict", "xlam-2": "bare_json_list",
}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query"]}}},
         {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": {
             "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
# a string that reads as JSON ("2024") must stay a string where the schema says so
CALLS = [("search", {"query": "2024", "limit": 3}), ("calculator", {"expression": "2+3"})]
SINGLE_CALL = {"llama-3.1", "llama-3.2", "gpt-oss", "gigachat3.1"}  # their templates raise on or drop parallel calls


def unrendered_calls(fmt: str, calls) -> str:
    """What a model samples for `calls` where its template renders none (it is told the format in the prompt): our
    hermes block's format, Granite 3.3's `<|tool_call|>` list, LFM2's Python-syntax list, Falcon-H1's dict."""
    objects = [{"name": n, "arguments": a} for n, a in calls]
    if fmt == "granite":
        return "<|tool_call|>" + json.dumps(objects)
    if fmt == "hermes_dict":  # Falcon-H1's instructions: a Python dict, arguments first
        return "\n".join("<tool_call>\n" + repr({"arguments": a, "name": n}) + "\n</tool_call>" for n, a in calls)
    if fmt == "pythonic":
        return "<|tool_call_start|>[" + ", ".join(
            f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")" for n, a in calls) \
            + "]<|tool_call_end|>"
    assert fmt == "hermes", fmt
    return "\n".join("<tool_call>\n" + json.dumps(o) + "\n</tool_call>" for o in objects)


# one malformed call per format, as a model early in RL samples it -> the error kind it is answered with
MALFORMED = {
    "hermes": ('<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>', "invalid_json"),
    "llama_json": ('{"name": "search", "parameters": {"query": "x"', "invalid_json"),
    "mistral": ('[TOOL_CALLS]search[ARGS]{"query": ', "invalid_json"),
    "harmony": ("<|channel|>commentary to=functions.search <|constrain|>json", "unparsed_call_marker"),
    "glm": ("<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>x", "unclosed_block"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"query\"\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "invalid_json"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search{\"query\": \"x\"}<｜tool▁call▁end｜>"
                     "<｜tool▁calls▁end｜>", "malformed_structure"),
    # (a wrong type, `<parameter=limit>three</parameter>`, is well-formed: the executor's schema check answers it)
    "qwen_xml": ("<tool_call>\n<function=search>\n<parameter=limit>\n3\n</parameter>\n</tool_call>",
                 "malformed_structure"),
    "seed_xml": ("<seed:tool_call>\n<function=search>\n<parameter=query>x</parameter>\n</seed:tool_call>",
                 "malformed_structure"),
    "minimax": ('<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">x</parameter>\n',
                "unclosed_block"),
    "kimi_k2": ('<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>'
                '{"query": <|tool_call_end|><|tool_calls_section_end|>', "invalid_json"),
    "pythonic": ('<|tool_call_start|>[search(query="x"<|tool_call_end|>', "invalid_syntax"),
    "functionary": ('<function=search>{"query": "x"', "unclosed_block"),
    "firefunction": (' functools[{"name": "search", "arguments": {"query": "x"}', "invalid_json"),
    "nemotron_toolcall": ('<TOOLCALL>[{"arguments": {"query": "x"}}]</TOOLCALL>', "missing_name"),
    "gemma4": ('<|tool_call>call:search{query:<|"|>x}<tool_call|>', "malformed_structure"),
    "command_r": ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "search", "parameters": {"query": "x"}]'
                  "<|END_ACTION|>", "invalid_json"),
    "granite": ('<|tool_call|>[{"arguments": {"query": "x"}}]', "missing_name"),
    "hermes_dict": ("<tool_call>\n{'arguments': {'query': 'x'}, 'name': 'search'\n</tool_call>", "malformed_structure"),
    "bare_json_list": ('[{"name": "search", "arguments": {"query": "x"}}', "invalid_json"),
}


def _renderer(family: str) -> TemplateRenderer:
    return TemplateRenderer(family_tokenizer(family), dict(FAMILIES[family].render_kwargs), "all")


def _sampled_call_turn(family: str, chat: TemplateRenderer, calls) -> list[int]:
    """The ids a model of this family samples for an assistant turn with `calls`: the template's own rendering of
    that turn after the generation prompt, up to the first token after the last call that ends the turn."""
    spec, tok = FAMILIES[family], family_tokenizer(family)
    user = [{"role": "user", "content": "Find the 2024 winner and add 2+3."}]
    arguments = (lambda a: json.dumps(a)) if chat.string_arguments else (lambda a: a)
    turn = {"role": "assistant", "content": None if chat.string_arguments else "", "tool_calls": [
        {"type": "function", "id": f"call0000{i}", "function": {"name": n, "arguments": arguments(a)}}
        for i, (n, a) in enumerate(calls)]}
    kwargs = {**spec.render_kwargs, "tools": TOOLS}
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kwargs)
    full = tok.apply_chat_template(user + [turn], tokenize=False, add_generation_prompt=False, **kwargs)
    # after the shared prefix: a generation prompt that opens a think block (Gemma 4, Qwen3.5) renders none for
    # a past call turn, and the model's call text is the same either way
    shared = len(os.path.commonprefix([prompt, full]))
    while shared and full[shared - 1] not in ">\n":  # not inside a marker both share the start of (`<|`)
        shared -= 1
    text = full[shared:]
    last_call = text.rfind(calls[-1][0])
    ends = {t: i for t in set(tok.convert_ids_to_tokens(sorted(chat.stop_ids))) | set(spec.turn_terminators)
            if (i := text.find(t, last_call)) >= 0}
    if not ends:  # the template closes the turn only when a later message follows (GLM, DeepSeek R1)
        return tok(text, add_special_tokens=False)["input_ids"] + [chat.close_id]
    stop = min(ends, key=ends.get)
    return tok(text[:ends[stop]], add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(stop)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_detection_picks_the_family_format(family):
    chat = _renderer(family)
    assert chat.tool_parser.name == EXPECTED[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("n_calls", [1, 2])
def test_calls_parse_as_the_template_renders_them(family, n_calls):
    if n_calls == 2 and family in SINGLE_CALL:
        pytest.skip("the template renders one call per turn")
    chat, tok = _renderer(family), family_tokenizer(family)
    calls = CALLS[:n_calls]
    if chat.renders_tool_calls:
        ids = _sampled_call_turn(family, chat, calls)
    else:  # the template shows the format only in its instructions (Granite 3.3) or not at all (our hermes block)
        text = unrendered_calls(chat.tool_parser.name, calls)
        ids = tok(text, add_special_tokens=False)["input_ids"] + [chat.close_id]
    turn = chat.parse(ids, [], TOOLS)
    parsed = [(c.name, json.loads(c.arguments) if isinstance(c.arguments, str) else c.arguments, c.error)
              for c in turn.tool_calls]
    assert parsed == [(n, a, None) for n, a in calls], chat.decode(ids)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_calls_are_kept_with_their_kind(name, tokenizer):
    text, kind = MALFORMED[name]
    parser = ToolParser(FORMATS[name], tokenizer)
    content, calls = parser.parse(tokenizer(text, add_special_tokens=False)["input_ids"],
                                  lambda ids: tokenizer.decode(ids, skip_special_tokens=False), TOOLS)
    assert [c.error for c in calls] == [kind], calls
    assert calls[0].expected_format == FORMATS[name].expected_format and calls[0].raw


def test_every_format_has_a_malformed_case():
    assert set(MALFORMED) == set(FORMATS)


def test_library_parser_reads_single_token_markers():
    """DeepSeek V3/R1 calls through the `renderers` token-level parser where the markers are single tokens."""
    tok = family_tokenizer("deepseek-v3.1")
    parser = ToolParser(FORMATS["deepseek_v3"], tok)
    assert parser._library is not None
    text = ("Let me look. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
            '{"query": "x"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    content, calls = parser.parse(tok(text, add_special_tokens=False)["input_ids"],
                                  lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert content == "Let me look. " and [(c.name, c.arguments, c.error) for c in calls] == [
        ("search", {"query": "x"}, None)]


def test_a_call_marker_that_yields_no_call_is_a_malformed_call(tokenizer):
    """A turn that opens a call the parser cannot read is answered, never taken for the final answer."""
    parser = ToolParser(FORMATS["llama_json"], tokenizer)
    content, calls = parser.parse(tokenizer("<|python_tag|>search for it", add_special_tokens=False)["input_ids"],
                                  lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    assert content == "" and [c.error for c in calls] == ["unparsed_call_marker"]


UNKNOWN_FORMAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<<CALL {{ c.function.name }}({{ c.function.arguments | tojson }})>>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_unknown_call_format_is_refused_at_startup(tokenizer):
    tok = tokenizer_copy(tokenizer)
    tok.chat_template = UNKNOWN_FORMAT_TEMPLATE
    with pytest.raises(UnknownToolFormat) as refused:
        create_renderer(tok, "template")
    message = str(refused.value)
    assert repr(tok.name_or_path) in message and "generator.tool_parser" in message
    assert "<<CALL skyrl_probe_call(" in message
    # the first 80 characters of the probe call's rendering, no more
    quoted = message.split("reads: ")[1].split("; set ")[0]
    assert 0 < len(eval(quoted)) <= 80  # noqa: S307 - the repr of a str we wrote
    # the user names the format: accepted
    assert create_renderer(tok, "template", tool_parser="hermes").tool_parser.name == "hermes"


def test_tool_parser_key_is_validated():
    with pytest.raises(ValueError, match="generator.tool_parser='nope'"):
        GeneratorConfig(tool_parser="nope").validate()
    GeneratorConfig(tool_parser="glm").validate()


def test_library_renderer_answers_a_call_its_parser_reads_as_the_final_answer():
    """`renderers`' Llama 3 parser takes a call whose JSON does not decode for the final answer; the family's own
    format reader makes it a malformed call, so it is answered and the episode goes on."""
    tok = family_tokenizer("llama-3.2")
    chat = create_renderer(tok, "auto")
    assert chat.name == "renderers:llama-3"
    sampled = tok('{"name": "search", "parameters": {"query": "x"', add_special_tokens=False)["input_ids"]
    turn = chat.parse(sampled + [tok.convert_tokens_to_ids("<|eot_id|>")], [], TOOLS)
    assert [(c.error, c.expected_format) for c in turn.tool_calls] == [
        ("invalid_json", FORMATS["llama_json"].expected_format)]
    # a plain answer stays the final answer
    plain = tok("The answer is 5.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|eot_id|>")]
    assert chat.parse(plain, [], TOOLS).tool_calls == []


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_auto_picks_the_library_renderer_a_local_folder_renders_like():
    """A model the library does not know by name (a local folder) gets the renderer that renders what its template
    renders, as its hub name would; a template no renderer reproduces keeps the template."""

    local = {}
    for family, expected in (("qwen3", "renderers:qwen3"), ("nemotron-3-nano", "renderers:nemotron-3"),
                             ("qwen2.5", "template:/models/qwen2.5")):
        local[family] = tok = tokenizer_copy(family_tokenizer(family))
        tok.name_or_path = tok.init_kwargs["name_or_path"] = f"/models/{family}"
        assert create_renderer(tok, "auto").name == expected
    # an explicit tool parser keeps the template backend it applies to
    assert create_renderer(local["qwen3"], "auto", tool_parser="hermes").name == "template:/models/qwen3"


@pytest.mark.parametrize(("family", "stops", "not_stops"), [
    ("gemma-4", {"<|tool_response>"}, {"<tool_call|>"}),  # each call has its closer: stop after the last one
    ("seed-oss", {"<seed:eos>"}, {"</seed:tool_call>"}),
    ("command-r7b", {"<|END_ACTION|>"}, set()),  # one block holds every call: its closer ends the call turn
    ("gpt-oss", {"<|call|>"}, set()),
])
def test_a_call_turn_stops_after_its_last_call(family, stops, not_stops):
    chat = _renderer(family)
    names = set(family_tokenizer(family).convert_ids_to_tokens(sorted(chat.stop_ids)))
    assert stops <= names and not (not_stops & names), names


@pytest.mark.parametrize("retention", ["template", "all"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_call_in_the_family_format_is_answered(family, retention):
    """The template-rendered call is parsed, run, and its result reaches the next prompt, which extends the sampled
    ids unless the template rewrites the history (then re-rendered, with the reason)."""
    from skyrl_stepwise.chat import conversation_turn
    from skyrl_stepwise.tools import ToolExecutor, to_messages
    from skyrl_stepwise.tools.builtin import CalculatorTool

    tok, calculator = family_tokenizer(family), CalculatorTool()
    chat = TemplateRenderer(tok, dict(FAMILIES[family].render_kwargs), retention)
    question, tools = [{"role": "user", "content": "What is 2+3?"}], [calculator.schema]
    prompt = chat.prompt_ids(question, tools)
    if chat.renders_tool_calls:
        sampled = _sampled_call_turn(family, chat, [("calculator", {"expression": "2+3"})])
    else:
        text = unrendered_calls(chat.tool_parser.name, [("calculator", {"expression": "2+3"})])
        sampled = tok(text, add_special_tokens=False)["input_ids"] + [chat.close_id]
    turn = chat.parse(sampled, prompt, tools)
    results = await ToolExecutor({"calculator": calculator}).execute(turn.tool_calls)
    assert [r.content for r in results] == ["5"]
    # in roles the template renders, as the generator sends them (Phi-3.5 and Gemma 2 get the result as a user turn)
    conversation = conversation_turn(turn, to_messages(results), chat.roles)
    observations = conversation.observations
    nxt = chat.next_prompt(prompt, sampled, question + [conversation.assistant] + observations, observations, tools)
    chain = prompt + sampled
    assert nxt.extended == (nxt.ids[:len(chain)] == chain)
    assert "5" in chat.decode(nxt.ids[len(chain):] if nxt.extended else nxt.ids)
    if retention == "all":
        assert nxt.extended, nxt.reason


def test_a_template_that_ignores_tools_is_told_its_own_call_format():
    """DeepSeek V3.1's template renders calls but not tool schemas: the schemas go in a system block that asks for
    calls in the format the template renders (and the parser reads), not hermes."""
    chat = _renderer("deepseek-v3.1")
    assert not chat.renders_tools and chat.renders_tool_calls
    text = chat.render([{"role": "user", "content": "Q"}], True, TOOLS)
    assert FORMATS["deepseek_v31"].expected_format in text and '"name": "search"' in text
    assert "<tool_call>" not in text


# --- Arguments as written: every family's own rendering of a call parses back to exactly its arguments ------------
EDIT_SCHEMA = {"type": "function", "function": {"name": "edit", "description": "Replace text in a file.",
                                                "parameters": {"type": "object", "properties": {
        "old_str": {"type": "string"}, "new_str": {"type": "string"}, "count": {"type": "integer"},
        "note": {"type": ["string", "null"]},  # OpenAI strict mode's optional field
        "mode": {"enum": ["fast", "2024"]},  # an enum without `type`
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
    "required": ["old_str", "new_str"], "additionalProperties": False}}}
EDIT_TOOLS = [EDIT_SCHEMA]
# leading spaces, a trailing newline, inner blank lines, JSON-looking strings: each must come back byte for byte
VERBATIM = {"old_str": "    return x\n", "new_str": "\n\n    return  y\n\n\n  # done\n", "count": 2, "note": "2024",
            "mode": "2024", "either": "null"}


def _edit_call_ids(family: str, chat: TemplateRenderer, calls) -> list[int]:
    """The sampled ids of a turn with `calls` on `edit`-like tools: the template's own rendering, or where it renders
    no calls the JSON its instructions ask for."""
    if chat.renders_tool_calls:
        return _sampled_call_turn(family, chat, calls)
    tok = family_tokenizer(family)
    text = unrendered_calls(chat.tool_parser.name, calls)
    return tok(text, add_special_tokens=False)["input_ids"] + [chat.close_id]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_argument_parses_back_exactly_as_rendered(family):
    """Issue 36 items 1-2: whitespace included (Qwen3-Coder's XML parser stripped `    return x\\n` to `return x`),
    and a value stays a string wherever its schema admits one (a nullable string, an untyped enum, anyOf)."""
    chat = _renderer(family)
    ids = _edit_call_ids(family, chat, [("edit", VERBATIM)])
    turn = chat.parse(ids, [], EDIT_TOOLS)
    got = [(c.name, json.loads(c.arguments) if isinstance(c.arguments, str) else c.arguments, c.error)
           for c in turn.tool_calls]
    assert got == [("edit", VERBATIM, None)], chat.decode(ids)


class _Edit:
    name, schema, config_class = "edit", EDIT_SCHEMA, None

    async def call(self, arguments):
        return "edited"


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_schema_mistakes_get_the_executors_message(family):
    """A wrong type and an unknown tool are answered with the schema's and the lookup's message (not "the call is
    not valid JSON": an XML call holds no JSON); a nullable string is a well-formed call that runs."""
    from skyrl_stepwise.tools import ToolExecutor

    chat = _renderer(family)
    executor = ToolExecutor({"edit": _Edit()})
    cases = [  # (call, what the answer must say)
        (("edit", {"old_str": "a", "new_str": "b", "count": "five"}), "'five' is not of type 'integer'"),
        (("edit", {"old_str": "a", "new_str": "b", "note": "maybe"}), "edited"),
        (("weather", {"city": "Paris"}), "unknown tool 'weather'"),
    ]
    for call, expected in cases:
        ids = _edit_call_ids(family, chat, [call])
        results = await executor.execute(chat.parse(ids, [], EDIT_TOOLS).tool_calls)
        assert len(results) == 1 and expected in results[0].content, (family, call, results)


@pytest.mark.parametrize("family", ["nemotron-3-nano", "minimax-m2"])
async def test_library_renderers_read_xml_values_as_written(family):
    """The `renderers` library's XML readers strip values and refuse text where the schema wants no string: the
    family's own reader re-reads its calls (values as written, a wrong type answered by the schema check)."""
    from skyrl_stepwise.tools import ToolExecutor

    tok = family_tokenizer(family)
    chat = create_renderer(tok, "auto", dict(FAMILIES[family].render_kwargs))
    assert chat.name.startswith("renderers:")
    user = [{"role": "user", "content": "U"}]
    for arguments, expected in ((VERBATIM, "edited"), ({"old_str": "a", "new_str": "b", "count": "five"},
                                                       "'five' is not of type 'integer'")):
        messages = user + [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call00000", "function": {"name": "edit", "arguments": arguments}}]}]
        turn = chat.parse(chat.turn_ids(messages, 1, EDIT_TOOLS).ids, chat.prompt_ids(user, EDIT_TOOLS), EDIT_TOOLS)
        assert [(c.name, c.arguments, c.error) for c in turn.tool_calls] == [("edit", arguments, None)]
        results = await ToolExecutor({"edit": _Edit()}).execute(turn.tool_calls)
        assert expected in results[0].content, results


# Real templates whose call format no parser reads (tests/templates/refused/, sources in tests/templates/README.md):
# each is refused when the renderer is built, naming the model, the rendered call and generator.tool_parser; never
# served with a parser that would take every call for a final answer.
REFUSED = {  # template -> what the refusal quotes of its probe call's rendering
    "deepseek-v3.2": "<｜DSML｜function_calls>",  # DSML invoke/parameter markup
    "apertus-8b": '<|tools_prefix|>[{"skyrl_probe_call":',  # {name: arguments} objects
    "functionary-v3.2": ">>>skyrl_probe_call",  # >>>name\n{json}
    "command-r-plus": r"Action:\n```json",  # a fenced JSON list after "Action:" (quoted: \n as written)
    "lfm2.5": "null<|im_end|>",  # renders no calls and lists tools without LFM2's markers: the format is unknown
    # the template raises on every call turn (list.append in the transformers sandbox): the refusal names the error
    "kimi-k2-instruct": "SecurityError: access to attribute 'append'",
    # think/response stubs come first: the quote starts near the call, so the call is shown
    "kimi-k3": 'call tool="skyrl_probe_call"',
    # JSON after a marker, but in a role turn the model would open after its own stop token: not marked_json
    "gigachat3": "function call<|role_sep|>",
    "solar-open": "<|tool_call:begin|>call00000<|tool_call:name|>skyrl_probe_call",  # id, name, args as tokens
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_real_templates_in_an_unread_format_are_refused_at_startup(name, tokenizer):
    from pathlib import Path

    tok = tokenizer_copy(tokenizer)
    tok.chat_template = (Path(__file__).parent / "templates" / "refused" / f"{name}.jinja").read_text(encoding="utf-8")
    tok.name_or_path = f"/models/{name}"
    with pytest.raises(UnknownToolFormat) as refused:
        create_renderer(tok, "auto", {"strftime_now": lambda fmt: "2025-01-15"})
    message = str(refused.value)
    assert f"'/models/{name}'" in message and "generator.tool_parser" in message
    assert REFUSED[name] in message, message


@pytest.mark.parametrize("arguments", ["a=1+2j", "a={1, 2}", 'a=b"x"', "a={1: 2}", "a={[1]: 2}", "a={**x}", "a=x"])
def test_pythonic_arguments_that_are_not_json_are_invalid_not_a_crash(arguments):
    """A Python literal JSON cannot hold (complex, set, bytes, non-string keys) or no literal at all is the call's
    invalid_arguments, answered like any malformed call; it never raises out of the parser or reaches a tool."""
    from skyrl_stepwise.chat.tool_formats.pythonic import parse_pythonic_text

    _, [call] = parse_pythonic_text(f"<|tool_call_start|>[search({arguments})]<|tool_call_end|>")
    assert (call.name, call.arguments, call.error) == ("search", None, "invalid_arguments")


def test_marked_json_calls_and_their_malformed_forms():
    """The marked_json reader (marker probed from the template): a list or consecutive objects after the marker are
    calls; a value that does not decode is invalid_json; the marker with no value is answered, never an answer."""
    from skyrl_stepwise.chat.tool_formats.marked_json import marked_json_format

    before = "<u>U</u><a>"
    fmt = marked_json_format(before, before + '<tool_calls>\n{"name": "skyrl_probe_call", "arguments": '
                             '{"skyrl_probe_arg": 1}}\n</tool_calls></a>')
    assert fmt is not None and fmt.markers == ("<tool_calls>",) and fmt.expected_format.endswith("</tool_calls>")
    content, calls = fmt.parse_text('Let me.<tool_calls>\n{"name": "a", "arguments": {"x": 1}}\n'
                                    '{"name": "b", "arguments": {}}\n</tool_calls>', None)
    assert content == "Let me." and [(c.name, c.arguments, c.error) for c in calls] == [
        ("a", {"x": 1}, None), ("b", {}, None)]
    _, [bad] = fmt.parse_text('<tool_calls>{"name": "a", "arguments": {"x": </tool_calls>', None)
    assert bad.error == "invalid_json"
    # JSON that does not open the call turn (a role header after the turn's end before it) is not this format
    assert marked_json_format(before, before + '</a><f>call:\n{"name": "skyrl_probe_call", "arguments": {}}') is None


TOOLS_BREAK_TEMPLATE = (  # llama.cpp's deepseek-r1 template's construct: `map` yields a generator tojson refuses
    "{% if tools %}Tools: {{ tools | map(attribute='function') | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_fails_on_tools_is_never_given_them(tokenizer):
    """A template that raises whenever `tools=` is passed is rendered without them (our tools block in the format
    it renders calls in): the first prompt of a rollout renders instead of failing every trajectory."""

    tok = tokenizer_copy(tokenizer)
    tok.chat_template = TOOLS_BREAK_TEMPLATE
    chat = create_renderer(tok, "template")
    assert not chat.renders_tools and chat.renders_tool_calls and chat.tool_parser.name == "hermes"
    text = chat.decode(chat.prompt_ids(TOOL_PROMPT_MESSAGES, TOOLS))
    assert '"name": "search"' in text and text.endswith("<|im_start|>assistant\n")


TOOL_PROMPT_MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


# --- Issue 59: the start-up round trip (detect.py): a format is chosen only where its reader reads the template's
# own probe calls back, names and arguments, the two-call turn included; else the run is refused, naming it all
JSON_CALLS_TEMPLATE = (  # Llama 3's JSON objects, written {prefix}{call}{sep}{call}...: llama_json's pattern matches
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{{ PREFIX if m.tool_calls else '' }}"
    "{% for c in m.tool_calls or [] %}{{ SEP if not loop.first else '' }}{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _json_calls_tokenizer(tokenizer, prefix: str, sep: str):
    tok = tokenizer_copy(tokenizer)
    tok.chat_template = JSON_CALLS_TEMPLATE.replace("PREFIX", repr(prefix)).replace("SEP", repr(sep))
    tok.name_or_path = "/models/json-calls"
    return tok


def test_a_format_whose_reader_does_not_read_the_rendered_call_back_is_refused(tokenizer):
    """Text before the JSON (not a marker of its own: several words) is content to llama_json's reader, so every
    call would be a final answer (the Llama 4 failure): refused at startup, naming the format, the rendered turn and
    what it parsed as. Before the round trip this template was served as llama_json, silently."""
    from skyrl_stepwise.chat.tool_formats.detect import ToolFormatRoundTripFailed

    tok = _json_calls_tokenizer(tokenizer, "I will call it now ", "")
    with pytest.raises(ToolFormatRoundTripFailed) as refused:
        create_renderer(tok, "template")
    message = str(refused.value)
    assert "'/models/json-calls'" in message and "'llama_json'" in message and "generator.tool_parser" in message
    assert 'I will call it now {"name": "skyrl_probe_call", "parameters": {"skyrl_probe_arg": 1}}' in message
    assert "parsed as [] (name, arguments, error), not [('skyrl_probe_call', {'skyrl_probe_arg': 1})]" in message
    # the user can still name a format: taken as named
    assert create_renderer(tok, "template", tool_parser="llama_json").tool_parser.name == "llama_json"


def test_parallel_calls_the_reader_misreads_are_refused(tokenizer):
    """One call reads back, two joined by `|` do not (the second is invalid_json): the two-call turn is checked too,
    since a model of this template writes parallel calls that way."""
    from skyrl_stepwise.chat.tool_formats.detect import ToolFormatRoundTripFailed

    tok = _json_calls_tokenizer(tokenizer, "", "|")
    with pytest.raises(ToolFormatRoundTripFailed, match="invalid_json"):
        create_renderer(tok, "template")
    assert create_renderer(_json_calls_tokenizer(tokenizer, "", ";"), "template").tool_parser.name == "llama_json"


def test_the_first_candidate_that_reads_back_is_chosen(tokenizer):
    """`CALL: {...}`: llama_json's pattern matches first but its reader takes the turn for text; marked_json (the
    template's own marker) reads it back, so it is chosen, and the calls the template renders parse."""
    chat = create_renderer(_json_calls_tokenizer(tokenizer, "CALL: ", ""), "template")
    assert chat.tool_parser.name == "marked_json" and chat.tool_parser.format.markers == ("CALL:",)
    user = [{"role": "user", "content": "U"}]
    turn = chat.turn_ids(user + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call00000", "function": {"name": "search", "arguments": {"query": "x"}}}]}],
        1, TOOLS)
    assert [(c.name, c.arguments) for c in chat.parse(turn.ids, [], TOOLS).tool_calls] == [("search", {"query": "x"})]


def test_llama4_calls_parse_after_its_python_block():
    """Llama 4's template writes `<|python_start|>{text}<|python_end|>` then the calls back to back: the turn's text
    is the block's, the calls all parse (were: every call taken for the final answer)."""
    tok, chat = family_tokenizer("llama-4"), _renderer("llama-4")
    text = ('<|python_start|>Let me look.<|python_end|>{"name": "search", "parameters": {"query": "x"}}'
            '{"name": "calculator", "parameters": {"expression": "2+3"}}')
    turn = chat.parse(tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|eot|>")], [],
                      TOOLS)
    assert turn.content == "Let me look." and [(c.name, c.arguments, c.error) for c in turn.tool_calls] == [
        ("search", {"query": "x"}, None), ("calculator", {"expression": "2+3"}, None)]
    # calls inside the block (as vLLM's Llama 4 parser also reads them), and an empty block: a malformed call
    inside = chat.parse(tok('<|python_start|>{"name": "search", "parameters": {"query": "x"}}<|python_end|>',
                            add_special_tokens=False)["input_ids"], [], TOOLS)
    assert [(c.name, c.arguments) for c in inside.tool_calls] == [("search", {"query": "x"})]
    empty = chat.parse(tok("<|python_start|>search it<|python_end|>", add_special_tokens=False)["input_ids"], [],
                       TOOLS)
    assert [c.error for c in empty.tool_calls] == ["unparsed_call_marker"]


def test_a_template_that_renders_no_calls_is_refused_naming_what_it_rendered():
    """Falcon-H1's template with its call instructions in a format no parser reads: the refusal says the template
    renders no calls (quoting the empty call turn as such, not as a call) and quotes the instructions' end."""

    tok = tokenizer_copy(family_tokenizer("falcon-h1"))
    tok.chat_template = tok.chat_template.replace("{'arguments': <args-dict>, 'name': <function-name>}",
                                                  "CALL <function-name> WITH <args>")
    with pytest.raises(UnknownToolFormat) as refused:
        create_renderer(tok, "template")
    message = str(refused.value)
    assert "renders tool schemas but no tool calls" in message and "without the call" in message
    assert "'<|im_start|>assistant\\n<|im_end|>'" in message  # the probe call's turn, as rendered
    assert "<tool_call>\\nCALL <function-name> WITH <args>\\n</tool_call>" in message  # the instructions' end


def test_the_round_trip_refuses_llama4_with_a_reader_that_refuses_its_prefix(monkeypatch):
    """The check that would have caught the silent Llama 4 failure: with the Llama 3 reader (it takes a turn that
    opens with `<|python_start|>` for text), Llama 4's template is refused at startup, naming the format and the
    rendered call, instead of served with every call taken for the final answer."""
    from dataclasses import replace

    from skyrl_stepwise.chat.tool_formats import FORMATS as formats
    from skyrl_stepwise.chat.tool_formats.detect import ToolFormatRoundTripFailed
    from skyrl_stepwise.chat.tool_formats.llama_json import parse_llama_json_text

    def llama3_only(text, tools=None):
        return (text, []) if text.lstrip().startswith("<|python_start|>") else parse_llama_json_text(text, tools)

    monkeypatch.setitem(formats, "llama_json", replace(formats["llama_json"], parse_text=llama3_only))
    with pytest.raises(ToolFormatRoundTripFailed) as refused:
        _renderer("llama-4")
    message = str(refused.value)
    assert "'llama_json'" in message and "'meta-llama/Llama-4-Scout-17B-16E-Instruct'" in message
    assert '<|python_start|><|python_end|>{"name": "skyrl_probe_call", "parameters": {"skyrl_probe_arg": 1}}' in message


def test_a_library_renderer_whose_parser_misses_its_own_calls_is_not_served(monkeypatch):
    """The round trip runs for the `renderers` library's format too: a parser that reads the library's own probe
    call as text refuses the named renderer at startup and, with `auto`, leaves the model's template (proved the
    same way) to serve it."""
    from skyrl_stepwise.chat.base import ParsedTurn
    from skyrl_stepwise.chat.library import LibraryRenderer

    tok = family_tokenizer("llama-3.2")
    assert create_renderer(tok, "llama-3").name == "renderers:llama-3"
    monkeypatch.setattr(LibraryRenderer, "parse", lambda self, ids, prompt, tools=None: ParsedTurn(self.decode(ids)))
    with pytest.raises(ValueError, match=r"renderers:llama-3 renders tool calls .* its parser does not read back"):
        create_renderer(tok, "llama-3")
    chat = create_renderer(tok, "auto")
    assert chat.name == "template:meta-llama/Llama-3.2-3B-Instruct" and chat.tool_parser.name == "llama_json"
