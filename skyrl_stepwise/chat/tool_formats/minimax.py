"""MiniMax M2 calls: `<minimax:tool_call>\\n<invoke name="n">\\n<parameter name="k">v</parameter>\\n</invoke>\\n
</minimax:tool_call>`, several `<invoke>`s per block. Values typed by the tool's schema (the library's rule, see
xml_params.py; its MiniMax reader is inside the whole-response `parse_minimax`)."""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_blocks, xml_arguments

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_FORMAT = f'{OPEN}\n<invoke name="<tool name>">\n<parameter name="<name>"><value></parameter>\n</invoke>\n{CLOSE}'
_INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.DOTALL)
_PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)


def parse_minimax_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call block, every call attempt) from decoded MiniMax text."""

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
                calls.append(xml_arguments(name.strip(), _PARAM.findall(inner), tools, inner))
        return calls
    return parse_blocks(text, OPEN, CLOSE, read)


MINIMAX = ToolFormat(
    name="minimax", expected_format=MINIMAX_FORMAT, markers=(OPEN,),
    renders=re.compile(re.escape(OPEN) + r'\s*<invoke name="skyrl_probe_call">'), instructs=re.compile(re.escape(OPEN)),
    parse_text=parse_minimax_text, description="<minimax:tool_call> <invoke> (MiniMax M2)")
