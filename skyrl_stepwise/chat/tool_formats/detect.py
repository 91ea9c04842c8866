"""The call format of a chat template, recognised from its own rendering of a probe call, and proved by reading that
rendering back (the start-up round trip).

The template is asked to render an assistant turn that calls `skyrl_probe_call`; the text it adds for that turn
(the rendering minus the common prefix with the conversation before it) is matched against every format's
`renders` pattern. A pattern only says a format *looks* right: Llama 4 writes Llama 3's JSON after a
`<|python_start|><|python_end|>` prefix, and a reader that refused that prefix took every call for a final answer,
silently. So every candidate is proved before it is chosen: the probe call turn (and the two-call turn, where the
template renders parallel calls) goes through the reader the run will use, exactly as sampled ids would, and must
come back as the same calls, names and arguments (`RoundTrip`). The first candidate that does is the format; a
template whose calls match a pattern but come back different is refused, naming the format, the rendered text and
what was parsed (`ToolFormatRoundTripFailed`).

A template that does not render `tool_calls` at all (Granite 3.3, Falcon-H1) is recognised from the tool
instructions it renders (`instructs`: there is no rendered call to read back); one that renders neither calls nor
tools gets our hermes tools block, so hermes. Anything else is an unknown format: refused at startup, because a
parser that reads no call would take every call for a final answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from skyrl_stepwise.chat.tool_formats import FORMATS, PROBE_ARG, PROBE_NAME, ToolFormat
from skyrl_stepwise.chat.tool_formats.hermes import HERMES
from skyrl_stepwise.chat.tool_formats.marked_json import marked_json_format


_CONTEXT = 16  # characters kept before the point where the renderings part
# the probe calls' own schemas (`probe_call_message` names a second call `skyrl_probe_call1`), given to the reader in
# the round trip, so an XML-style value reads back typed as the rendered argument (an integer)
ROUND_TRIP_TOOLS = [{"type": "function", "function": {"name": name, "description": "d", "parameters": {
    "type": "object", "properties": {PROBE_ARG: {"type": "integer"}}}}} for name in (PROBE_NAME, f"{PROBE_NAME}1")]


class UnknownToolFormat(ValueError):
    """The template renders tool calls in a format no parser reads."""


class ToolFormatRoundTripFailed(UnknownToolFormat):
    """The template's calls look like a known format, but its reader does not read them back as rendered."""


@dataclass(frozen=True)
class ProbeRendering:
    """What the template rendered: the conversation without the call, with it, and whether it rendered tools."""

    before: str  # [user] with the generation prompt
    with_call: str  # [user, assistant with the probe call]; "" if the template refused it
    renders_tools: bool
    with_two_calls: str = ""  # the same with two parallel calls; "" if not rendered
    call_error: str = ""  # why the template refused every probe call turn (its exception), "" if it rendered one
    without_tools: str = ""  # `before` rendered without tool schemas: the difference is the template's tools text

    @property
    def call_turn(self) -> str:
        """The text the template added for the call turn, from a little before where the two renderings part (a
        marker the generation prompt shares with the call, like Gemma 4's `<|`, is not cut in two)."""
        shared = len(os.path.commonprefix([self.before, self.with_call]))
        return self.with_call[max(0, shared - _CONTEXT):]

    @property
    def call_turn_from_tag(self) -> str:
        """`call_turn` from the start of the tag it begins inside, if any (`<|im_start|>assistant`, never
        `tart|>assistant`): what a refusal quotes of a turn the template rendered without the call."""
        start = max(0, len(os.path.commonprefix([self.before, self.with_call])) - _CONTEXT)
        tag = self.with_call.rfind("<", 0, start + 1)
        return self.with_call[tag if 0 <= tag and start - tag < _CONTEXT and ">" not in self.with_call[tag:start]
                              else start:]

    @property
    def renders_calls(self) -> bool:
        return PROBE_NAME in self.call_turn

    @property
    def tools_text(self) -> str:
        """What the template writes for tool schemas (its tool instructions among it), "" if unknown."""
        if not self.without_tools or not self.renders_tools:
            return ""
        head = len(os.path.commonprefix([self.before, self.without_tools]))
        tail = len(os.path.commonprefix([self.before[head:][::-1], self.without_tools[head:][::-1]]))
        return self.before[head:len(self.before) - tail]


@dataclass(frozen=True)
class RoundTrip:
    """One rendered probe call turn read back with a format's reader: what was rendered, what came back."""

    format: str
    rendered: str  # the call turn as the model would sample it, through its stop token
    expected: tuple[tuple[str, dict], ...]  # (name, arguments) of each call rendered
    parsed: tuple[tuple[str | None, object, str | None], ...]  # (name, arguments, error) of each call read

    @property
    def ok(self) -> bool:
        return self.parsed == tuple((name, arguments, None) for name, arguments in self.expected)


# format -> the round trips of the template's probe call turns with that format's reader (one, or two with parallel
# calls); built by the renderer, which alone can tokenize, stop and parse as a sampled turn is
RoundTripper = Callable[[ToolFormat], "list[RoundTrip]"]


def detect_tool_format(probe: ProbeRendering, model: str, round_trip: RoundTripper | None = None) -> ToolFormat:
    """The format whose pattern matches the template's probe call rendering and whose reader reads it back (see
    module docstring); `round_trip` None: the first match, unproved."""
    if probe.renders_calls:
        turn = probe.call_turn
        candidates = [f for f in FORMATS.values() if f.renders.search(turn)]
        marked = marked_json_format(probe.before, probe.with_call, probe.with_two_calls)
        candidates += [marked] if marked is not None else []
        if candidates:
            return _proved(candidates, round_trip, model)
        found = None
    else:
        found = next((f for f in FORMATS.values() if f.instructs is not None and f.instructs.search(probe.with_call
                                                                                                  or probe.before)),
                     None)
        if found is None and not probe.renders_tools:
            return HERMES  # our hermes tools block tells the model how to call
        turn = probe.call_turn or probe.with_call
    if found is None and not probe.with_call and probe.call_error:
        raise UnknownToolFormat(
            f"the chat template of {model!r} renders tool schemas but fails on every assistant turn with "
            f"`tool_calls` ({probe.call_error[:200]}), so a call the model makes could never be shown back to it; "
            f"set generator.tool_parser to one of {sorted(FORMATS)} if one of them is the model's format")
    if found is None and not probe.renders_calls:
        instructions = probe.tools_text.strip()
        raise UnknownToolFormat(
            f"the chat template of {model!r} renders tool schemas but no tool calls: the probe call's turn renders "
            f"as {_quote(probe.call_turn_from_tag)!r}, without the call, and its tool instructions, which alone could say how to call, "
            f"match no format a parser reads (they end {instructions[-200:]!r}); set generator.tool_parser to one "
            f"of {sorted(FORMATS)} if one of them is the model's format")
    if found is None:
        raise UnknownToolFormat(
            f"the chat template of {model!r} renders tool calls in a format no parser reads: "
            f"{_quote(turn)!r}; set generator.tool_parser to one of {sorted(FORMATS)} "
            "if one of them is the model's format")
    return found


def _proved(candidates: list[ToolFormat], round_trip: RoundTripper | None, model: str) -> ToolFormat:
    """The first candidate whose reader reads the template's probe calls back; refused where none does."""
    if round_trip is None:
        return candidates[0]
    failures = []
    for fmt in candidates:
        failed = next((trip for trip in round_trip(fmt) if not trip.ok), None)
        if failed is None:
            return fmt
        failures.append((fmt, failed))
    fmt, failed = failures[0]
    raise ToolFormatRoundTripFailed(
        f"the chat template of {model!r} renders tool calls as {fmt.name!r} ({fmt.description}), but that reader "
        f"does not read them back: the template rendered {failed.rendered!r}, which parsed as {list(failed.parsed)} "
        f"(name, arguments, error), not {list(failed.expected)}; every call the model makes in this format would "
        f"be misread, so the run does not start. Set generator.tool_parser to one of {sorted(FORMATS)} if one of "
        "them reads the model's calls")


def _quote(turn: str, width: int = 80, before: int = 50) -> str:
    """`width` characters of the call turn, from its start or, where the probe call's name lies further in (a
    template that writes reasoning stubs first, Kimi K3), from `before` characters ahead of it."""
    text = turn.strip()
    at = text.find(PROBE_NAME)
    return text[max(0, at - before) if at > before else 0:][:width]
