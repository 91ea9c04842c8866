"""Tool calls of models that use their own chat template, in the format that template renders calls in:
hermes/Qwen (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the default), Mistral (`[TOOL_CALLS]name
[ARGS]{...}`) and harmony (gpt-oss). Where `<tool_call>` is one token the `renderers` library's parser reads the
ids; where a tokenizer spells it in pieces (SmolLM2 and other small models prompted with the format) we read the
decoded text the same way. Malformed calls are kept, with an error kind, so they can be answered.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest

# How a call looks in each format: told to the model, with the error, when its call could not be parsed.
HERMES_FORMAT = '<tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>'
LLAMA_JSON_FORMAT = 'a JSON object {"name": <tool name>, "parameters": <JSON object>}'
HARMONY_FORMAT = "<|channel|>commentary to=functions.<tool name> <|constrain|>json<|message|><JSON object>"
MISTRAL_FORMAT = "[TOOL_CALLS]<tool name>[ARGS]<JSON object>"

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes_text(text: str) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded text."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for m in _BLOCK.finditer(text, start):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(ToolCallRequest(None, None, body, "unclosed_block", expected_format=HERMES_FORMAT))
            break
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            calls.append(ToolCallRequest(None, None, body, "invalid_json", expected_format=HERMES_FORMAT))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        arguments = obj.get("arguments", {}) if isinstance(obj, dict) else None
        calls.append(ToolCallRequest(name or None, arguments, body, None if name else "missing_name",
                                     expected_format=None if name else HERMES_FORMAT))
    return text[:start], calls


class HermesToolParser:
    """Ids -> (content, calls): the library's token-level Qwen3 parser when it applies, else the text parser."""

    def __init__(self, tokenizer) -> None:
        from renderers.parsers import get_tool_parser

        self.tokenizer = tokenizer
        single = tokenizer.convert_tokens_to_ids("<tool_call>")
        self.library = get_tool_parser("qwen3", tokenizer) if single not in (None, tokenizer.unk_token_id) else None

    def parse(self, ids: list[int], decode) -> tuple[str, list[ToolCallRequest]]:
        if self.library is None:
            return parse_hermes_text(decode(ids))
        content_ids, parsed = self.library.extract(list(ids))
        calls = [ToolCallRequest(c.name, c.arguments, c.raw, None if c.status == "ok" else str(c.status), c.id,
                                 None if c.status == "ok" else HERMES_FORMAT) for c in parsed]
        return decode(content_ids), calls


MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_JSON_LIST = re.compile(r"\[\s*[{\]]")
_MISTRAL_CALL = re.compile(r"^(?P<name>.*?)(?:\[CALL_ID\](?P<id>.*?))?\[ARGS\](?P<args>.*)$", re.DOTALL)


def mistral_call_id(index: int) -> str:
    """The id of the `index`-th call of a turn whose model sampled none: Mistral templates and mistral-common
    require 9 alphanumeric characters (`call_0` raises), and a fixed scheme keeps rollouts reproducible."""
    return f"call{index:05d}"


def parse_mistral_text(text: str) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded Mistral text.

    Tokenizer v11+ models (Mistral Small 3.x, Ministral, Devstral) sample `[TOOL_CALLS]name[ARGS]{json}` per call,
    some with `[CALL_ID]id` before `[ARGS]`; v3-v7 models one `[TOOL_CALLS][{"name": ..., "arguments": ...}]`
    list. The same split mistral-common's decoder makes, on text, so it works with any HF tokenizer.
    """
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return text, []
    calls: list[ToolCallRequest] = []
    for body in text[start:].split(MISTRAL_CALLS)[1:]:
        body = body.strip()
        if _MISTRAL_JSON_LIST.match(body):  # v3-v7: a JSON list of calls
            calls.extend(_mistral_json_list(body, len(calls)))
            continue
        m = _MISTRAL_CALL.match(body)
        call_id = (m.group("id") or "").strip() if m else ""
        call_id = call_id or mistral_call_id(len(calls))
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


def _mistral_json_list(body: str, first_index: int) -> list[ToolCallRequest]:
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


class MistralToolParser:
    """Ids -> (content, calls) for templates that render calls as `[TOOL_CALLS]` (see parse_mistral_text)."""

    def parse(self, ids: list[int], decode) -> tuple[str, list[ToolCallRequest]]:
        return parse_mistral_text(decode(ids))


def tool_parser_for(rendered_call: str, tokenizer) -> HermesToolParser | MistralToolParser:
    """The parser for the call format a chat template renders (`rendered_call`: its rendering of an assistant
    tool call): what the model was trained to sample. Hermes where the template shows no format of its own."""
    if MISTRAL_CALLS in rendered_call:
        return MistralToolParser()
    return HermesToolParser(tokenizer)


_HARMONY_MESSAGE = re.compile(r"(?P<head>.*?)<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)",
                              re.DOTALL)


def parse_harmony_text(text: str) -> tuple[str, str | None, list[ToolCallRequest]]:
    """(final content, analysis, tool calls) of a gpt-oss (harmony) completion read from its decoded text.

    The `renderers` library parses harmony with `openai-harmony`, which needs its vocabulary file; this keeps a
    template-backed gpt-oss usable offline: analysis -> reasoning, final -> content, `to=functions.NAME` -> call.
    """
    content, thinking, calls = [], [], []
    for m in _HARMONY_MESSAGE.finditer(text):
        head, body = m.group("head"), m.group("body")
        channel = re.search(r"<\|channel\|>\s*(\w+)", head)
        recipient = re.search(r"to=functions\.([\w\-]+)", head)
        if recipient:
            try:
                calls.append(ToolCallRequest(recipient.group(1), json.loads(body), body))
            except json.JSONDecodeError:
                calls.append(ToolCallRequest(recipient.group(1), None, body, "invalid_json",
                                             expected_format=HARMONY_FORMAT))
        elif channel and channel.group(1) == "analysis":
            thinking.append(body)
        else:
            content.append(body)
    return "".join(content), ("".join(thinking) or None), calls
