"""Llama JSON calls: the turn is `{"name": ..., "parameters": {...}}` objects, no tags around them.

- Llama 3.x: the whole turn is one call (optionally after `<|python_tag|>`);
- Llama 4: the turn's text sits between `<|python_start|>` and `<|python_end|>` (empty for a call-only turn), and
  every call follows, one object after another with nothing between them (parallel calls); a model may also write
  its calls inside those tags.

The library's Llama 3 parser reads a turn that does not decode as a call as the final answer; here a turn that
opens like a call (`{` then `"name"`) and does not decode is a malformed call, answered, so the episode goes on.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, call_from_object

LLAMA_JSON_FORMAT = 'a JSON object {"name": <tool name>, "parameters": <JSON object>}'
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALL_START = re.compile(r'^\s*(<\|python_tag\|>)?\s*\{\s*"(name|function)"')


def parse_llama_json_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content, calls): one call or several (separated by `;`, whitespace or nothing) where the turn opens like a
    call; Llama 4's `<|python_start|>text<|python_end|>` before them is the turn's text; else all is content."""
    if text.lstrip().startswith(PYTHON_START):
        content, calls = _parse_python_block(text.lstrip()[len(PYTHON_START):])
        return (content, calls) if calls else (text, [])
    if _CALL_START.match(text) is None:
        return text, []
    return "", _read_calls(text.strip().removeprefix("<|python_tag|>").strip())


def _parse_python_block(after_start: str) -> tuple[str, list[ToolCallRequest]]:
    """Llama 4: the text inside the tags is the turn's text, or its calls where it opens like one; calls follow."""
    inner, closed, rest = after_start.partition(PYTHON_END)
    calls = []
    if _CALL_START.match(inner):
        calls, inner = _read_calls(inner.strip()), ""
    if closed and _CALL_START.match(rest):
        calls.extend(_read_calls(rest.strip()))
    return inner, calls


def _read_calls(body: str) -> list[ToolCallRequest]:
    """Every JSON object in `body`, one after another; the first that does not decode ends it (invalid_json)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            calls.append(ToolCallRequest(None, None, body[at:], "invalid_json"))
            break
        calls.append(call_from_object(obj, body[at:end], args_keys=("parameters", "arguments")))
        at = end
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return calls


LLAMA_JSON = ToolFormat(
    name="llama_json", expected_format=LLAMA_JSON_FORMAT, markers=("<|python_tag|>", PYTHON_START),
    renders=re.compile(r'\{\s*"name":\s*"skyrl_probe_call",\s*"parameters":'),
    instructs=re.compile(r'\{"name": function name, "parameters"'),
    parse_text=parse_llama_json_text,
    description='Llama JSON {"name", "parameters"} (Llama 3.1/3.2/3.3, Llama 4 after <|python_start|>...<|python_end|>)')
