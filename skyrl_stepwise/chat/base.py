"""The renderer contract the generator talks to: prompt ids for messages, the next prompt after a sampled turn,
and the sampled turn as a message. Two backends implement it: the PyPI `renderers` library where it knows the
model (hand-written renderers with an exact bridge), and the model's own chat template otherwise.

The rule both follow: the ids the model sampled are never re-rendered. The next prompt is the previous prompt +
the sampled ids + exactly what the model's template puts after them; where that cannot be proven, the full
history is re-rendered (a new step chain starts) and the reason is reported, never hidden.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, Any]


class RenderError(RuntimeError):
    """A conversation the renderer cannot turn into tokens as asked (e.g. a template that drops a role)."""


@dataclass
class NextPrompt:
    """The prompt of the next turn. `extended`: it starts with prompt + sampled ids (one chain); else `reason` is a
    short code (template_rewrites_history, thinking_retention_template, ...) that becomes a metric name."""

    ids: list[int]
    extended: bool
    reason: str = ""


@dataclass
class ToolCallRequest:
    """One tool call as parsed from sampled ids; `error` set when the model's call was malformed, and then
    `expected_format` (where the parser knows it) is what the answer tells the model a call looks like."""

    name: str | None
    arguments: dict | str | None
    raw: str = ""
    error: str | None = None
    id: str | None = None
    expected_format: str | None = None


@dataclass
class ParsedTurn:
    """A sampled assistant turn: what the env and the text history see (the ids stay as sampled)."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCallRequest] = field(default_factory=list)
    reasoning_key: str = "reasoning_content"  # where templates read it: Qwen3 `reasoning_content`, gpt-oss `thinking`

    def message(self) -> Message:
        """The assistant message for a full re-render of the history (OpenAI shape)."""
        msg: Message = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg[self.reasoning_key] = self.reasoning
        ok = [c for c in self.tool_calls if c.error is None]
        if ok:
            msg["tool_calls"] = [{"type": "function", "id": c.id or f"call_{i}",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for i, c in enumerate(ok)]
        return msg


class ChatRenderer(Protocol):
    """What the agent loop needs from a model family; see module docstring."""

    name: str
    stop_ids: set[int]  # ids that end an assistant turn when the model samples them
    close_id: int  # what we append (masked) to close a turn the model did not close itself

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The first prompt of a trajectory, rendered once from messages (with the generation prompt): every
        later prompt extends it, so this is the only full render a chain needs."""
        ...

    def next_prompt(self, prompt_ids: list[int], completion_ids: list[int], history: list[Message],
                    new_messages: list[Message], tools: list[dict] | None = None) -> NextPrompt:
        """The next turn's prompt: prompt + the sampled ids + exactly what the template puts after them (turn
        close, observations, generation prompt), so the trained ids stay the sampled ids; a re-render of
        `history` only where that cannot be proven, with the reason."""
        ...

    def parse(self, completion_ids: list[int], prompt_ids: list[int],
              tools: list[dict] | None = None) -> ParsedTurn:
        """The sampled turn as content, reasoning and tool calls, read from the ids the model sampled (not from a
        re-encoded text), so a call executed is a call the model made; malformed calls come back with an error."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text for envs and logs only: decoded text is never encoded back into a training target."""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids for text we add ourselves (observations outside a template); never for what the model sampled."""
        ...


def check_observations_kept(new_messages: list[Message], new_text: str, renderer_name: str) -> None:
    """Fail loudly when the rendering of the next turn lost an observation: a tool result the model never sees
    would train it on a conversation that did not happen (some templates silently skip `role: tool`)."""
    for message in new_messages:
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            continue
        text = content.strip()
        if text in new_text or json.dumps(text)[1:-1] in new_text:
            continue
        raise RenderError(f"the chat template of {renderer_name!r} drops {message.get('role')!r} messages: "
                          f"{text[:60]!r} is not in the next prompt; use a renderer or role the template supports")
