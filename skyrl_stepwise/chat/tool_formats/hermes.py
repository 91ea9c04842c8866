"""Hermes / Qwen2.5 / Qwen3 / Granite 4 JSON calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
and the same tags around a Python dict, keys in any order (`hermes_dict`: Falcon-H1's instructions ask for
`<tool_call>\\n{'arguments': <args-dict>, 'name': <function-name>}\\n</tool_call>`, Python quotes, arguments first).

Where `<tool_call>` is one token the `renderers` library's Qwen3 parser reads the ids; where a tokenizer spells it
in pieces (SmolLM2 and other small models prompted with the format) we read the decoded text the same way.
"""

from __future__ import annotations

import ast
import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, call_from_object, library_token_parser, parse_blocks
from skyrl_stepwise.chat.tool_formats.pythonic import json_literal

HERMES_FORMAT = '<tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>'
HERMES_DICT_FORMAT = "<tool_call>{'arguments': <arguments dict>, 'name': <tool name>}</tool_call>"


def parse_hermes_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded text."""
    return parse_blocks(text, "<tool_call>", "</tool_call>", _read_call)


def _read_call(body: str) -> list[ToolCallRequest]:
    body = body.strip()
    try:
        return [call_from_object(json.loads(body), body)]
    except json.JSONDecodeError:
        return [ToolCallRequest(None, None, body, "invalid_json")]


HERMES = ToolFormat(
    name="hermes", expected_format=HERMES_FORMAT, markers=("<tool_call>",),
    renders=re.compile(r'<tool_call>\s*\{\s*"(name|arguments)":[^<]*"skyrl_probe_call"'),
    instructs=re.compile(r'<tool_call>\s*\{\s*\\?"name\\?":'),
    parse_text=parse_hermes_text, library=library_token_parser("qwen3", ("<tool_call>",)),
    description="Hermes/Qwen JSON in <tool_call> tags (Qwen2.5, Qwen3, QwQ, Hermes, SmolLM3, Granite 4)")


def parse_hermes_dict_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt): each block holds a Python dict or a JSON object."""
    return parse_blocks(text, "<tool_call>", "</tool_call>", _read_dict_call)


def _read_dict_call(body: str) -> list[ToolCallRequest]:
    """A JSON object, else a Python dict literal (`True`, `None`, single quotes) whose values JSON can hold; neither
    is a malformed call (the model was asked for a dict, so "not valid JSON" would mislead it)."""
    body = body.strip()
    try:
        return [call_from_object(json.loads(body), body)]
    except json.JSONDecodeError:
        pass
    try:
        value = json_literal(ast.parse(body, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return [ToolCallRequest(None, None, body, "malformed_structure")]
    return [call_from_object(value, body)]


# `<tool_call>` then a dict whose first key is single-quoted: a JSON object (double quotes) is plain hermes
HERMES_DICT = ToolFormat(
    name="hermes_dict", expected_format=HERMES_DICT_FORMAT, markers=("<tool_call>",),
    renders=re.compile(r"<tool_call>\s*\{\s*'(name|arguments)':[^<]*'skyrl_probe_call'"),
    instructs=re.compile(r"<tool_call>\s*\{\s*'(name|arguments)':"),
    parse_text=parse_hermes_dict_text,
    description="a Python dict in <tool_call> tags, keys in any order (Falcon-H1)")
