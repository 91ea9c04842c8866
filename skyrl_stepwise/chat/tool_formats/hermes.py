"""Hermes / Qwen2.5 / Qwen3 / Granite 4 JSON calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Where `<tool_call>` is one token the `renderers` library's Qwen3 parser reads the ids; where a tokenizer spells it
in pieces (SmolLM2 and other small models prompted with the format) we read the decoded text the same way.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, call_from_object, library_token_parser, parse_blocks

HERMES_FORMAT = '<tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>'


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
    renders=re.compile(r'<tool_call>\s*\{\s*"name":\s*"skyrl_probe_call"'),
    instructs=re.compile(r'<tool_call>\s*\{\s*\\?"name\\?":'),
    parse_text=parse_hermes_text, library=library_token_parser("qwen3", ("<tool_call>",)),
    description="Hermes/Qwen JSON in <tool_call> tags (Qwen2.5, Qwen3, QwQ, Hermes, SmolLM3, Granite 4)")
