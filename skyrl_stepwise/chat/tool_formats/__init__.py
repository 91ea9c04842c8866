"""Tool calls in each model family's own format: one small reader per format, and the choice of format from what
the model's chat template renders (detect.py), not from the model's name.

Each format module describes its format as a `ToolFormat` and reads it; where the `renderers` library has a
parser for a format it is used (hermes, DeepSeek V3/R1 token-level parsers; the library's schema rule for
XML-style values; its Gemma 4 argument grammar), ours are written only for what it lacks.
"""

from __future__ import annotations

from skyrl_stepwise.chat.tool_formats.base import PROBE_ARG, PROBE_NAME, ToolFormat, ToolParser
from skyrl_stepwise.chat.tool_formats.command_r import COMMAND_R
from skyrl_stepwise.chat.tool_formats.deepseek import DEEPSEEK_V3, DEEPSEEK_V31
from skyrl_stepwise.chat.tool_formats.functionary import FUNCTIONARY
from skyrl_stepwise.chat.tool_formats.gemma4 import GEMMA4
from skyrl_stepwise.chat.tool_formats.glm import GLM
from skyrl_stepwise.chat.tool_formats.granite import GRANITE
from skyrl_stepwise.chat.tool_formats.harmony import HARMONY
from skyrl_stepwise.chat.tool_formats.hermes import HERMES, HERMES_DICT
from skyrl_stepwise.chat.tool_formats.json_lists import BARE_JSON_LIST, FIREFUNCTION, NEMOTRON_TOOLCALL
from skyrl_stepwise.chat.tool_formats.kimi import KIMI_K2
from skyrl_stepwise.chat.tool_formats.llama_json import LLAMA_JSON
from skyrl_stepwise.chat.tool_formats.minimax import MINIMAX
from skyrl_stepwise.chat.tool_formats.mistral import MISTRAL
from skyrl_stepwise.chat.tool_formats.pythonic import PYTHONIC
from skyrl_stepwise.chat.tool_formats.xml_params import QWEN_XML, SEED_XML

# Tried in this order on a template's rendering; each `renders` pattern names the probe call, so at most one
# matches a rendering, except hermes and llama_json (a JSON object), which come last. Detection takes the first
# match whose reader reads the rendered probe calls back (the start-up round trip, detect.py).
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    HARMONY, MISTRAL, DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2, GLM, QWEN_XML, SEED_XML, FUNCTIONARY, MINIMAX, GEMMA4,
    COMMAND_R, GRANITE, FIREFUNCTION, NEMOTRON_TOOLCALL, BARE_JSON_LIST, PYTHONIC, HERMES_DICT, HERMES, LLAMA_JSON)}


def tool_format_names() -> list[str]:
    """Every value generator.tool_parser accepts."""
    return ["auto", *FORMATS]


def tool_format(name: str) -> ToolFormat:
    """The format named `name` (a generator.tool_parser value other than auto)."""
    if name not in FORMATS:
        raise ValueError(f"generator.tool_parser={name!r} is not one of {tool_format_names()}")
    return FORMATS[name]


__all__ = ["FORMATS", "PROBE_ARG", "PROBE_NAME", "ToolFormat", "ToolParser", "tool_format", "tool_format_names"]
