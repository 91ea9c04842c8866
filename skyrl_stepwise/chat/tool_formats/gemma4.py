"""Gemma 4 calls: `<|tool_call>call:name{key:value,...}<tool_call|>`, arguments in Gemma's own syntax (unquoted
keys, strings between `<|"|>` delimiters), read with the `renderers` library's Gemma 4 argument parser."""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_blocks

OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
GEMMA4_FORMAT = f'{OPEN}call:<tool name>{{<key>:<value>,...}}{CLOSE} (strings between <|"|> delimiters)'
_CALL = re.compile(r"^\s*call:([^{\s]+)\s*(\{.*\})\s*$", re.DOTALL)


def parse_gemma4_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded Gemma 4 text."""
    return parse_blocks(text, OPEN, CLOSE, _read_call)


def _read_call(body: str) -> list[ToolCallRequest]:
    from renderers.gemma4 import _ArgumentParser

    m = _CALL.match(body)
    if m is None:
        return [ToolCallRequest(None, None, body, "malformed_structure")]
    try:
        return [ToolCallRequest(m.group(1), _ArgumentParser(m.group(2)).parse(), body)]
    except ValueError:
        return [ToolCallRequest(m.group(1), None, body, "malformed_structure")]


GEMMA4 = ToolFormat(
    name="gemma4", expected_format=GEMMA4_FORMAT, markers=(OPEN,),
    renders=re.compile(re.escape(OPEN) + r"\s*call:skyrl_probe_call\{"),
    parse_text=parse_gemma4_text, description="<|tool_call>call:name{...} (Gemma 4)")
