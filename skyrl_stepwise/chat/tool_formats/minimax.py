"""MiniMax M2 calls: `<minimax:tool_call>\\n<invoke name="n">\\n<parameter name="k">v</parameter>\\n</invoke>\\n
</minimax:tool_call>`, several `<invoke>`s per block. Values kept as written less the template's padding and typed by
the tool's schema (xml_values.py)."""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_blocks, xml_arguments
from skyrl_stepwise.chat.tool_formats.xml_values import DEFAULT_PADDING, ValuePadding

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_FORMAT = f'{OPEN}\n<invoke name="<tool name>">\n<parameter name="<name>"><value></parameter>\n</invoke>\n{CLOSE}'
_INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.DOTALL)
_PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)


def minimax_parser(padding: ValuePadding = DEFAULT_PADDING):
    """The reader of decoded MiniMax text, values padded by `padding`."""

    def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
        return _parse_minimax_text(text, tools, padding)
    return parse


def parse_minimax_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call block, every call attempt) from decoded MiniMax text (default padding)."""
    return _parse_minimax_text(text, tools, DEFAULT_PADDING)


def _parse_minimax_text(text: str, tools: list[dict] | None,
                        padding: ValuePadding) -> tuple[str, list[ToolCallRequest]]:

    def read(body: str) -> list[ToolCallRequest]:
        invokes = _INVOKE.findall(body)
        calls = [] if invokes and len(invokes) == body.count("<invoke") else [
            ToolCallRequest(None, None, body, "malformed_structure")]
        for name, inner in invokes:
            if not name.strip():
                calls.append(ToolCallRequest(None, None, inner, "missing_name"))
            elif inner.count("<parameter") != len(_PARAM.findall(inner)):
                calls.append(ToolCallRequest(name.strip(), None, inner, "malformed_structure"))
            else:
                calls.append(xml_arguments(name.strip(), _PARAM.findall(inner), tools, inner, padding))
        return calls
    return parse_blocks(text, OPEN, CLOSE, read)


MINIMAX = ToolFormat(
    name="minimax", expected_format=MINIMAX_FORMAT, markers=(OPEN,),
    renders=re.compile(re.escape(OPEN) + r'\s*<invoke name="skyrl_probe_call">'), instructs=re.compile(re.escape(OPEN)),
    parse_text=parse_minimax_text, padded=minimax_parser, description="<minimax:tool_call> <invoke> (MiniMax M2)")
