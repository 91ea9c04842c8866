"""Mistral calls: `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizer v11+: Mistral Small 3.x, Ministral, Devstral;
some with `[CALL_ID]id`), or one `[TOOL_CALLS][{"name": ..., "arguments": ...}]` list (v3-v7: Mistral 7B v0.3,
Nemo). The same split mistral-common's decoder makes, on text, so it works with any HF tokenizer.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat

MISTRAL_FORMAT = "[TOOL_CALLS]<tool name>[ARGS]<JSON object>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_JSON_LIST = re.compile(r"\[\s*[{\]]")
_CALL = re.compile(r"^(?P<name>.*?)(?:\[CALL_ID\](?P<id>.*?))?\[ARGS\](?P<args>.*)$", re.DOTALL)


def mistral_call_id(index: int) -> str:
    """The id of the `index`-th call of a turn whose model sampled none: Mistral templates and mistral-common
    require 9 alphanumeric characters (`call_0` raises), and a fixed scheme keeps rollouts reproducible."""
    return f"call{index:05d}"


def parse_mistral_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded Mistral text."""
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return text, []
    calls: list[ToolCallRequest] = []
    for body in text[start:].split(MISTRAL_CALLS)[1:]:
        body = body.strip()
        if _JSON_LIST.match(body):  # v3-v7: a JSON list of calls
            calls.extend(_json_list(body, len(calls)))
            continue
        m = _CALL.match(body)
        call_id = ((m.group("id") or "").strip() if m else "") or mistral_call_id(len(calls))
        if m is None:
            calls.append(ToolCallRequest(None, None, body, "missing_arguments", call_id, MISTRAL_FORMAT))
            continue
        name = m.group("name").strip() or None
        try:
            arguments = json.loads(m.group("args"))
        except json.JSONDecodeError:
            calls.append(ToolCallRequest(name, None, body, "invalid_json", call_id, MISTRAL_FORMAT))
            continue
        error = None if name else "missing_name"
        calls.append(ToolCallRequest(name, arguments, body, error, call_id, MISTRAL_FORMAT if error else None))
    return text[:start], calls


def _json_list(body: str, first_index: int) -> list[ToolCallRequest]:
    try:
        items = json.loads(body)
    except json.JSONDecodeError:
        return [ToolCallRequest(None, None, body, "invalid_json", mistral_call_id(first_index), MISTRAL_FORMAT)]
    calls = []
    for i, item in enumerate(items if isinstance(items, list) else [items]):
        name = item.get("name") if isinstance(item, dict) else None
        arguments = item.get("arguments", {}) if isinstance(item, dict) else None
        call_id = (item.get("id") if isinstance(item, dict) else None) or mistral_call_id(first_index + i)
        calls.append(ToolCallRequest(name or None, arguments, json.dumps(item), None if name else "missing_name",
                                     str(call_id)))
    return calls


MISTRAL = ToolFormat(
    name="mistral", expected_format=MISTRAL_FORMAT, markers=(MISTRAL_CALLS,),
    renders=re.compile(re.escape(MISTRAL_CALLS)), parse_text=parse_mistral_text,
    description="[TOOL_CALLS] (Mistral 7B v0.3, Nemo, Small 3.x, Ministral, Devstral)")
