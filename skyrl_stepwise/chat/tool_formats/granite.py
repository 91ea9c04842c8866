"""Granite 3.x calls: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, a JSON list after the marker.

Granite 3.3's template does not render an assistant turn's `tool_calls` (its system prompt tells the model the
format), so the format is recognised from that instruction; the `renderers` library has no Granite parser.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, call_from_object

MARKER = "<|tool_call|>"
GRANITE_FORMAT = f'{MARKER}[{{"name": <tool name>, "arguments": <JSON object>}}]'


def parse_granite_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first marker, every call of the JSON value after each marker). The value is read where
    it ends (`raw_decode`), not up to the next marker or the end of the turn: text the model writes after the list
    ("I will wait for the result.") or a marker quoted inside an argument does not break a well-formed call."""
    start = text.find(MARKER)
    if start < 0:
        return text, []
    calls, at = [], start
    while at >= 0:  # a model may open each call with the marker
        body = at + len(MARKER)
        value_start = len(text) - len(text[body:].lstrip())
        try:
            value, end = _DECODER.raw_decode(text, value_start)
        except json.JSONDecodeError:
            nxt = text.find(MARKER, body)
            calls.append(ToolCallRequest(None, None, text[body:nxt if nxt >= 0 else len(text)].strip(),
                                         "invalid_json"))
            at = nxt
            continue
        items = value if isinstance(value, list) else [value]
        calls.extend(call_from_object(item, json.dumps(item), "name", ("arguments", "parameters")) for item in items)
        at = text.find(MARKER, end)
    return text[:start], calls


_DECODER = json.JSONDecoder()


GRANITE = ToolFormat(
    name="granite", expected_format=GRANITE_FORMAT, markers=(MARKER,),
    renders=re.compile(re.escape(MARKER)), instructs=re.compile(re.escape(MARKER)),
    parse_text=parse_granite_text, description="<|tool_call|> JSON list (Granite 3.x)")
