"""The tool-call parser of a model that uses its own chat template: a facade over `chat/tool_formats/` (one reader
per format, the format recognised from the template's rendering of a probe call)."""

from __future__ import annotations

from skyrl_stepwise.chat.tool_formats import FORMATS, ToolParser, tool_format, tool_format_names
from skyrl_stepwise.chat.tool_formats.detect import (ProbeRendering, RoundTripper, ToolFormatRoundTripFailed,
                                                     UnknownToolFormat, detect_tool_format)
from skyrl_stepwise.chat.tool_formats.harmony import HARMONY_FORMAT, parse_harmony_text
from skyrl_stepwise.chat.tool_formats.hermes import HERMES_FORMAT, parse_hermes_text
from skyrl_stepwise.chat.tool_formats.llama_json import LLAMA_JSON_FORMAT
from skyrl_stepwise.chat.tool_formats.mistral import MISTRAL_CALLS, MISTRAL_FORMAT, mistral_call_id, parse_mistral_text
from skyrl_stepwise.chat.tool_formats.xml_values import ValuePadding


def tool_parser_for(probe: ProbeRendering, tokenizer, requested: str = "auto",
                    padding: ValuePadding | None = None, round_trip: RoundTripper | None = None) -> ToolParser:
    """The parser for the call format the chat template renders (what the model was trained to sample), or the
    one `generator.tool_parser` names; an unknown rendered format, or one whose reader does not read the template's
    own probe calls back (`round_trip`), fails here, at startup (UnknownToolFormat, ToolFormatRoundTripFailed).
    `padding`: what the template writes around an XML-style value (probed), removed from every value read. A
    format the user names is taken as named: it is how a template the round trip refuses can still be served."""
    model = getattr(tokenizer, "name_or_path", "") or "<unnamed tokenizer>"
    fmt = tool_format(requested) if requested != "auto" else detect_tool_format(probe, model, round_trip)
    return ToolParser(fmt, tokenizer, padding)


__all__ = ["FORMATS", "HARMONY_FORMAT", "HERMES_FORMAT", "LLAMA_JSON_FORMAT", "MISTRAL_CALLS", "MISTRAL_FORMAT",
           "ProbeRendering", "ToolFormatRoundTripFailed", "ToolParser", "UnknownToolFormat", "mistral_call_id", "parse_harmony_text",
           "parse_hermes_text", "parse_mistral_text", "tool_format_names", "tool_parser_for"]
