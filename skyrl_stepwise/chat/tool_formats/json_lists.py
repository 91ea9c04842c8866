"""Calls as one JSON list of `{"name": ..., "arguments": {...}}` objects after a marker (the reader Granite uses,
`parse_marked_json`; no parser in the `renderers` library):

- Firefunction v2: ` functools[{...}, ...]` after the turn's text (no closing marker);
- Nemotron Nano 2: `<TOOLCALL>[{...}, ...]</TOOLCALL>`.
"""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_marked_json

FUNCTOOLS = "functools"
FUNCTOOLS_FORMAT = f'{FUNCTOOLS}[{{"name": <tool name>, "arguments": <JSON object>}}]'
TOOLCALL_OPEN, TOOLCALL_CLOSE = "<TOOLCALL>", "</TOOLCALL>"
TOOLCALL_FORMAT = f'{TOOLCALL_OPEN}[{{"name": <tool name>, "arguments": <JSON object>}}]{TOOLCALL_CLOSE}'


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
