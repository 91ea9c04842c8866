"""XML-style argument values (`<parameter=k>v</parameter>`, `<arg_value>v</arg_value>`): typed by the tool's
schema and kept verbatim.

Why: such a value carries no JSON quotes, so whether `2024` is the string "2024" or the number 2024 is decided by
the schema. A value stays text wherever its schema admits a string at all (a type list like ["string", "null"],
OpenAI strict mode's optional field; a string enum; anyOf/oneOf with a string branch; no schema, an undeclared
parameter); otherwise it is read as JSON, and text that is not JSON stays text: the executor's schema check then
names the mistake ("'five' is not of type 'integer'"), as it does for the JSON formats. The text is the value
exactly as written, less only the whitespace the template itself writes around every value (probed from its
rendering, `ValuePadding`), so `old_str='    return x\\n'` reads back as written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from skyrl_stepwise.chat.base import ToolCallRequest

PROBE_VALUE = "SKYRLPROBEVALUE"  # a string argument value the template is asked to render, to see its padding
_PADDING = re.compile(r">([ \t\r\n]*)" + PROBE_VALUE + r"([ \t\r\n]*)<")


@dataclass(frozen=True)
class ValuePadding:
    """The whitespace a template writes before and after every value (Qwen3-Coder: "\\n" and "\\n"; GLM, MiniMax,
    Seed-OSS: none); a reader removes exactly it, once, where present."""

    lead: str = "\n"
    trail: str = "\n"

    def unpad(self, text: str) -> str:
        """The value as the model meant it: `text` less this padding (once at each end, where present)."""
        if self.lead and text.startswith(self.lead):
            text = text[len(self.lead):]
        if self.trail and text.endswith(self.trail):
            text = text[:-len(self.trail)]
        return text


# Where no rendering was probed (a format named by generator.tool_parser on a renderer that cannot render it): at
# most one newline each side, the padding of the Qwen3-Coder family and harmless elsewhere.
DEFAULT_PADDING = ValuePadding()


def probed_padding(rendering: str) -> ValuePadding | None:
    """The padding around `PROBE_VALUE` in a template's rendering of a call with that string value; None where the
    rendering does not show it between tags (not an XML-style format)."""
    m = _PADDING.search(rendering)
    return ValuePadding(m.group(1), m.group(2)) if m else None


def schema_admits_string(schema: Any) -> bool:
    """Whether a JSON-schema fragment accepts some string: then an XML value is that string, never JSON-decoded."""
    if not isinstance(schema, dict):
        return True  # no schema: anything, a string included
    if "const" in schema:
        return isinstance(schema["const"], str)
    if "enum" in schema:
        return any(isinstance(v, str) for v in schema["enum"] or [])
    branches = [b for key in ("anyOf", "oneOf") for b in schema.get(key) or []]
    if branches:
        return any(schema_admits_string(b) for b in branches)
    declared = schema.get("type")
    if declared is None:
        return True  # an untyped fragment ({"description": ...}) accepts anything
    return declared == "string" or (isinstance(declared, list) and "string" in declared)


def typed_value(text: str, schema: dict | None) -> Any:
    """An XML value typed by its schema (see module docstring): the text where a string is admitted, else its JSON
    value, else the text itself (the schema check, not the parser, answers a wrong type)."""
    if schema_admits_string(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def xml_call(name: str, pairs: list[tuple[str, str]], params: dict[str, dict], raw: str,
             padding: ValuePadding) -> ToolCallRequest:
    """A well-formed call from its (key, value as written) pairs; `params`: the tool's parameter schemas ({} for a
    tool that does not exist: the executor's lookup answers it)."""
    arguments = {key.strip(): typed_value(padding.unpad(value), params.get(key.strip())) for key, value in pairs}
    return ToolCallRequest(name, arguments, raw)
