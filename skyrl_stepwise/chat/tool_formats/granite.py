"""Granite 3.x calls: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, a JSON list after the marker.

Granite 3.3's template does not render an assistant turn's `tool_calls` (its system prompt tells the model the
format), so the format is recognised from that instruction; the `renderers` library has no Granite parser.
"""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_marked_json

MARKER = "<|tool_call|>"
GRANITE_FORMAT = f'{MARKER}[{{"name": <tool name>, "arguments": <JSON object>}}]'


def parse_granite_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first marker, every call of the JSON value after each marker): `parse_marked_json`."""
    return parse_marked_json(text, MARKER)


GRANITE = ToolFormat(
    name="granite", expected_format=GRANITE_FORMAT, markers=(MARKER,),
    renders=re.compile(re.escape(MARKER)), instructs=re.compile(re.escape(MARKER)),
    parse_text=parse_granite_text, description="<|tool_call|> JSON list (Granite 3.x)")
