"""The replay matcher: which earlier sampled call does an echoed conversation continue?

Agent programs send the whole conversation back as text on every call, re-serialised by their client: tool-call
arguments re-dumped (other spacing, key order), whitespace stripped around content and calls, `content: null`
for "", reasoning dropped. Re-rendering that text is where exactness breaks (Qwen3's template canonicalises the
whitespace around tool calls, rLLM PR 516). So we never render an echoed sampled turn: we compare messages by
what they mean (role, text without whitespace, call names and parsed arguments) and, where a request's messages
begin with an earlier call's messages plus the assistant turn we returned for it, reuse that call's ids.

What does not match is a changed history (dropped, edited or summarised messages): a new chain from the
template's rendering, with the reason the first difference gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

Key = tuple


def _text(value: Any) -> str:
    """Text with every whitespace character removed: clients strip and re-indent freely."""
    return "".join(str(value or "").split())


def _arguments(value: Any) -> str:
    """Arguments as canonical JSON (sorted keys, no spacing), whatever JSON spelling the client echoed."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return _text(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _calls(message: dict) -> tuple:
    return tuple((c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
                 for c in message.get("tool_calls") or [])


def message_key(message: dict) -> Key:
    """What a message means for the prompt, ignoring how a client spells it (`developer` is `system`)."""
    role = "system" if message.get("role") == "developer" else message.get("role")
    if role == "tool":
        return role, _text(message.get("content")), message.get("tool_call_id") or ""
    return role, _text(message.get("content")), _calls(message)


def assistant_echoes(echo: dict, reply: dict) -> bool:
    """Whether `echo` is the assistant turn we replied with: same text and calls; reasoning may be dropped (most
    clients do) but not changed."""
    if echo.get("role") != "assistant" or message_key(echo) != message_key(reply):
        return False
    for key in ("reasoning_content", "reasoning", "thinking"):
        if echo.get(key) and _text(echo[key]) != _text(reply.get("reasoning_content")):
            return False
    return True


@dataclass
class Match:
    """The request continues call `index`: its messages are that call's, its reply, then `new` (never empty)."""

    index: int
    new: list[dict]
    repeated: bool = False  # the very same messages as that call: the same prompt is sampled again


def find_match(messages: Sequence[dict], calls: Sequence[tuple[list[Key], dict, Key]], tools_key: Key) -> Match | None:
    """The latest call (request keys, reply, tools key) that `messages` continue, or None."""
    keys = [message_key(m) for m in messages]
    for index in range(len(calls) - 1, -1, -1):
        request_keys, reply, call_tools = calls[index]
        if call_tools != tools_key:
            continue
        n = len(request_keys)
        if keys == request_keys:
            return Match(index, [], repeated=True)
        if len(keys) > n + 1 and keys[:n] == request_keys and assistant_echoes(messages[n], reply):
            new = list(messages[n + 1:])
            if any(m.get("role") == "assistant" for m in new):
                continue  # an assistant turn the server did not sample: not a continuation
            return Match(index, new)
    return None


def break_reason(messages: Sequence[dict], calls: Sequence[tuple[list[Key], dict, Key]], tools_key: Key) -> str:
    """Why `messages` continue no earlier call, judged against the latest one (a `gateway/chain_breaks/*` name)."""
    request_keys, reply, call_tools = calls[-1]
    if call_tools != tools_key:
        return "tools_changed"
    keys = [message_key(m) for m in messages]
    expected = request_keys + [message_key(reply)]
    n = len(request_keys)
    for i, key in enumerate(expected):
        if i >= len(keys):
            return "dropped_message"
        if keys[i] == key and (i < n or assistant_echoes(messages[i], reply)):
            continue
        if i == n and keys[i][0] == "assistant":
            return "assistant_turn_edited"
        if i == n:  # the request goes on past our reply without it (mini-swe-agent on a format error)
            return "reply_dropped"
        if i + 1 < len(expected) and keys[i] == expected[i + 1]:
            return "dropped_message"
        if i + 1 < len(keys) and keys[i + 1] == key:
            return "inserted_message"
        return "edited_message"
    if any(m.get("role") == "assistant" for m in messages[len(expected):]):
        return "client_assistant_turn"
    return "no_new_messages"
