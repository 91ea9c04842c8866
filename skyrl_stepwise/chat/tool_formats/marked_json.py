"""JSON calls after a marker the template itself writes, for any marker: `<tool_calls>[{"name", "arguments"}, ...]
</tool_calls>` (Apriel 1.5/1.6), `<|function_call|>{"name", "arguments"}` (GigaChat 3.1), `<tool_calls>\\n{...}\\n{...}
\\n</tool_calls>` (MiniMax-M1).

Many templates write a call as a JSON object (or a list of them) holding `name` and `arguments` (or `parameters`)
right after a marker of their own. Rather than one format per marker, the marker is read from the template's
rendering of the probe call (the word or tag right before the JSON value that holds the call), and the format is
accepted only where reading that rendering back with it gives exactly the probe call (and, where the template
renders two calls in one turn, both): a template whose JSON calls this reader cannot read back is still refused.
"""

from __future__ import annotations

import json
import os
import re
from functools import partial

from skyrl_stepwise.chat.tool_formats.base import PROBE_ARG, PROBE_NAME, ToolFormat, parse_marked_json

_DECODER = json.JSONDecoder()
_ARGS_KEYS = ("arguments", "parameters")
_TAG_AT_END = re.compile(r"<[^<>\s]+>$")  # `<|begin_assistant|><tool_calls>`: the marker is the last tag


def _holds_probe_call(value) -> bool:
    items = value if isinstance(value, list) else [value]
    return any(isinstance(item, dict) and item.get("name") == PROBE_NAME for item in items)


def _probe_call_value(text: str) -> tuple[int, int, object] | None:
    """(start, end, value) of the first JSON value in `text` that holds the probe call (an object or a list)."""
    for match in re.finditer(r"[\[{]", text):
        try:
            value, end = _DECODER.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if _holds_probe_call(value):
            return match.start(), end, value
    return None


def _reads_back(parse, text: str, n_calls: int) -> bool:
    """Whether `parse` reads exactly `n_calls` probe calls (their arguments as rendered) from `text`."""
    _, calls = parse(text, None)
    if len(calls) != n_calls:
        return False
    for call in calls:
        arguments = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
        if call.error is not None or call.name is None or not call.name.startswith(PROBE_NAME) \
                or arguments != {PROBE_ARG: 1}:
            return False
    return True


def marked_json_format(before: str, with_call: str, with_two_calls: str = "") -> ToolFormat | None:
    """The format of a template that renders the probe call as JSON after a marker of its own (module docstring),
    or None: no such JSON, no marker before it (the JSON opens the turn), or a rendering it does not read back."""
    shared = len(os.path.commonprefix([before, with_call]))
    turn = with_call[shared:]  # what the template writes for the call turn after the generation prompt's part
    found = _probe_call_value(turn)
    if found is None:
        return None
    start, end, value = found
    lead = turn[:start].rstrip()
    words = lead.split()
    if not words:
        return None
    marker = words[-1]
    tag = _TAG_AT_END.search(marker)
    marker = tag.group(0) if tag else marker
    # the marker must open the call turn (whitespace apart): text before it (a role header after the turn's end,
    # GigaChat 3's `<|message_sep|>\n\nfunction call<|role_sep|>`) would be sampled after a stop token
    if PROBE_NAME in marker or not marker.strip("[]{}\"'") or lead[:len(lead) - len(marker)].strip():
        return None
    close = re.match(r"\s*(</[^<>\s]+>)?", turn[end:]).group(1) or ""  # a close tag right after, if any
    item = value[0] if isinstance(value, list) else value
    args_key = next((k for k in _ARGS_KEYS if k in item), "arguments")
    shape = f'{{"name": <tool name>, "{args_key}": <JSON object>}}'
    expected = f"{marker}{'[' + shape + ', ...]' if isinstance(value, list) else shape}{close}"
    parse = partial(_parse, marker=marker)
    if not _reads_back(parse, turn, 1):
        return None
    if with_two_calls and PROBE_NAME in with_two_calls:
        two = with_two_calls[len(os.path.commonprefix([before, with_two_calls])):]
        if not _reads_back(parse, two, min(2, two.count(PROBE_NAME))):  # (GigaChat 3.1 renders one call a turn)
            return None
    return ToolFormat(
        name="marked_json", expected_format=expected, markers=(marker,),
        renders=re.compile(re.escape(marker) + r"\s*[\[{]"), parse_text=parse,
        description=f"JSON calls after the template's own marker {marker!r}")


def _parse(text: str, tools: list[dict] | None = None, *, marker: str):
    return parse_marked_json(text, marker, args_keys=_ARGS_KEYS, consecutive=True)
