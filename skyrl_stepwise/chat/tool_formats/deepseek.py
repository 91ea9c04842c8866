"""DeepSeek calls, between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, one
`<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` each:

- V3 / R1 (and R1-Distill): `function<｜tool▁sep｜>name\\n```json\\n{...}\\n```` (the library's DeepSeekV3ToolParser
  reads the ids where the markers are single tokens, as in the real V3/R1 tokenizers);
- V3.1 / V3.2: `name<｜tool▁sep｜>{...}` (no parser in the library; ours).

One text reader handles both (it looks at what precedes the separator).
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, blocks, library_token_parser

CALLS_BEGIN, CALL_BEGIN, CALL_END, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, "<｜tool▁calls▁end｜>", CALL_BEGIN, CALL_END, SEP)
V3_FORMAT = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}<tool name>\n```json\n<JSON object>\n```{CALL_END}<｜tool▁calls▁end｜>"
V31_FORMAT = f"{CALLS_BEGIN}{CALL_BEGIN}<tool name>{SEP}<JSON object>{CALL_END}<｜tool▁calls▁end｜>"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_deepseek_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the calls section, every call attempt) from decoded DeepSeek text (V3/R1 or V3.1)."""
    section = text.find(CALLS_BEGIN)
    start, found = blocks(text, CALL_BEGIN, CALL_END)
    if start < 0:
        return (text[:section], [ToolCallRequest(None, None, text[section:], "malformed_structure")]) \
            if section >= 0 else (text, [])
    calls = [_call(body, closed) for body, closed in found]
    return text[:min(i for i in (section, start) if i >= 0)], calls


def _call(body: str, closed: bool) -> ToolCallRequest:
    if not closed:
        return ToolCallRequest(None, None, body, "unclosed_block")
    before, sep, after = body.partition(SEP)
    if not sep:
        return ToolCallRequest(None, None, body, "malformed_structure")
    if before.strip() in ("function", ""):  # V3 / R1: the name on the first line, fenced JSON after it
        name, _, args = after.strip().partition("\n")
        fence = _FENCE.match(args.strip())
        args = fence.group(1) if fence else args
    else:  # V3.1: the name before the separator, bare JSON after it
        name, args = before, after
    name = name.strip()
    if not name:
        return ToolCallRequest(None, None, body, "missing_name")
    try:
        return ToolCallRequest(name, json.loads(args) if args.strip() else {}, body)
    except json.JSONDecodeError:
        return ToolCallRequest(name, None, body, "invalid_json")


DEEPSEEK_V3 = ToolFormat(
    name="deepseek_v3", expected_format=V3_FORMAT, markers=(CALLS_BEGIN, CALL_BEGIN),
    renders=re.compile(re.escape(CALL_BEGIN) + r"\s*function\s*" + re.escape(SEP) + r"\s*skyrl_probe_call"),
    parse_text=parse_deepseek_text, library=library_token_parser("deepseek-v3", MARKERS),
    description="DeepSeek V3/R1 fenced JSON (DeepSeek V3, R1, R1-Distill)")
DEEPSEEK_V31 = ToolFormat(
    name="deepseek_v31", expected_format=V31_FORMAT, markers=(CALLS_BEGIN, CALL_BEGIN),
    renders=re.compile(re.escape(CALL_BEGIN) + r"\s*skyrl_probe_call\s*" + re.escape(SEP)),
    parse_text=parse_deepseek_text, description="DeepSeek V3.1/V3.2 name<sep>JSON")
