"""GLM 4.5 / 4.6 / 4.7 / 5 calls: `<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`.

Values are kept as written less the template's own padding and typed by the tool's schema (xml_values.py): the
`renderers` library's token-level `GlmToolParser` JSON-decodes every value without the schema (a string argument
"2024" would become 2024 and fail the schema), and its schema-aware reader strips every value. So we read the
decoded text, which also works where a tokenizer spells the tags in pieces.
"""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_blocks, xml_arguments
from skyrl_stepwise.chat.tool_formats.xml_values import DEFAULT_PADDING, ValuePadding

GLM_FORMAT = "<tool_call><tool name>\n<arg_key><name></arg_key>\n<arg_value><value></arg_value>\n</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def glm_parser(padding: ValuePadding = DEFAULT_PADDING):
    """The reader of decoded GLM text, values padded by `padding`."""

    def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
        return _parse_glm_text(text, tools, padding)
    return parse


def parse_glm_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded GLM text (values padded by default)."""
    return _parse_glm_text(text, tools, DEFAULT_PADDING)


def _parse_glm_text(text: str, tools: list[dict] | None, padding: ValuePadding) -> tuple[str, list[ToolCallRequest]]:

    def read(body: str) -> list[ToolCallRequest]:
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        pairs = _PAIR.findall(body)
        if not name or "<" in name or "\n" in name:
            return [ToolCallRequest(None, None, body, "missing_name")]
        if len(pairs) != body.count("<arg_key>") or len(pairs) != body.count("<arg_value>"):
            return [ToolCallRequest(name, None, body, "malformed_structure")]
        return [xml_arguments(name, pairs, tools, body, padding)]
    return parse_blocks(text, "<tool_call>", "</tool_call>", read)


GLM = ToolFormat(
    name="glm", expected_format=GLM_FORMAT, markers=("<tool_call>",),
    renders=re.compile(r"<tool_call>\s*skyrl_probe_call\s*<arg_key>"),
    instructs=re.compile(r"<tool_call>.*?<arg_key>", re.DOTALL),
    parse_text=parse_glm_text, padded=glm_parser, description="GLM <arg_key>/<arg_value> (GLM 4.5, 4.6, 4.7, 5)")
