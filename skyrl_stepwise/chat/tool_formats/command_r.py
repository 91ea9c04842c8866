"""Command R7B calls: `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}, ...]
<|END_ACTION|>`, after an optional `<|START_THINKING|>...<|END_THINKING|>` plan. No parser in the library."""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, json_list_calls

OPEN, CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
COMMAND_R_FORMAT = f'{OPEN}[{{"tool_call_id": "0", "tool_name": <tool name>, "parameters": <JSON object>}}]{CLOSE}'


def parse_command_r_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(text before the action, every call in its JSON list); an action without its close is unclosed_block."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    body, closed, _ = text[start + len(OPEN):].partition(CLOSE)
    if not closed:
        return text[:start], [ToolCallRequest(None, None, body, "unclosed_block")]
    # the sampled tool_call_id ("0", "1", ...) restarts every turn: the call ids of the history are ours
    return text[:start], [ToolCallRequest(c.name, c.arguments, c.raw, c.error)
                          for c in json_list_calls(body.strip(), "tool_name", ("parameters",))]


COMMAND_R = ToolFormat(
    name="command_r", expected_format=COMMAND_R_FORMAT, markers=(OPEN,),
    renders=re.compile(re.escape(OPEN) + r'.*?"tool_name":\s*"skyrl_probe_call"', re.DOTALL),
    instructs=re.compile(re.escape(OPEN)),
    parse_text=parse_command_r_text, description="<|START_ACTION|> JSON list (Command R7B, Command A)")
