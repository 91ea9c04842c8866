"""Context policies: what a long-horizon trajectory keeps between turns, decided on messages, rendered exactly.

A policy never touches token ids. It sees the context as the first messages (system prompt, task, tools) and the
turns since, each turn being the ids exactly as sampled, the assistant message the template renders around them and
the observations that answered it. It returns what to keep: observations capped as they arrive (`truncate`), older
observations replaced by a placeholder (`sliding_window`), or a summary restart (`summarize`, sampled by the agent
loop). `rebuild` then turns what is kept into ids the way the agent loop does every turn: the first prompt
rendered once, then each turn's sampled ids extended by exactly what the template puts after them (`next_prompt`),
so no sampled id is ever decoded and re-encoded; where the template forces a re-render it is counted.

An edit makes the next prompt something other than prompt + response + observation: a new step chain starts there
(merging starts a new sample), counted under `context/*`, never as a template fallback.

A plugin is `pkg.module:Class`, built with the `ContextConfig`, offering `between_turns(view)` and optionally
`observe(observations, tokens)` (the protocol below); it is imported at start-up, and an exception it raises during
a rollout fails that trajectory only (cause `context_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from skyrl_stepwise.envs.base import Message
from skyrl_stepwise.generator.config import ContextConfig, load_plugin

TRUNCATION_MARKER = "\n[... {cut} tokens cut ...]\n"


@dataclass
class KeptTurn:
    """One turn as it stands in the context: sampled ids (+ a masked EOS we appended), its assistant message and
    the observations as kept (original, truncated or a placeholder)."""

    response_ids: list[int]
    assistant: Message
    observations: list[Message]
    keep_turn: bool = False  # a malformed call: extended as sampled under either thinking_retention
    kind: str = "action"  # or "summary"
    edited: bool = False  # its observations were already replaced


@dataclass
class Tokens:
    """Counting and cutting observation text with the model's tokenizer (never used on sampled ids)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    def count(self, text: str) -> int:
        """Token count of a text as the model would see it on its own."""
        return len(self.encode(text))


@dataclass
class ContextView:
    """What a policy decides on, read-only: the first messages, the turns since, and the next prompt's length."""

    initial: list[Message]
    turns: list[KeptTurn]
    next_prompt_tokens: int
    max_input_length: int
    summaries: int  # summary restarts so far in this trajectory
    tokens: Tokens


@dataclass
class ObservationEdit:
    """Observations as they will enter the context, and how many tokens were cut from them."""

    observations: list[Message]
    tokens_dropped: int = 0
    note: str = ""


@dataclass
class ContextEdit:
    """What to keep: replacement observations for some past turns (by index into `view.turns`), or a summary
    restart. `note` says what was dropped or summarised (shown by `show`)."""

    replace: dict[int, list[Message]] = field(default_factory=dict)
    summarize: bool = False
    tokens_dropped: int = 0
    note: str = ""


class ContextPolicy(Protocol):
    """A context policy (built-in or plugin)."""

    name: str

    def observe(self, observations: list[Message], tokens: Tokens) -> ObservationEdit | None:
        """Edit observations before they enter the context (no chain break); None: keep them as they are."""
        ...

    def between_turns(self, view: ContextView) -> ContextEdit | None:
        """Decide, with the next prompt rendered, whether to edit the context; None: keep it."""
        ...


def _contents(messages: list[Message]) -> str:
    return "".join(m["content"] for m in messages if isinstance(m.get("content"), str))


class NoPolicy:
    """Keeps everything: the context grows until max_input_length, then the trajectory stops (context_exhausted)."""

    name = "none"

    def __init__(self, cfg: ContextConfig) -> None:
        self.cfg = cfg

    def observe(self, observations: list[Message], tokens: Tokens) -> ObservationEdit | None:
        """Nothing to cut."""
        return None

    def between_turns(self, view: ContextView) -> ContextEdit | None:
        """Nothing to drop."""
        return None


class Truncate(NoPolicy):
    """Caps each observation at `max_observation_tokens`: its head and tail kept, a marker saying how much was cut.
    Applied before the observation is rendered, so the chain is not broken."""

    name = "truncate"

    def observe(self, observations: list[Message], tokens: Tokens) -> ObservationEdit | None:
        """Cut every observation over the cap; None where none is."""
        cap, kept, dropped, cut_any = self.cfg.max_observation_tokens, [], 0, 0
        for m in observations:
            content = m.get("content")
            ids = tokens.encode(content) if isinstance(content, str) else []
            if len(ids) <= cap:
                kept.append(m)
                continue
            head = int(round(cap * self.cfg.truncate_head_fraction))
            tail = cap - head
            cut = len(ids) - cap
            text = tokens.decode(ids[:head]) + TRUNCATION_MARKER.format(cut=cut) + (tokens.decode(ids[-tail:])
                                                                                    if tail else "")
            kept.append(dict(m, content=text))
            dropped += cut
            cut_any += 1
        if not cut_any:
            return None
        return ObservationEdit(kept, dropped, f"{cut_any} observation(s) truncated to {cap} tokens, {dropped} cut")


class SlidingWindow(NoPolicy):
    """Keeps the observations of the last `window` turns; older ones become a short placeholder (role, name and
    call id kept, so the template still pairs each result with its call)."""

    name = "sliding_window"

    def between_turns(self, view: ContextView) -> ContextEdit | None:
        """Replace the observations of every action turn that left the window (once each)."""
        edit = ContextEdit()
        for i, turn in enumerate(view.turns[:max(len(view.turns) - self.cfg.window, 0)]):
            if turn.kind != "action" or turn.edited or not _contents(turn.observations).strip():
                continue
            new = []
            for m in turn.observations:
                content = m.get("content")
                if not isinstance(content, str) or not content.strip():
                    new.append(m)
                    continue
                n = view.tokens.count(content)
                new.append(dict(m, content=self.cfg.placeholder.format(tokens=n)))
                edit.tokens_dropped += max(n - view.tokens.count(new[-1]["content"]), 0)
            edit.replace[i] = new
        if not edit.replace:
            return None
        edit.note = f"observations of turn(s) {sorted(edit.replace)} replaced by placeholders"
        return edit


class Summarize(NoPolicy):
    """When the next prompt would exceed the threshold, ask for a summary turn (sampled by the agent loop); the
    context then restarts from the first messages and that summary."""

    name = "summarize"

    def between_turns(self, view: ContextView) -> ContextEdit | None:
        """A summary restart once the next prompt crosses the threshold (at most max_summaries times)."""
        if view.next_prompt_tokens <= self.cfg.threshold(view.max_input_length):
            return None
        if view.summaries >= self.cfg.max_summaries:
            return None
        return ContextEdit(summarize=True, note=f"next prompt {view.next_prompt_tokens} tokens > "
                                                f"{self.cfg.threshold(view.max_input_length)}: summarised")


BUILTIN_POLICIES = {"none": NoPolicy, "truncate": Truncate, "sliding_window": SlidingWindow, "summarize": Summarize}


def make_policy(cfg: ContextConfig) -> ContextPolicy:
    """The configured policy (one instance per agent loop: policies decide from the view, they keep no state)."""
    cls = BUILTIN_POLICIES.get(cfg.policy) or load_plugin(cfg.policy, "generator.context.policy")
    policy = cls(cfg)
    if not hasattr(policy, "name"):
        policy.name = cfg.policy
    if not callable(getattr(policy, "observe", None)):
        policy.observe = lambda observations, tokens: None
    return policy


def flatten(initial: list[Message], turns: list[KeptTurn]) -> list[Message]:
    """The message history the template renders: the first messages, then each turn and its kept observations."""
    history = list(initial)
    for turn in turns:
        history.append(turn.assistant)
        history.extend(turn.observations)
    return history


@dataclass
class Rebuilt:
    """The prompt after an edit, and how many of its turns the template forced to re-render."""

    ids: list[int]
    rerenders: int


def rebuild(chat, initial: list[Message], turns: list[KeptTurn], tools: list[dict] | None,
            retokenize: bool = False) -> Rebuilt:
    """The next prompt for what is kept, built as the agent loop builds every prompt: the first messages rendered
    once, then each turn's sampled ids extended by what the template puts after them. `retokenize`: the whole kept
    history rendered as text (generator.history=retokenize)."""
    if retokenize:
        return Rebuilt(chat.prompt_ids(flatten(initial, turns), tools), 0)
    ids = chat.prompt_ids(initial, tools)
    history, rerenders = list(initial), 0
    for turn in turns:
        history.append(turn.assistant)
        history.extend(turn.observations)
        nxt = chat.next_prompt(ids, turn.response_ids, history, turn.observations, tools, turn.keep_turn)
        rerenders += not nxt.extended
        ids = nxt.ids
    return Rebuilt(ids, rerenders)
