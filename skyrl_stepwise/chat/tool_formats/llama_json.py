"""Llama 3.x JSON calls: the whole turn is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), no tags around it.

The library's Llama 3 parser reads a turn that does not decode as a call as the final answer; here a turn that
opens like a call (`{` then `"name"`) and does not decode is a malformed call, answered, so the episode goes on.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, call_from_object

LLAMA_JSON_FORMAT = 'a JSON object {"name": <tool name>, "parameters": <JSON object>}'
_CALL_START = re.compile(r'^\s*(<\|python_tag\|>)?\s*\{\s*"(name|function)"')


def parse_llama_json_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """One call, or several separated by `;` or whitespace, when the turn opens like a call; else content."""
    m = _CALL_START.match(text)
    if m is None:
        return text, []
    body = text.strip().removeprefix("<|python_tag|>").strip()
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
    return "", calls


LLAMA_JSON = ToolFormat(
    name="llama_json", expected_format=LLAMA_JSON_FORMAT, markers=("<|python_tag|>",),
    renders=re.compile(r'\{\s*"name":\s*"skyrl_probe_call",\s*"parameters":'),
    instructs=re.compile(r'\{"name": function name, "parameters"'),
    parse_text=parse_llama_json_text,
    description='Llama 3.x JSON {"name", "parameters"} (Llama 3.1/3.2/3.3)')
