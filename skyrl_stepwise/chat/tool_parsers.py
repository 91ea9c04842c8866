"""Tool calls in hermes/Qwen format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) for models that
use their own chat template. Where `<tool_call>` is one token the `renderers` library's parser reads the ids;
where a tokenizer spells it in pieces (SmolLM2 and other small models prompted with the format) we read the
decoded text the same way. Malformed calls are kept, with an error kind, so they can be answered.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest

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
            calls.append(ToolCallRequest(None, None, body, "unclosed_block"))
            break
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            calls.append(ToolCallRequest(None, None, body, "invalid_json"))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        arguments = obj.get("arguments", {}) if isinstance(obj, dict) else None
        calls.append(ToolCallRequest(name or None, arguments, body, None if name else "missing_name"))
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
        calls = [ToolCallRequest(c.name, c.arguments, c.raw, None if c.status == "ok" else str(c.status), c.id)
                 for c in parsed]
        return decode(content_ids), calls


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
                calls.append(ToolCallRequest(recipient.group(1), None, body, "invalid_json"))
        elif channel and channel.group(1) == "analysis":
            thinking.append(body)
        else:
            content.append(body)
    return "".join(content), ("".join(thinking) or None), calls
