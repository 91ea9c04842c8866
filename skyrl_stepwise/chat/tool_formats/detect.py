"""The call format of a chat template, recognised from its own rendering of a probe call.

The template is asked to render an assistant turn that calls `skyrl_probe_call`; the text it adds for that turn
(the rendering minus the common prefix with the conversation before it) is matched against every format's
`renders` pattern. A template that does not render `tool_calls` at all (Granite 3.3) is recognised from the tool
instructions it renders (`instructs`); one that renders neither calls nor tools gets our hermes tools block, so
hermes. Anything else is an unknown format: refused at startup, because a parser that reads no call would take
every call for a final answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from skyrl_stepwise.chat.tool_formats import FORMATS, PROBE_NAME, ToolFormat
from skyrl_stepwise.chat.tool_formats.hermes import HERMES
from skyrl_stepwise.chat.tool_formats.marked_json import marked_json_format


_CONTEXT = 16  # characters kept before the point where the renderings part


class UnknownToolFormat(ValueError):
    """The template renders tool calls in a format no parser reads."""


@dataclass(frozen=True)
class ProbeRendering:
    """What the template rendered: the conversation without the call, with it, and whether it rendered tools."""

    before: str  # [user] with the generation prompt
    with_call: str  # [user, assistant with the probe call]; "" if the template refused it
    renders_tools: bool
    with_two_calls: str = ""  # the same with two parallel calls; "" if not rendered
    call_error: str = ""  # why the template refused every probe call turn (its exception), "" if it rendered one

    @property
    def call_turn(self) -> str:
        """The text the template added for the call turn, from a little before where the two renderings part (a
        marker the generation prompt shares with the call, like Gemma 4's `<|`, is not cut in two)."""
        shared = len(os.path.commonprefix([self.before, self.with_call]))
        return self.with_call[max(0, shared - _CONTEXT):]

    @property
    def renders_calls(self) -> bool:
        return PROBE_NAME in self.call_turn


def detect_tool_format(probe: ProbeRendering, model: str) -> ToolFormat:
    """The format whose pattern matches the template's probe call rendering (see module docstring)."""
    if probe.renders_calls:
        turn = probe.call_turn
        found = next((f for f in FORMATS.values() if f.renders.search(turn)), None) or marked_json_format(
            probe.before, probe.with_call, probe.with_two_calls)
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
    if found is None:
        raise UnknownToolFormat(
            f"the chat template of {model!r} renders tool calls in a format no parser reads: "
            f"{_quote(turn)!r}; set generator.tool_parser to one of {sorted(FORMATS)} "
            "if one of them is the model's format")
    return found


def _quote(turn: str, width: int = 80, before: int = 50) -> str:
    """`width` characters of the call turn, from its start or, where the probe call's name lies further in (a
    template that writes reasoning stubs first, Kimi K3), from `before` characters ahead of it."""
    text = turn.strip()
    at = text.find(PROBE_NAME)
    return text[max(0, at - before) if at > before else 0:][:width]
