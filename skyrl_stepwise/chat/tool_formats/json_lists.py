"""Calls as one JSON list of `{"name": ..., "arguments": {...}}` objects after a marker (the reader Granite uses,
`parse_marked_json`; no parser in the `renderers` library):

- Firefunction v2: ` functools[{...}, ...]` after the turn's text (no closing marker);
- Nemotron Nano 2: `<TOOLCALL>[{...}, ...]</TOOLCALL>`;
- xLAM-2: the bare list, no marker: the list is the whole call turn (`bare_json_list`).
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, call_from_object, parse_marked_json

FUNCTOOLS = "functools"
FUNCTOOLS_FORMAT = f'{FUNCTOOLS}[{{"name": <tool name>, "arguments": <JSON object>}}]'
TOOLCALL_OPEN, TOOLCALL_CLOSE = "<TOOLCALL>", "</TOOLCALL>"
TOOLCALL_FORMAT = f'{TOOLCALL_OPEN}[{{"name": <tool name>, "arguments": <JSON object>}}]{TOOLCALL_CLOSE}'
BARE_LIST_FORMAT = '[{"name": <tool name>, "arguments": <JSON object>}, ...] as the whole turn'
_LIST_START = re.compile(r'^\s*\[\s*\{\s*"(name|arguments)"')
_DECODER = json.JSONDecoder()


def parse_functools_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(text before `functools[`, every call of its list); the marker counts only where a JSON list follows it,
    so the word in prose is content."""
    at = re.search(re.escape(FUNCTOOLS) + r"\s*\[", text)
    if at is None:
        return text, []
    content, calls = parse_marked_json(text[at.start():], FUNCTOOLS)
    return text[:at.start()], calls


def parse_toolcall_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(text before the first `<TOOLCALL>`, every call of each block's list)."""
    return parse_marked_json(text, TOOLCALL_OPEN)


def parse_bare_list_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """("", every call of the list) where the turn opens with a JSON list of call objects; a turn that opens like
    one and does not decode is one invalid_json call (answered, not the final answer); any other turn is content.
    With no marker to find, a list the model writes after some text is text: the template renders none there."""
    if _LIST_START.match(text) is None:
        return text, []
    body = text.strip()
    try:
        items, _ = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        return "", [ToolCallRequest(None, None, body, "invalid_json")]
    return "", [call_from_object(item, json.dumps(item), "name", ("arguments", "parameters")) for item in items]


FIREFUNCTION = ToolFormat(
    name="firefunction", expected_format=FUNCTOOLS_FORMAT, markers=(FUNCTOOLS + "[",),
    renders=re.compile(re.escape(FUNCTOOLS) + r'\[\s*\{\s*"name":\s*"skyrl_probe_call"'),
    instructs=re.compile(re.escape(FUNCTOOLS) + r'\[\{"name"'),
    parse_text=parse_functools_text, description="functools[...] JSON list (Firefunction v2)")
NEMOTRON_TOOLCALL = ToolFormat(
    name="nemotron_toolcall", expected_format=TOOLCALL_FORMAT, markers=(TOOLCALL_OPEN,),
    renders=re.compile(re.escape(TOOLCALL_OPEN) + r'\s*\[\s*\{\s*"name":\s*"skyrl_probe_call"'),
    instructs=re.compile(re.escape(TOOLCALL_OPEN) + r'\['),
    parse_text=parse_toolcall_text, description="<TOOLCALL> JSON list (Nemotron Nano 2)")
# the list opens the call turn: right after a line break or a special token (`<|end_header_id|>\\n\\n[`), never after
# a marker of its own (Apriel's `<tool_calls>[`, which marked_json reads)
BARE_JSON_LIST = ToolFormat(
    name="bare_json_list", expected_format=BARE_LIST_FORMAT, markers=(),
    renders=re.compile(r'(?:^|\n|\|>)\s*\[\s*\{\s*"(name|arguments)":[^<]*"skyrl_probe_call"'),
    parse_text=parse_bare_list_text, description="a bare JSON list of calls as the whole turn (xLAM-2)")
