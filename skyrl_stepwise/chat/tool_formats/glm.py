"""GLM 4.5 / 4.6 / 4.7 / 5 calls: `<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`.

Values are typed by the tool's schema with the `renderers` library's rule (verbatim where the schema says string,
else JSON): its token-level `GlmToolParser` JSON-decodes every value without the schema (a string argument
"2024" would become 2024 and fail the schema; plain text is flagged invalid_json), and its schema-aware reader
is part of the whole-response `parse_glm`, which also splits reasoning that the template backend leaves to the
template. So we read the decoded text, which also works where a tokenizer spells the tags in pieces.
"""

from __future__ import annotations

import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_blocks, xml_arguments

GLM_FORMAT = "<tool_call><tool name>\n<arg_key><name></arg_key>\n<arg_value><value></arg_value>\n</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call, every call attempt) from decoded GLM text."""

    def read(body: str) -> list[ToolCallRequest]:
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        pairs = _PAIR.findall(body)
        if not name or "<" in name or "\n" in name:
            return [ToolCallRequest(None, None, body, "missing_name")]
        if len(pairs) != body.count("<arg_key>") or len(pairs) != body.count("<arg_value>"):
            return [ToolCallRequest(name, None, body, "malformed_structure")]
        return [xml_arguments(name, pairs, tools, body)]
    return parse_blocks(text, "<tool_call>", "</tool_call>", read)


GLM = ToolFormat(
    name="glm", expected_format=GLM_FORMAT, markers=("<tool_call>",),
    renders=re.compile(r"<tool_call>\s*skyrl_probe_call\s*<arg_key>"),
    instructs=re.compile(r"<tool_call>.*?<arg_key>", re.DOTALL),
    parse_text=parse_glm_text, description="GLM <arg_key>/<arg_value> (GLM 4.5, 4.6, 4.7, 5)")
