"""XML-parameter calls: `<function=name>\\n<parameter=k>\\nv\\n</parameter>\\n</function>` inside a wrapper tag:
`<tool_call>` (Qwen3-Coder, Qwen3.5/3.6, Nemotron 3) or `<seed:tool_call>` (Seed-OSS).

Values are kept as written less the template's own padding and typed by the tool's schema (xml_values.py): the
`renderers` library's token-level `Qwen35ToolParser` JSON-decodes every value without the schema (a string "2024"
would become 2024), and its schema-aware readers strip every value and refuse text where the schema wants no
string.
"""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_blocks, xml_arguments
from skyrl_stepwise.chat.tool_formats.xml_values import DEFAULT_PADDING, ValuePadding

_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(</function>\s*)?$", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def xml_parser(open_tag: str, close_tag: str, padding: ValuePadding = DEFAULT_PADDING):
    """The text reader of calls in `open_tag ... close_tag` blocks, values padded by `padding`."""

    def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
        def read(body: str) -> list[ToolCallRequest]:
            m = _FUNCTION.match(body)
            if m is None or not m.group(3):
                return [ToolCallRequest(m.group(1).strip() if m else None, None, body, "malformed_structure")]
            params = _PARAM.findall(m.group(2))
            if m.group(2).count("<parameter=") != len(params):
                return [ToolCallRequest(m.group(1).strip(), None, body, "malformed_structure")]
            return [xml_arguments(m.group(1).strip(), params, tools, body, padding)]
        return parse_blocks(text, open_tag, close_tag, read)
    return parse


def _expected(open_tag: str, close_tag: str) -> str:
    return f"{open_tag}\n<function=<tool name>>\n<parameter=<name>>\n<value>\n</parameter>\n</function>\n{close_tag}"


QWEN_XML = ToolFormat(
    name="qwen_xml", expected_format=_expected("<tool_call>", "</tool_call>"), markers=("<tool_call>",),
    renders=re.compile(r"<tool_call>\s*<function=skyrl_probe_call>"),
    instructs=re.compile(r"<tool_call>\s*<function="),
    parse_text=xml_parser("<tool_call>", "</tool_call>"),
    padded=lambda padding: xml_parser("<tool_call>", "</tool_call>", padding),
    description="XML parameters in <tool_call> (Qwen3-Coder, Qwen3.5, Nemotron 3)")
SEED_XML = ToolFormat(
    name="seed_xml", expected_format=_expected("<seed:tool_call>", "</seed:tool_call>"),
    markers=("<seed:tool_call>",), renders=re.compile(r"<seed:tool_call>\s*<function=skyrl_probe_call>"),
    instructs=re.compile(r"<seed:tool_call>"),
    parse_text=xml_parser("<seed:tool_call>", "</seed:tool_call>"),
    padded=lambda padding: xml_parser("<seed:tool_call>", "</seed:tool_call>", padding),
    description="XML parameters in <seed:tool_call> (Seed-OSS)")
