"""Kimi K2 calls: `<|tool_calls_section_begin|>` then, per call,
`<|tool_call_begin|>functions.name:index<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then
`<|tool_calls_section_end|>`. The call id is the `functions.name:index` the model wrote (the template renders the
same scheme and a tool result names it), so it is kept as the call's id.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, blocks

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_FORMAT = f"{SECTION_BEGIN}{CALL_BEGIN}functions.<tool name>:0{ARGS_BEGIN}<JSON object>{CALL_END}{SECTION_END}"
_ID = re.compile(r"^(?:functions\.)?(?P<name>.+?)(?::\d+)?$", re.DOTALL)


def parse_kimi_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the calls section, every call attempt) from decoded Kimi K2 text."""
    section = text.find(SECTION_BEGIN)
    start, found = blocks(text, CALL_BEGIN, CALL_END)
    if start < 0:
        return (text[:section], [ToolCallRequest(None, None, text[section:], "malformed_structure")]) \
            if section >= 0 else (text, [])
    return text[:min(i for i in (section, start) if i >= 0)], [_call(body, closed) for body, closed in found]


def _call(body: str, closed: bool) -> ToolCallRequest:
    if not closed:
        return ToolCallRequest(None, None, body, "unclosed_block")
    call_id, sep, args = body.partition(ARGS_BEGIN)
    call_id = call_id.strip()
    m = _ID.match(call_id)
    if not sep or m is None:
        return ToolCallRequest(None, None, body, "malformed_structure" if sep else "missing_arguments")
    name = m.group("name").strip()
    if not name:
        return ToolCallRequest(None, None, body, "missing_name", call_id)
    try:
        return ToolCallRequest(name, json.loads(args) if args.strip() else {}, body, None, call_id)
    except json.JSONDecodeError:
        return ToolCallRequest(name, None, body, "invalid_json", call_id)


KIMI_K2 = ToolFormat(
    name="kimi_k2", expected_format=KIMI_FORMAT, markers=(SECTION_BEGIN, CALL_BEGIN),
    renders=re.compile(re.escape(CALL_BEGIN) + r"\s*(?:functions\.)?skyrl_probe_call(?::\d+)?\s*"
                       + re.escape(ARGS_BEGIN)),
    parse_text=parse_kimi_text, description="<|tool_call_begin|>functions.name:i JSON (Kimi K2)")
