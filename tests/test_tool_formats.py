"""Tool calls in the four formats users bring: parse the sampled ids -> execute -> `tool` message -> bridge.
The assistant turn that made the calls stays as sampled and the next prompt extends it; malformed calls are
answered, never raised."""

from __future__ import annotations

import pytest
from family_tokenizers import FAMILIES, family_tokenizer

from skyrl_stepwise.chat import create_renderer
from skyrl_stepwise.tools import ToolExecutor, to_messages
from skyrl_stepwise.tools.builtin import CalculatorTool

TOOLS = [CalculatorTool().schema]
QUESTION = [{"role": "user", "content": "What is 6*7?"}]
# family -> (renderer backend expected from `auto`, a good call, a malformed call) as the model would sample them
FORMATS = {
    "qwen3": ("renderers:qwen3", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
              '<tool_call>\n{"name": "calculator", "arguments": {"expression": 6}}\n</tool_call>'),
    "llama-3.1": ("renderers:llama-3", '{"name": "calculator", "parameters": {"expression": "6*7"}}',
                  '{"name": "weather", "parameters": {}}'),
    "gpt-oss": ("template", '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>'
                '{"expression": "6*7"}', '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>'
                '{"expression": '),
    # tokenizer v13: the model samples no [CALL_ID], the template renders one into the history
    "mistral-small-3.2": ("template", '[TOOL_CALLS]calculator[ARGS]{"expression": "6*7"}',
                          '[TOOL_CALLS]calculator[ARGS]{"expression": "6*'),
}


def _setup(family):
    spec, tok = FAMILIES[family], family_tokenizer(family)
    # gpt-oss's template moves a sampled call's recipient, Mistral's adds a [CALL_ID] the model did not sample:
    # offline (template backend) only `all` keeps the turn
    retention = "all" if family in ("gpt-oss", "mistral-small-3.2") else "template"
    chat = create_renderer(tok, "auto", dict(spec.render_kwargs), retention)
    assert stop_of(family, tok) in chat.stop_ids
    return tok, chat, stop_of(family, tok)


def stop_of(family, tok) -> int:
    """The token a real model of this family samples to end a tool-calling turn."""
    return tok.convert_tokens_to_ids({"gpt-oss": "<|call|>", "llama-3.1": "<|eom_id|>",
                                      "mistral-small-3.2": "</s>"}.get(family, "<|im_end|>"))


@pytest.mark.parametrize("family", sorted(FORMATS))
async def test_parse_execute_answer_bridge(family):
    tok, chat, stop = _setup(family)
    backend, good, bad = FORMATS[family]
    assert chat.name.startswith(backend)
    prompt = chat.prompt_ids(QUESTION, TOOLS)
    assert "calculator" in chat.decode(prompt)  # the schema is rendered for the model
    sampled = tok(good, add_special_tokens=False)["input_ids"] + [stop]
    turn = chat.parse(sampled, prompt, TOOLS)
    assert [(c.name, c.arguments, c.error) for c in turn.tool_calls] == [("calculator", {"expression": "6*7"}, None)]

    executor = ToolExecutor({"calculator": CalculatorTool()})
    results = await executor.execute(turn.tool_calls)
    observations = to_messages(results)
    assert observations[0]["role"] == "tool" and observations[0]["content"] == "42"
    history = QUESTION + [turn.message()] + observations
    nxt = chat.next_prompt(prompt, sampled, history, observations, TOOLS)
    assert nxt.ids[:len(prompt) + len(sampled)] == prompt + sampled  # the calling turn is kept as sampled
    assert nxt.extended and "42" in chat.decode(nxt.ids[len(prompt) + len(sampled):])
    if family == "mistral-small-3.2":  # the result answers the call by the 9-character id the template demands
        assert chat.decode(nxt.ids[len(prompt) + len(sampled):]) == "[TOOL_RESULTS]call00000[TOOL_CONTENT]42[/TOOL_RESULTS]"


@pytest.mark.parametrize("family", sorted(FORMATS))
async def test_malformed_calls_are_answered(family):
    tok, chat, stop = _setup(family)
    _, _, bad = FORMATS[family]
    prompt = chat.prompt_ids(QUESTION, TOOLS)
    turn = chat.parse(tok(bad, add_special_tokens=False)["input_ids"] + [stop], prompt, TOOLS)
    executor = ToolExecutor({"calculator": CalculatorTool()})
    results = await executor.execute(turn.tool_calls)
    assert len(results) == 1 and not results[0].ok and results[0].content.startswith("Error")
    assert results[0].error_kind in ("invalid_arguments", "unknown_tool", "invalid_json")
    if results[0].error_kind == "invalid_json":  # told how a call looks in its own format, not another family's
        own = {"gpt-oss": "to=functions.<tool name>", "mistral-small-3.2": "[TOOL_CALLS]<tool name>[ARGS]"}[family]
        assert own in results[0].content and "<tool_call>" not in results[0].content, results[0].content


@pytest.mark.parametrize(("schema", "text", "value"), [
    ({"type": "string"}, "2024", "2024"),
    ({"type": ["string", "null"]}, "null", "null"),  # a nullable string stays text
    ({"enum": ["a", "1"]}, "1", "1"),  # an enum without type, with a string member
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "7", "7"),
    (None, "[1]", "[1]"),  # an undeclared parameter
    ({"description": "anything"}, "true", "true"),
    ({"type": "integer"}, "7", 7),
    ({"type": "integer"}, "five", "five"),  # not JSON: the text, for the schema check to answer
    ({"type": ["integer", "null"]}, "null", None),
    ({"enum": [1, 2]}, "2", 2),
])
def test_xml_values_are_text_wherever_the_schema_admits_a_string(schema, text, value):
    from skyrl_stepwise.chat.tool_formats.xml_values import typed_value

    assert typed_value(text, schema) == value and type(typed_value(text, schema)) is type(value)


def test_xml_value_padding_is_probed_from_the_rendering():
    from skyrl_stepwise.chat.tool_formats.xml_values import ValuePadding, probed_padding

    assert probed_padding("<parameter=k>\nSKYRLPROBEVALUE\n</parameter>") == ValuePadding("\n", "\n")
    assert probed_padding("<arg_value>SKYRLPROBEVALUE</arg_value>") == ValuePadding("", "")
    assert probed_padding('{"k": "SKYRLPROBEVALUE"}') is None
    assert ValuePadding("\n", "\n").unpad("\n\n  x\n\n") == "\n  x\n"



def _granite(name, arguments):
    return {"name": name, "arguments": arguments}


GRANITE_CASES = [
  ('<|tool_call|>[{"name": "search", "arguments": {"query": "a"}}]', [_granite("search", {"query": "a"})]),
  ('<|tool_call|>[{"arguments": {"query": "b"}, "name": "search"}]', [_granite("search", {"query": "b"})]),
  ('<|tool_call|>[{"name": "search", "arguments": {"query": "c"}}, '
   '{"name": "calculator", "arguments": {"expression": "1+1"}}]',
    [_granite("search", {"query": "c"}), _granite("calculator", {"expression": "1+1"})]),
  ('<|tool_call|>[{"name": "search", "arguments": {"query": "d"}}]'
   '<|tool_call|>[{"name": "search", "arguments": {"query": "e"}}]',
    [_granite("search", {"query": "d"}), _granite("search", {"query": "e"})]),
  ('<|tool_call|>{"name": "search", "arguments": {"query": "f"}}', [_granite("search", {"query": "f"})]),
  ('<|tool_call|>[{"name": "search", "arguments": {"query": "g"}}]\n\nI will wait for the result.',
    [_granite("search", {"query": "g"})]),
  ('<|tool_call|>[{"name": "search", "arguments": {"query": "what is <|tool_call|>?"}}]',
    [_granite("search", {"query": "what is <|tool_call|>?"})]),
  ('<|tool_call|>\n[\n  {"name": "search", "arguments": {"query": "h"}}\n]\n', [_granite("search", {"query": "h"})]),
  ('<|tool_call|>[{"name": "search", "parameters": {"query": "i"}}]', [_granite("search", {"query": "i"})]),
  ('Let me look. <|tool_call|>[{"name": "search", "arguments": {"query": "j"}}]',
    [_granite("search", {"query": "j"})]),
  ('<|tool_call|>[{"name": "search", "arguments": {"query": "k ]"}}] then more text [1]',
    [_granite("search", {"query": "k ]"})]),
  ('<|tool_call|>[{"name": "search", "arguments": {"query": "l"}}]\n'
   '<|tool_call|>[{"name": "calculator", "arguments": {"expression": "2"}}]',
    [_granite("search", {"query": "l"}), _granite("calculator", {"expression": "2"})]),
  ('<|tool_call|>[{"name": "calculator", "arguments": {"expression": "3*3"}}, '
   '{"name": "search", "arguments": {"query": "m"}}]',
    [_granite("calculator", {"expression": "3*3"}), _granite("search", {"query": "m"})]),
  ('<|tool_call|>[{"name": "search", "arguments": {"query": "n\\nline"}}]',
    [_granite("search", {"query": "n\nline"})]),
  ('<|tool_call|>[{"name": "search", "arguments": {}}]', [_granite("search", {})]),
]


@pytest.mark.parametrize(("text", "expected"), GRANITE_CASES)
def test_granite_calls_parse_as_written(text, expected):
    """Issue 36 item 7: Granite 3.3's `<|tool_call|>` JSON list is read where its JSON value ends, so text after
    the list, a marker quoted in an argument, or a `]` in a string no longer turns a well-formed call invalid_json."""
    from skyrl_stepwise.chat.tool_formats.granite import parse_granite_text

    _, calls = parse_granite_text(text)
    assert [_granite(c.name, c.arguments) if c.error is None else c.error for c in calls] == expected


def test_granite_text_that_is_not_json_is_one_malformed_call_per_marker():
    from skyrl_stepwise.chat.tool_formats.granite import parse_granite_text

    content, calls = parse_granite_text('Sure. <|tool_call|>[{"name": "search", <|tool_call|>[{"arguments": {}}]')
    assert content == "Sure. " and [c.error for c in calls] == ["invalid_json", "missing_name"]
