"""Functionary v3.1 calls (Llama 3.1 based): `<function=name>{...}</function>` per call, JSON arguments, the turn
closed by <|eom_id|>. No parser in the `renderers` library. Not Qwen3-Coder's `<function=name>` with
`<parameter=k>` children (xml_params.py): here a JSON object follows the name's `>`."""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_blocks

OPEN, CLOSE = "<function=", "</function>"
FUNCTIONARY_FORMAT = f"{OPEN}<tool name>><JSON object>{CLOSE}"


def parse_functionary_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded text."""
    return parse_blocks(text, OPEN, CLOSE, _read_call)


def _read_call(body: str) -> list[ToolCallRequest]:
    name, sep, args = body.partition(">")
    name = name.strip()
    if not sep:
        return [ToolCallRequest(None, None, body, "malformed_structure")]
    if not name:
        return [ToolCallRequest(None, None, body, "missing_name")]
    try:
        return [ToolCallRequest(name, json.loads(args) if args.strip() else {}, body)]
    except json.JSONDecodeError:
        return [ToolCallRequest(name, None, body, "invalid_json")]


FUNCTIONARY = ToolFormat(
    name="functionary", expected_format=FUNCTIONARY_FORMAT, markers=(OPEN,),
    renders=re.compile(re.escape(OPEN) + r"skyrl_probe_call>\s*\{"),
    instructs=re.compile(re.escape("<function=example_function_name>{")),
    parse_text=parse_functionary_text, description="<function=name>{JSON}</function> (Functionary v3.1)")
