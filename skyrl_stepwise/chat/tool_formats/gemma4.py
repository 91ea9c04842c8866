"""Gemma 4 calls: `<|tool_call>call:name{key:value,...}<tool_call|>`, arguments in Gemma's own syntax (unquoted
keys, strings between `<|"|>` delimiters), read with the `renderers` library's Gemma 4 argument parser."""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, blocks

OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
GEMMA4_FORMAT = f'{OPEN}call:<tool name>{{<key>:<value>,...}}{CLOSE} (strings between <|"|> delimiters)'
_CALL = re.compile(r"^\s*call:([^{\s]+)\s*(\{.*\})\s*$", re.DOTALL)


def parse_gemma4_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded Gemma 4 text."""
    from renderers.gemma4 import _ArgumentParser

    start, found = blocks(text, OPEN, CLOSE)
    if start < 0:
        return text, []
    calls = []
    for body, closed in found:
        m = _CALL.match(body)
        if not closed:
            calls.append(ToolCallRequest(None, None, body, "unclosed_block"))
        elif m is None:
            calls.append(ToolCallRequest(None, None, body, "malformed_structure"))
        else:
            try:
                calls.append(ToolCallRequest(m.group(1), _ArgumentParser(m.group(2)).parse(), body))
            except ValueError:
                calls.append(ToolCallRequest(m.group(1), None, body, "malformed_structure"))
    return text[:start], calls


GEMMA4 = ToolFormat(
    name="gemma4", expected_format=GEMMA4_FORMAT, markers=(OPEN,),
    renders=re.compile(re.escape(OPEN) + r"\s*call:skyrl_probe_call\{"),
    parse_text=parse_gemma4_text, description="<|tool_call>call:name{...} (Gemma 4)")
