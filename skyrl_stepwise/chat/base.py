"""The renderer contract the generator talks to: prompt ids for messages, the next prompt after a sampled turn,
and the sampled turn as a message. Two backends implement it: the PyPI `renderers` library where it knows the
model (hand-written renderers with an exact bridge), and the model's own chat template otherwise.

The rule both follow: the ids the model sampled are never re-rendered. The next prompt is the previous prompt +
the sampled ids + exactly what the model's template puts after them; where that cannot be proven, the full
history is re-rendered (a new step chain starts) and the reason is reported, never hidden.
"""

from __future__ import annotations

import json
import os
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

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
    # the sampled text from the first call on: what a message without structured calls shows of a malformed turn
    calls_text: str = ""
    # `content` already ends with `calls_text` (a template that cannot render `tool_calls` keeps them in the text);
    # `answer` is then the text before the calls, what an OpenAI client is shown next to structured calls
    calls_in_content: bool = False

    @property
    def answer(self) -> str:
        """The turn's text without its calls' text (`content` unless the calls are kept in it)."""
        if self.calls_in_content and self.calls_text and self.content.endswith(self.calls_text):
            return self.content[:len(self.content) - len(self.calls_text)]
        return self.content

    @property
    def malformed(self) -> bool:
        """Whether any call attempt of the turn failed to parse (it is answered with an error, never dropped)."""
        return any(c.error is not None for c in self.tool_calls)

    def call_ids(self) -> list[str]:
        """The id each call is answered by. Well-formed calls: the parser's id or `call_{k}` (k counting well-formed
        calls only, as `message()` numbers them); malformed ones: the parser's id or `invalid_call_{i}` by position."""
        ids, k = [], 0
        for i, call in enumerate(self.tool_calls):
            if call.error is None:
                ids.append(call.id or f"call_{k}")
                k += 1
            else:
                ids.append(call.id or f"invalid_call_{i}")
        return ids

    def message(self, malformed_as_calls: bool = False) -> Message:
        """The assistant message for the text history (OpenAI shape). Malformed calls cannot be shown as what they
        were: with `malformed_as_calls` (templates that answer only a call they rendered) each becomes a call tied
        to its answer's id; otherwise a turn whose every call is malformed keeps its sampled text as content, so a
        rendering of the history shows what the model wrote, never an empty turn."""
        msg: Message = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg[self.reasoning_key] = self.reasoning
        calls = [(c, i) for c, i in zip(self.tool_calls, self.call_ids()) if c.error is None or malformed_as_calls]
        if self.malformed and not calls and not self.calls_in_content:
            msg["content"] = self.content + self.calls_text
        if calls:
            msg["tool_calls"] = [{"type": "function", "id": i, "function": _call_function(c)} for c, i in calls]
        return msg


def _call_function(call: ToolCallRequest) -> dict[str, Any]:
    """A call as the template's `function` field; a malformed one keeps what was sampled of it."""
    if call.error is None:
        return {"name": call.name, "arguments": call.arguments}
    arguments = call.arguments if isinstance(call.arguments, dict) else {}  # GLM's template raises on a string
    return {"name": call.name or "invalid_tool_call", "arguments": arguments}


@dataclass(frozen=True)
class RoleSupport:
    """Which messages a chat template renders, found by rendering probes (`probe_role_support`): a role it refuses
    or silently drops is never sent to it; observations go in `fallback_role` instead (counted)."""

    system: bool = True  # a leading system message (Gemma 2 refuses one)
    developer: bool = False  # a leading `developer` message (OpenAI's name for system instructions; gpt-oss renders it)
    tool_after_call: bool = True  # a `tool` message answering a call of the previous assistant turn
    tool_without_call: bool = True  # a `tool` message after a turn without calls (Mistral, Gemma 4, gpt-oss refuse)
    fallback_role: str = "user"


PROBE_TEXT = "SKYRLPROBEOBSERVATION"
PROBE_CALL_ID = "call00000"  # 9 alphanumeric characters: Mistral templates refuse any other id


def probe_call_message(n_calls: int = 1, content: str = "") -> Message:
    """An assistant turn with `n_calls` probe calls, in the shape every template reads."""
    return {"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "id": f"call{i:05d}", "function": {"name": f"skyrl_probe_call{i or ''}",
                                                              "arguments": {"skyrl_probe_arg": 1}}}
        for i in range(n_calls)]}


@dataclass(frozen=True)
class ObservationShape:
    """What follows an assistant turn, as the generator sends it: `n` `tool` messages answering the turn's calls
    (`after_call`) or a turn without calls (a Search-R1-style env), on the first turn or a later one (`later`: the
    same shape twice, as a trajectory repeats it; Command R7B drops a later turn's result after two earlier ones)."""

    after_call: bool
    n: int
    later: bool

    def conversation(self, role: str = "tool") -> tuple[list[Message], list[str]]:
        """(the probe conversation with its observations in `role`, the observation texts it must show); in
        another role than `tool` a turn's observations are one message, as `conversation_turn` merges them."""
        messages: list[Message] = [{"role": "user", "content": "U"}]
        texts: list[str] = []
        for turn in range(2 if self.later else 1):
            messages.append(probe_call_message(self.n) if self.after_call else
                            {"role": "assistant", "content": f"A{turn}"})
            turn_texts = [f"{PROBE_TEXT}{turn}{i}" for i in range(self.n)]
            texts += turn_texts
            if role != "tool":
                messages.append({"role": role, "content": "\n\n".join(turn_texts)})
                continue
            for i, text in enumerate(turn_texts):  # an observation that answers no call has no call id either
                messages.append({"role": "tool", "content": text, **({"tool_call_id": f"call{i:05d}", "name": (
                    f"skyrl_probe_call{i or ''}")} if self.after_call else {})})
        return messages, texts


OBSERVATION_SHAPES = tuple(ObservationShape(after_call, n, later)
                           for after_call in (True, False) for n in (1, 2) for later in (False, True))


def probe_role_support(render: Callable[[list[Message]], str], fallback_role: str = "user") -> RoleSupport:
    """Which roles the template renders (`render` returns the text with the generation prompt, or raises): a system
    message, and for every observation shape the generator sends (ObservationShape: one and several `tool`
    messages, after a call and after no call, first and later turns) whether each message is kept. A kind of
    observation (after a call, after no call) goes in `fallback_role` where the template refuses or drops any of
    its shapes in `tool` but renders that shape in the fallback role (a shape neither renders, parallel calls on a
    template without them, says nothing: the model cannot produce it there)."""

    def keeps(messages: list[Message], texts: list[str]) -> bool:
        try:
            text = render(messages)
        except Exception:  # noqa: BLE001 - jinja's raise_exception and friends: the template refuses it
            return False
        return all(t in text for t in texts)

    def tool_role_serves(after_call: bool) -> bool:
        for shape in (s for s in OBSERVATION_SHAPES if s.after_call == after_call):
            if not keeps(*shape.conversation()) and keeps(*shape.conversation(fallback_role)):
                return False
        return True

    user = {"role": "user", "content": "U"}
    return RoleSupport(system=keeps([{"role": "system", "content": PROBE_TEXT}, user], [PROBE_TEXT]),
                       developer=keeps([{"role": "developer", "content": PROBE_TEXT}, user], [PROBE_TEXT]),
                       tool_after_call=tool_role_serves(True), tool_without_call=tool_role_serves(False),
                       fallback_role=fallback_role)


@dataclass
class ConversationTurn:
    """A sampled turn and its observations as messages the template accepts; `role_fallbacks` counts the
    observations moved out of a role the template refuses or drops."""

    assistant: Message
    observations: list[Message]
    role_fallbacks: int = 0


def conversation_turn(turn: ParsedTurn, observations: list[Message], support: RoleSupport) -> ConversationTurn:
    """The messages that carry `turn` and its observations into the history, in roles the template renders:
    - a malformed call's error is a `tool` message; where the template answers only calls it rendered
      (Gemma 4, gpt-oss, Mistral), the malformed call goes into the assistant message, tied by id;
    - a `tool` message the template would refuse or drop is rendered in `support.fallback_role` instead
      (consecutive ones merged, for templates whose roles must alternate): never dropped, counted."""
    as_calls = turn.malformed and support.tool_after_call and not support.tool_without_call
    assistant = turn.message(malformed_as_calls=as_calls)
    out, fallbacks = observations_in_roles(assistant, observations, support)
    return ConversationTurn(assistant, out, fallbacks)


def observations_in_roles(assistant: Message | None, observations: list[Message],
                          support: RoleSupport) -> tuple[list[Message], int]:
    """The messages after `assistant` (None: the conversation's start) with every `tool` message the template
    would refuse or drop moved to `support.fallback_role` (consecutive ones merged); and how many were moved."""
    answered = {c.get("id") for c in (assistant or {}).get("tool_calls") or []}
    out: list[Message] = []
    fallbacks, merged_last = 0, False
    for obs in observations:
        if obs.get("role") == "tool":
            tied = obs.get("tool_call_id") in answered or (bool(answered) and "tool_call_id" not in obs)
            if not (support.tool_after_call if tied else support.tool_without_call):
                fallbacks += 1
                if merged_last:
                    out[-1] = dict(out[-1], content=f"{out[-1]['content']}\n\n{obs['content']}")
                else:
                    out.append({"role": support.fallback_role, "content": obs["content"]})
                merged_last = True
                continue
        out.append(obs)
        merged_last = False
    return out, fallbacks


def through_first_stop(ids: list[int], stop_ids: set[int], close_id: int) -> list[int]:
    """A rendered turn as sampled: its ids through the first stop token, or closed by `close_id` if none."""
    end = next((i for i, t in enumerate(ids) if t in stop_ids), None)
    return ids[:end + 1] if end is not None else ids + [close_id]


@dataclass(frozen=True)
class RenderedTurn:
    """An assistant turn as the family renders it, cut as a model samples it (through its first stop token)."""

    ids: list[int]
    # text the generation prompt pre-fills (a thinking stub: `<think>\n`, Gemma 4's empty thought channel) that the
    # template's rendering of the turn in a history lacks: the turn is then taken from after the shared part
    prefill: str = ""


def rendered_turn(prompt: list[int], history: list[int], full: list[int], decode: Callable[[list[int]], str],
                  stop_ids: set[int], close_id: int) -> RenderedTurn | None:
    """The turn's ids from three renderings: the prompt (earlier messages + generation prompt), the earlier
    messages alone, and all of them with the turn and what follows it (which decides the token that closes it:
    GLM's `<|observation|>` before a tool result). None where the template rewrote the earlier messages."""
    if full[:len(prompt)] == prompt:
        return RenderedTurn(through_first_stop(full[len(prompt):], stop_ids, close_id))
    shared = len(os.path.commonprefix([prompt, full]))
    if full[:len(history)] != history or shared < len(history):
        return None
    return RenderedTurn(through_first_stop(full[shared:], stop_ids, close_id), decode(prompt[shared:]))


class ContentError(ValueError):
    """Message content that is not text; `param` is the path of the offending value (`messages[1].content[0]`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def text_content(content: Any, where: str) -> str:
    """A message's text: a string as is, or OpenAI content parts `[{"type": "text", "text": ...}, ...]` joined (as
    datasets and clients written for OpenAI's API send them); any other part (an image) raises, naming it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ContentError(f"{where}[{j}]: only text parts are supported, got {str(part)[:80]!r}",
                                   f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ContentError(f"{where} must be a string or a list of text parts, got {type(content).__name__}: "
                       f"{str(content)[:80]!r}", where)


def developer_as_system(messages: list[Message], support: RoleSupport) -> list[Message]:
    """`developer` messages as `system` where the template does not render that role (most do not: they raise or
    drop it), so a prompt written for OpenAI's newer role name reaches every family, as the agent endpoint does."""
    if support.developer or not any(m.get("role") == "developer" for m in messages):
        return messages
    return [dict(m, role="system") if m.get("role") == "developer" else m for m in messages]


def fold_system_into_user(messages: list[Message]) -> list[Message]:
    """For templates without a system role (Gemma 2): the system prompt (and a tools block in it) opens the first
    user turn, the way these models' own documentation prompts them."""
    if not messages or messages[0].get("role") != "system":
        return messages
    system, rest = messages[0]["content"], messages[1:]
    if rest and rest[0].get("role") == "user":
        return [dict(rest[0], content=f"{system}\n\n{rest[0]['content']}"), *rest[1:]]
    return [{"role": "user", "content": system}, *rest]


class ChatRenderer(Protocol):
    """What the agent loop needs from a model family; see module docstring."""

    name: str
    stop_ids: set[int]  # ids that end an assistant turn when the model samples them
    close_id: int  # what we append (masked) to close a turn the model did not close itself
    roles: RoleSupport  # which roles its template renders (probed)

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The first prompt of a trajectory, rendered once from messages (with the generation prompt): every
        later prompt extends it, so this is the only full render a chain needs."""
        ...

    def next_prompt(self, prompt_ids: list[int], completion_ids: list[int], history: list[Message],
                    new_messages: list[Message], tools: list[dict] | None = None,
                    keep_turn: bool = False) -> NextPrompt:
        """The next turn's prompt: prompt + the sampled ids + exactly what the template puts after them (turn
        close, observations, generation prompt), so the trained ids stay the sampled ids; a re-render of
        `history` only where that cannot be proven, with the reason. `keep_turn`: the turn holds a malformed
        call, which no message can reproduce: it is extended as sampled under either thinking_retention."""
        ...

    def parse(self, completion_ids: list[int], prompt_ids: list[int],
              tools: list[dict] | None = None) -> ParsedTurn:
        """The sampled turn as content, reasoning and tool calls, read from the ids the model sampled (not from a
        re-encoded text), so a call executed is a call the model made; malformed calls come back with an error."""
        ...

    def turn_ids(self, messages: list[Message], index: int, tools: list[dict] | None = None) -> RenderedTurn | None:
        """What a model writing `messages[index]` (an assistant turn) samples after the prompt of the messages
        before it, as the family renders that turn (the messages after it decide how it closes): for SFT
        demonstrations, whose calls must be in the format the parser reads. None where the template rewrites the
        earlier messages."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text for envs and logs only: decoded text is never encoded back into a training target."""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids for text we add ourselves (observations outside a template); never for what the model sampled."""
        ...


def check_observations_kept(new_messages: list[Message], new_text: str, renderer_name: str,
                            normalize: Callable[[str], str] | None = None) -> None:
    """Fail loudly when the rendering of the next turn lost an observation: a tool result the model never sees
    would train it on a conversation that did not happen (some templates silently skip `role: tool`).
    `normalize`: the Unicode form `new_text` is in (the tokenizer's), applied to each observation too."""
    for message in new_messages:
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            continue
        text = content.strip()
        if normalize is not None:
            text, new_text = normalize(text), normalize(new_text)
        if any(form in new_text for form in rendered_forms(text)):
            continue
        raise RenderError(f"the chat template of {renderer_name!r} drops {message.get('role')!r} messages: "
                          f"{text[:60]!r} is not in the next prompt; use a renderer or role the template supports")


def rendered_forms(text: str) -> tuple[str, ...]:
    """How a template may write a message's text: as is, JSON-escaped, or through Jinja's `tojson`, which also
    escapes <, >, & and ' (Command R renders tool results that way)."""
    escaped = json.dumps(text)[1:-1]
    html_safe = (escaped.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
                 .replace("'", "\\u0027"))
    return text, escaped, html_safe, json.dumps(text, ensure_ascii=False)[1:-1]


def unicode_normalizer(tokenizer) -> Callable[[str], str] | None:
    """The Unicode normal form the tokenizer puts text in before encoding (Qwen2/3 and DeepSeek-R1-Distill: NFC), as a
    function on text; None where it applies none (or anything else: lowercasing, prefix spaces), so text rendered by
    the template and ids decoded back are compared in the same form."""
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    try:  # the normalizer's own JSON (not the whole tokenizer's: that serialises the vocabulary)
        spec = json.loads(normalizer.__getstate__()) if normalizer is not None else None
    except (AttributeError, TypeError, ValueError):
        return None
    steps = (spec.get("normalizers") or [] if spec and spec.get("type") == "Sequence" else [spec]) if spec else []
    forms = [step.get("type") for step in steps if isinstance(step, dict)]
    if not forms or not all(form in ("NFC", "NFD", "NFKC", "NFKD") for form in forms):
        return None

    def normalize(text: str) -> str:
        for form in forms:
            text = unicodedata.normalize(form, text)
        return text
    return normalize
