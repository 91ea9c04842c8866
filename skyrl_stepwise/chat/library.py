"""The PyPI `renderers` library (prime-rl's renderers) as our renderer: hand-written per-family renderers with an
exact `bridge_to_next_turn`, tool-call and reasoning parsers, and a thinking-retention policy. We add nothing to
what it does; we only check its bridge's prefix contract and say why it declined, and, at start-up, that its parser
reads its own rendering of a probe call back (the round trip every detected format gets, tool_formats/detect.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

from skyrl_stepwise.chat.base import (Message, unicode_normalizer, NextPrompt, ParsedTurn, RenderError, ToolCallRequest,
                                      RenderedTurn, check_observations_kept, probe_call_message,
                                      probe_role_support, rendered_turn)
from skyrl_stepwise.chat.tool_formats import FORMATS, PROBE_ARG, ToolParser
from skyrl_stepwise.chat.tool_formats.detect import ROUND_TRIP_TOOLS, RoundTrip, ToolFormatRoundTripFailed
from skyrl_stepwise.chat.tool_formats.xml_values import PROBE_VALUE, ValuePadding, probed_padding

# The call format of the library's renderers, by name prefix (first match), for answering a malformed call and
# for reading a call its parser missed; families not listed get the error without a format (rather than a wrong one).
CALL_FORMATS = (("qwen3.5", "qwen_xml"), ("qwen3.6", "qwen_xml"), ("qwen3.8", "qwen_xml"), ("prime-qwen3", "qwen_xml"),
                ("qwen", "hermes"), ("nemotron", "qwen_xml"), ("llama", "llama_json"), ("gpt-oss", "harmony"),
                ("glm", "glm"), ("deepseek-v3", "deepseek_v3"), ("deepseek-r1", "deepseek_v3"),
                ("minimax", "minimax"), ("gemma4", "gemma4"))


# Models the library's name map leaves out whose templates its renderer reproduces token for token
# (tests/test_tool_formats.py checks Llama 3.1's against the llama-3 renderer).
ALIASES = ((re.compile(r"meta-llama/(Meta-)?Llama-3\.1-\d+B-Instruct"), "llama-3"),)


def library_renderer_name(tokenizer, requested: str) -> str | None:
    """The `renderers` name to use: the requested one, or for `auto` the one the library maps this model to."""
    from renderers.base import MODEL_RENDERER_MAP

    if requested != "auto":
        return requested
    name = getattr(tokenizer, "name_or_path", "")
    return MODEL_RENDERER_MAP.get(name) or next((r for pattern, r in ALIASES if pattern.fullmatch(name)), None)


# Conversations both backends render to compare them: a system prompt, a second user turn after an answer, a tool
# call and its result, each with the generation prompt (what every rollout prompt is made of).
_MATCH_PROBES = (
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}],
    [{"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}],
    [{"role": "user", "content": "U1"}, {"role": "assistant", "content": "", "tool_calls": [{
        "type": "function", "id": "call00000", "function": {"name": "t", "arguments": {"q": "x"}}}]},
     {"role": "tool", "content": "R1", "tool_call_id": "call00000", "name": "t"}],
)
_MATCH_TOOLS = [{"type": "function", "function": {"name": "t", "description": "d", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]
# renderers never tried by rendering: gpt-oss's harmony encoder downloads its vocabulary on first use
_NOT_MATCHED = ("gpt-oss", "default")


def renderer_matching_template(tokenizer, template, tool_format: str) -> str | None:
    """The `renderers` renderer that renders exactly what this tokenizer's chat template renders, for a model the
    library does not know by name (a local folder, a fine-tune): the one that turns every probe conversation into
    the template's own ids. Only renderers of the template's call format are tried; None if none matches.

    `template` is the TemplateRenderer of the same tokenizer (its rendering is the reference)."""
    import renderers
    from renderers.base import RENDERER_REGISTRY, _populate_registry
    from renderers.configs import config_from_name

    _populate_registry()
    candidates = [name for name in sorted(RENDERER_REGISTRY) if name not in _NOT_MATCHED and next(
        (f for prefix, f in CALL_FORMATS if name.startswith(prefix)), None) == tool_format]
    try:
        expected = [template.encode(template.render(m, True, _MATCH_TOOLS)) for m in _MATCH_PROBES]
    except RenderError:
        return None
    for name in candidates:
        try:
            library = renderers.create_renderer(tokenizer, config_from_name(name))
            if all(list(library.render_ids(m, tools=_MATCH_TOOLS, add_generation_prompt=True)) == ids
                   for m, ids in zip(_MATCH_PROBES, expected)):
                return name
        except Exception:  # a renderer that needs other tokens or kwargs does not render this model  # noqa: BLE001
            continue
    return None


class LibraryRenderer:
    """A `renderers.Renderer` behind our ChatRenderer contract."""

    def __init__(self, tokenizer, renderer_name: str, chat_template_kwargs: dict[str, Any] | None = None,
                 thinking_retention: str = "template") -> None:
        import renderers
        from renderers.configs import config_from_name

        config = config_from_name(renderer_name)
        if thinking_retention == "all":  # "template" = the library's default: follow the template's own knobs
            config = config.model_copy(update={"thinking_retention": "all"})
        self.renderer = renderers.create_renderer(tokenizer, config, chat_template_kwargs=chat_template_kwargs)
        self.tokenizer = tokenizer
        self._normalize = unicode_normalizer(tokenizer)  # ids decode to the tokenizer's normal form (NFC)
        self.name = f"renderers:{renderer_name}"
        self.thinking_retention = thinking_retention
        stops = list(self.renderer.get_stop_token_ids())
        if not stops:
            raise ValueError(f"{self.name} reports no stop token ids for {tokenizer.name_or_path!r}")
        self.stop_ids, self.close_id = set(stops), stops[0]
        fmt = next((FORMATS[f] for prefix, f in CALL_FORMATS if renderer_name.startswith(prefix)), None)
        self.call_format = fmt.expected_format if fmt is not None else None
        # XML-style values: ours keeps them as written (less the renderer's own padding) and lets the executor
        # answer a wrong type; the library's strips them and refuses text where the schema wants no string
        self.reads_values = fmt is not None and fmt.padded is not None
        self.own_parser = ToolParser(fmt, tokenizer, self._value_padding() if self.reads_values else None) \
            if fmt is not None else None
        self.roles = probe_role_support(lambda m: self.decode(self.renderer.render_ids(m, add_generation_prompt=True)))
        self._check_round_trip()

    def _check_round_trip(self) -> None:
        """The start-up round trip (tool_formats/detect.py) for the library's own format: a turn with one probe call,
        and with two where it renders both, rendered by the library and read back by `parse` as sampled ids are,
        must give back the same calls; else ToolFormatRoundTripFailed (with `renderer: auto`, create_renderer then
        serves the model's own template, whose format is proved the same way). A turn it cannot render is skipped:
        that renderer writes no calls to check."""
        user = [{"role": "user", "content": "U"}]
        tools = ROUND_TRIP_TOOLS
        for n_calls in (1, 2):
            messages = user + [probe_call_message(n_calls)]
            try:
                turn = self.turn_ids(messages, 1, tools)
            except RenderError:
                continue
            text = self.decode(turn.ids) if turn is not None else ""
            names = [c["function"]["name"] for c in messages[-1]["tool_calls"]]
            rendered = tuple((name, {PROBE_ARG: 1}) for name in names[:1] + [n for n in names[1:] if n in text])
            if not text or names[0] not in text:
                continue
            calls = self.parse(turn.ids, self.prompt_ids(user, tools), tools).tool_calls
            trip = RoundTrip(self.name, text, rendered, tuple(
                (c.name, json.loads(c.arguments) if isinstance(c.arguments, str) and c.error is None else c.arguments,
                 c.error) for c in calls))
            if not trip.ok:
                raise ToolFormatRoundTripFailed(
                    f"{self.name} renders tool calls for {self.tokenizer.name_or_path!r} that its parser does not read "
                    f"back: it rendered {text!r}, which parsed as {list(trip.parsed)} (name, arguments, error), not "
                    f"{list(trip.expected)}")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        try:
            return list(self.renderer.render_ids(messages, tools=tools, add_generation_prompt=True))
        except Exception as e:
            raise RenderError(f"{self.name} cannot render roles {[m.get('role') for m in messages]}: {e}") from e

    def turn_ids(self, messages: list[Message], index: int, tools: list[dict] | None = None) -> RenderedTurn | None:
        """`messages[index]` (an assistant turn) as the library renders it after the generation prompt of the
        messages before it, through the first stop token (ChatRenderer.turn_ids)."""
        try:
            history = list(self.renderer.render_ids(messages[:index], tools=tools, add_generation_prompt=False))
            full = list(self.renderer.render_ids(messages[:index + 2], tools=tools, add_generation_prompt=False))
        except Exception as e:
            raise RenderError(f"{self.name} cannot render roles {[m.get('role') for m in messages]}: {e}") from e
        return rendered_turn(self.prompt_ids(messages[:index], tools), history, full, self.decode, self.stop_ids,
                             self.close_id)

    def parse(self, completion_ids: list[int], prompt_ids: list[int], tools: list[dict] | None = None) -> ParsedTurn:
        """Content, reasoning and every tool-call attempt, as the library's parser for this family reads them."""
        from renderers import ToolCallParseStatus

        parsed = self.renderer.parse_response(list(completion_ids), tools=tools, prompt_ids=list(prompt_ids))
        calls = [ToolCallRequest(c.name, c.arguments, c.raw, None if ok else str(c.status), c.id,
                                 None if ok else self.call_format)
                 for c in parsed.tool_calls for ok in [c.status == ToolCallParseStatus.OK]]
        if calls and self.reads_values:
            own = self.own_parser.parse(list(completion_ids), self._decode_turn, tools)[1]
            if [c.name for c in own] == [c.name for c in calls]:  # the same calls, their values as written
                calls = [replace(c, id=lib.id) for c, lib in zip(own, calls)]
        if tools and not calls and self.own_parser is not None:
            # the library reads a call it cannot decode as the final answer (Llama 3's invalid JSON): a turn that
            # opens a call in the family's format is a (malformed) call, answered, never the episode's end
            content, own = self.own_parser.parse(list(completion_ids), self._decode_turn, tools)
            if own:
                return ParsedTurn(content, parsed.reasoning_content, own,
                                  calls_text=self._calls_text(completion_ids, content))
        return ParsedTurn(parsed.content, parsed.reasoning_content, calls,
                          calls_text=self._calls_text(completion_ids, parsed.content) if calls else "")

    def _value_padding(self) -> ValuePadding | None:
        """What this renderer writes around a string argument value (probed as for templates)."""
        call = probe_call_message()
        call["tool_calls"][0]["function"]["arguments"] = {PROBE_ARG: PROBE_VALUE}
        try:
            return probed_padding(self.decode(self.renderer.render_ids([{"role": "user", "content": "U"}, call])))
        except Exception:  # a renderer that cannot render the probe: the default padding  # noqa: BLE001
            return None

    def _calls_text(self, completion_ids: list[int], content: str) -> str:
        """The sampled text after the content (the calls as written), where it can be found; "" otherwise."""
        ids = completion_ids[:-1] if completion_ids and completion_ids[-1] in self.stop_ids else completion_ids
        text = self.decode(ids)
        at = text.rfind(content) if content else -1
        if at >= 0:
            return text[at + len(content):]
        return text if not content and "</think>" not in text else ""

    def _decode_turn(self, ids: list[int]) -> str:
        """The sampled turn's text without the token that ended it."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def next_prompt(self, prompt_ids: list[int], completion_ids: list[int], history: list[Message],
                    new_messages: list[Message], tools: list[dict] | None = None,
                    keep_turn: bool = False) -> NextPrompt:
        """The library's bridge when it proves exact extension, else a full render of the history (with why);
        `keep_turn` changes nothing here: the bridge extends the sampled ids whatever the turn holds."""
        bridge = self.renderer.bridge_to_next_turn(list(prompt_ids), list(completion_ids), new_messages, tools=tools)
        chain = prompt_ids + completion_ids
        if bridge is not None:
            ids = list(bridge.token_ids)
            if ids[:len(chain)] == chain:
                check_observations_kept(new_messages, self.decode(ids[len(chain):]), self.name, self._normalize)
                return NextPrompt(ids, True)
            reason = "bridge_drops_sampled_ids"  # the sampled ids ran past the turn close
        elif self.thinking_retention == "template" and any(m.get("role") == "user" for m in new_messages):
            reason = "thinking_retention_template"  # the template re-renders history at a new user turn
        else:
            reason = "renderer_declined"  # it cannot prove an exact extension
        ids = self.prompt_ids(history, tools)
        check_observations_kept(new_messages, self.decode(ids), self.name, self._normalize)
        return NextPrompt(ids, False, reason)
