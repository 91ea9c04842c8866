"""gpt-oss (harmony) calls: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.

The `renderers` library parses harmony with `openai-harmony`, which needs its vocabulary file; this keeps a
template-backed gpt-oss usable offline: analysis -> reasoning, final -> content, `to=functions.NAME` -> call.
"""

from __future__ import annotations

import json
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat

HARMONY_FORMAT = "<|channel|>commentary to=functions.<tool name> <|constrain|>json<|message|><JSON object>"
_MESSAGE = re.compile(r"(?P<head>.*?)<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)",
                      re.DOTALL)


def parse_harmony_text(text: str) -> tuple[str, str | None, list[ToolCallRequest]]:
    """(final content, analysis, tool calls) of a gpt-oss (harmony) completion read from its decoded text."""
    content, thinking, calls = [], [], []
    for m in _MESSAGE.finditer(text):
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


def _parse_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    content, _, calls = parse_harmony_text(text)
    return content, calls


HARMONY = ToolFormat(
    name="harmony", expected_format=HARMONY_FORMAT, markers=("to=functions.",),
    renders=re.compile(r"to=functions\.skyrl_probe_call"), parse_text=_parse_calls,
    description="harmony channels (gpt-oss)")
