"""The model's own chat template as a renderer, for models the `renderers` library does not know.

The bridge works on the *real* history: after a sampled turn we render the whole new conversation with the
template and ask whether it starts with the text of (previous prompt + sampled ids). If it does, only the text
after that is new, and the next prompt is the previous ids + the sampled ids + that text's ids. If it does not,
the template rewrote something earlier (Qwen3 drops past `<think>`, Llama trims content): with
`thinking_retention="template"` we follow the template and re-render (counted); with `"all"` we keep what was
sampled and take only the template's rendering of the new messages (found after a marker assistant turn).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from skyrl_stepwise.chat.base import (PROBE_TEXT, Message, NextPrompt, ParsedTurn, RenderError, check_observations_kept,
                                      fold_system_into_user, probe_call_message, probe_role_support, unicode_normalizer,
                                      RenderedTurn, rendered_forms, rendered_turn, through_first_stop)
from skyrl_stepwise.chat.tool_formats import PROBE_ARG, PROBE_NAME, ToolFormat, ToolParser
from skyrl_stepwise.chat.tool_formats.detect import ROUND_TRIP_TOOLS, ProbeRendering, RoundTrip
from skyrl_stepwise.chat.tool_formats.hermes import HERMES
from skyrl_stepwise.chat.tool_formats.xml_values import PROBE_VALUE, ValuePadding, probed_padding
from skyrl_stepwise.chat.tool_parsers import parse_harmony_text, tool_parser_for

# Stands in for sampled assistant content when only the template's rendering of the *new* messages is wanted;
# plain ASCII so no template trims or escapes it.
_MARKER = "SKYRLASSISTANTTURNMARKER"
_LAST_MARKER = "SKYRLLASTTURNMARKER"  # the last assistant turn's, so an earlier turn's marker is never taken for it
_PROBE_TOOL = {"type": "function", "function": {"name": "skyrl_probe_tool", "description": "d",
                                                "parameters": {"type": "object", "properties": {}}}}


class TemplateRenderer:
    """`tokenizer.apply_chat_template` + the real-history bridge described in the module docstring."""

    def __init__(self, tokenizer, chat_template_kwargs: dict[str, Any] | None = None,
                 thinking_retention: str = "template", tool_parser: str = "auto") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template; set one or use a renderer "
                             "from the `renderers` library (generator.renderer)")
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos_token_id")
        self.tokenizer = tokenizer
        self.name = f"template:{tokenizer.name_or_path}"
        self.kwargs = dict(chat_template_kwargs or {})
        self.thinking_retention = thinking_retention
        self._normalize = unicode_normalizer(tokenizer)
        self._special_ids = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        self._special_texts = sorted(specials | {t for t in tokenizer.all_special_tokens if t})
        # a template that fails whenever it is given `tools=` (one that serialises a generator with `tojson`) is
        # never given them: it renders as one that ignores them (our tools block in its own call format)
        self._tools_break_template = self._fails_with_tools()
        # which roles the template renders (probed), before anything else renders through `render`
        self.roles = probe_role_support(lambda m: self._apply_template(m, True, [_PROBE_TOOL]))
        terminator = self._turn_terminator()
        # A base-model tokenizer can end text with EOS (<|endoftext|>) and turns with another token (<|im_end|>).
        self.close_id = terminator if terminator is not None else tokenizer.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id, self.close_id}
        probe, self.string_arguments = self._tool_support()
        self.renders_tools, self.renders_tool_calls = probe.renders_tools, probe.renders_calls
        # what the template writes between a turn's text and its first call (Qwen: "\n"), so text before a call
        # is parsed without it and the template's rendering of the turn reproduces the sampled text
        self.content_call_separator = self._content_call_separator()
        # harmony ends a tool-call turn with <|call|>, GLM with <|observation|>, Gemma 4 with <|tool_response>,
        # Llama 3 (ipython) with <|eom_id|>: the engine must stop there too
        self.stop_ids |= self._call_turn_stops() | generation_config_stops(tokenizer.name_or_path)
        # a stop token that closes the call block itself (harmony's <|call|>) stays in the text the parser reads
        at = probe.with_call.rfind(PROBE_ARG)
        call_close = next((t for t in self.encode(probe.with_call[at:]) if t in self._special_ids), None) \
            if at >= 0 else None
        self._call_close = call_close if call_close in self.stop_ids - {tokenizer.eos_token_id, self.close_id} \
            else None
        # the format the template renders calls in, proved by reading the template's own probe calls back as a
        # sampled turn is read (generator.tool_parser overrides); unknown or not read back: fails here
        padding = self._value_padding()
        self.tool_parser = tool_parser_for(probe, tokenizer, tool_parser, padding,
                                           lambda fmt: self._round_trips(probe, ToolParser(fmt, tokenizer, padding)))

    def render(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The chat template as text; tool schemas go where the template puts them, or in a hermes system block
        if it ignores `tools=` (SmolLM2), so the model always sees what it may call; a template without a system
        role (Gemma 2) gets the system prompt, tools block included, in the first user turn."""
        if tools and not self.renders_tools:
            messages = with_tools_system_block(messages, tools, self.tool_parser.format)
        if not self.roles.system:
            messages = fold_system_into_user(messages)
        return self._apply_template(messages, add_generation_prompt, tools)

    def _apply_template(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None,
                        **extra: Any) -> str:
        """The single place the chat template is applied (`extra`: kwargs of a probe)."""
        kwargs = {**self.kwargs, **extra}
        tools = tools if tools is not None else kwargs.pop("tools", None)  # a template may need `tools` (even [])
        kwargs.pop("tools", None)
        if getattr(self, "_tools_break_template", False):
            tools = None
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja's raise_exception, missing kwargs: name the template and the roles
            roles = [m.get("role") for m in messages]
            raise RenderError(f"{self.name}: the chat template refused messages with roles {roles}: {e}") from e

    def encode(self, text: str) -> list[int]:
        """Tokenize rendered template text the way apply_chat_template(tokenize=True) does."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Decode keeping special tokens and spacing, so text comparisons are faithful."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, True, tools))

    def turn_ids(self, messages: list[Message], index: int, tools: list[dict] | None = None) -> RenderedTurn | None:
        """`messages[index]` (an assistant turn) as the template renders it after the generation prompt of the
        messages before it, through the first stop token (ChatRenderer.turn_ids); canonical tokens of the turn's
        text where the prompt is a prefix of the rendering, as the model would sample that text."""
        prompt = self.render(messages[:index], True, tools)
        full = self.render(messages[:index + 2], False, tools)
        if full.startswith(prompt):
            return RenderedTurn(through_first_stop(self.encode(full[len(prompt):]), self.stop_ids, self.close_id))
        history = self.render(messages[:index], False, tools)
        return rendered_turn(self.encode(prompt), self.encode(history), self.encode(full), self.decode,
                             self.stop_ids, self.close_id)

    def parse(self, completion_ids: list[int], prompt_ids: list[int], tools: list[dict] | None = None) -> ParsedTurn:
        """The sampled text without its closing token (the template handles any reasoning in it); with tools,
        calls in the template's format become calls and the content is the text before them."""
        return self._parse_with(self.tool_parser, completion_ids, tools)

    def _parse_with(self, parser: ToolParser, completion_ids: list[int], tools: list[dict] | None) -> ParsedTurn:
        """`parse` with `parser` reading the calls (the start-up round trip proves a candidate format this way)."""
        ends = completion_ids and completion_ids[-1] in self.stop_ids and completion_ids[-1] != self._call_close
        ids = completion_ids[:-1] if ends else completion_ids
        text = self.decode(ids)
        if "<|channel|>" in text:  # gpt-oss (harmony): the template wants final text and analysis apart
            content, thinking, calls = parse_harmony_text(text)
            return ParsedTurn(content, thinking, calls if tools else [], reasoning_key="thinking")
        if not tools:
            return ParsedTurn(text)
        content, calls = parser.parse(ids, self.decode, tools)
        if self.string_arguments:  # the template concatenates arguments as text (DeepSeek R1): OpenAI's JSON string
            calls = [replace(c, arguments=json.dumps(c.arguments, ensure_ascii=False))
                     if c.error is None and isinstance(c.arguments, dict) else c for c in calls]
        if not self.renders_tool_calls:
            # a template that cannot render `tool_calls` would drop the calls from a re-rendered history: keep them
            # in the content, as sampled (an OpenAI client is shown the text before them: `answer`)
            calls_text = text[len(content):] if calls and text.startswith(content) else ""
            return ParsedTurn(text, None, calls, calls_text=calls_text, calls_in_content=bool(calls_text))
        sep = self.content_call_separator
        if calls and sep and content.endswith(sep) and content.strip():
            content = content[:-len(sep)]  # the template writes it again before the call
        calls_text = text[len(content):] if calls and text.startswith(content) else ""
        return ParsedTurn(content, None, calls, calls_text=calls_text)

    def next_prompt(self, prompt_ids: list[int], completion_ids: list[int], history: list[Message],
                    new_messages: list[Message], tools: list[dict] | None = None,
                    keep_turn: bool = False) -> NextPrompt:
        """Extend prompt + sampled ids by the template's text for the new messages; re-render where it cannot.
        `keep_turn` (a turn with a malformed call): extend even where the template would rewrite the turn."""
        closing = [] if completion_ids and completion_ids[-1] in self.stop_ids else [self.close_id]
        prefix = prompt_ids + completion_ids + closing
        rendered = self.render(history, True, tools)
        prefix_text = self.decode(prefix)
        normal = self._normalize
        if normal is not None and not rendered.startswith(prefix_text) and normal(rendered).startswith(prefix_text):
            # the tokenizer normalises text (Qwen's NFC): the ids decode to the normal form of what was rendered,
            # so compare in that form (encoding the suffix normalises it anyway); not a history rewrite
            rendered = normal(rendered)
        if rendered.startswith(prefix_text):
            suffix = rendered[len(prefix_text):]
        elif self.thinking_retention == "all" or keep_turn:
            suffix = self._new_messages_text(history, tools, prefix[-1])
            if suffix is None:
                return self._rerender(rendered, new_messages, "template_rerenders_earlier_turns")
        else:
            return self._rerender(rendered, new_messages, "template_rewrites_history")
        check_observations_kept(new_messages, suffix, self.name, normal)
        return NextPrompt(prefix + self.encode(suffix), True)

    def _rerender(self, rendered: str, new_messages: list[Message], reason: str) -> NextPrompt:
        check_observations_kept(new_messages, rendered, self.name, self._normalize)
        return NextPrompt(self.encode(rendered), False, reason)

    def _new_messages_text(self, history: list[Message], tools: list[dict] | None, end_id: int) -> str | None:
        """What the template renders after the last assistant turn (whose last id is `end_id`, sampled or
        appended), with every assistant content replaced by a marker (so the template's rewriting of sampled
        content cannot matter); None if it cannot be found.

        The turn ends at the first `end_id` after its content (a call turn's <|call|>, <|im_end|>, ...), else at
        the earliest special token after it (harmony closes a past final turn with <|end|>, not the <|return|> it
        was sampled with). A template that renders a tool-call turn without its content (Mistral, Hermes 3) shows
        the marker only once the turn's `tool_calls` are left out, where its template answers calls it did not
        render; what follows the turn (the tool results) does not depend on them."""
        last = max((i for i, m in enumerate(history) if m.get("role") == "assistant"), default=-1)
        marked = [dict(m, content=_LAST_MARKER if i == last else _MARKER) if m.get("role") == "assistant" else m
                  for i, m in enumerate(history)]
        for m in marked:
            m.pop("reasoning_content", None)
            m.pop("thinking", None)
        text = self.render(marked, True, tools)
        floor = self._earlier_messages_end(text, marked[:last], tools)
        found = self._turn_end(text, history, last, end_id, floor)
        if found is None and _LAST_MARKER not in text and last >= 0 and marked[last].get("tool_calls"):
            # where the turn is cannot be told: without its calls, the marker shows it
            marked[last] = {k: v for k, v in marked[last].items() if k != "tool_calls"}
            try:
                text = self.render(marked, True, tools)
            except RenderError:
                return None
            found = self._turn_end(text, history, last, end_id, floor)
        return None if found is None else text[found:]

    def _earlier_messages_end(self, text: str, earlier: list[Message], tools: list[dict] | None) -> int:
        """How much of `text` is the template's rendering of the messages before the last assistant turn (their
        common prefix): a new message's text is looked for after it, so a short result ("5") is not found in the
        prompt's own text where the message before the turn has none to anchor on (an empty user message)."""
        if not earlier:
            return 0
        try:
            before = self.render(earlier, False, tools)
        except RenderError:
            return 0
        return len(os.path.commonprefix([text, before]))

    def _turn_end(self, text: str, history: list[Message], last: int, end_id: int, floor: int = 0) -> int | None:
        """Where the last assistant turn's rendering ends in `text` (its content is `_LAST_MARKER`), or None.

        The turn starts after its marker, or at its last call's name after the previous message's text (Gemma 4
        writes a turn's content after its calls and their results; Mistral, Llama, Hermes 3 write no content for a
        call turn), and ends before the first new message's text (which may quote anything, a turn's end token
        too). It ends after the first `end_id` there, else after the earliest special token following the
        marker."""
        marker = text.rfind(_LAST_MARKER)
        previous = history[last - 1].get("content") if last > 0 else None
        prev_end = max((i + len(form) for form in rendered_forms(previous.strip())
                        if (i := text.rfind(form, 0, marker if marker >= 0 else len(text))) >= 0),
                       default=-1) if isinstance(previous, str) and previous.strip() else -1
        origin = max(prev_end, floor)
        limit = min((i for m in history[last + 1:] if isinstance(m.get("content"), str) and m["content"].strip()
                     for form in rendered_forms(m["content"].strip()) if (i := text.find(form, origin)) >= 0),
                    default=len(text))
        starts = [marker + len(_LAST_MARKER)] if 0 <= marker < limit else []
        calls = history[last].get("tool_calls") or []
        name = (calls[-1].get("function") or {}).get("name") if calls else None
        if name and (i := text.find(name, origin, limit)) >= 0:  # the turn's last call is rendered there
            starts.append(i + len(name))
        end_text = self.decode([end_id])
        for start in starts if end_id in self._special_ids else ():
            if (i := text.find(end_text, start, limit)) >= 0:
                return i + len(end_text)
        if not 0 <= marker < limit:
            return None
        closes = [(i, t) for t in self._special_texts if (i := text.find(t, marker, limit)) >= 0]
        if not closes:
            return None
        i, t = min(closes)
        return i + len(t)

    def _fails_with_tools(self) -> bool:
        """Whether the template raises on a conversation as soon as it is given tool schemas, and renders it
        without them."""
        user = [{"role": "user", "content": "U"}]
        try:
            self._apply_template(user, True, [_PROBE_TOOL])
            return False
        except RenderError:
            pass
        try:
            self._apply_template(user, True, None)
        except RenderError:
            return False  # it refuses the conversation itself: nothing to learn about tools here
        return True

    def _tool_support(self) -> tuple[ProbeRendering, bool]:
        """How the template renders tools and an assistant tool call (probed once): whether it renders `tools=`
        schemas, the call's format, the special token that closes a tool-call turn; and whether it needs call
        arguments as a JSON string (it refuses or drops a dict, as DeepSeek R1's template does)."""
        tool = {"type": "function", "function": {"name": "skyrl_probe_tool", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}
        user = [{"role": "user", "content": "U"}]
        try:
            before = self._apply_template(user, True, [tool])
        except RenderError:
            before = ""
        renders_tools = "skyrl_probe_tool" in before
        try:
            without_tools = self._apply_template(user, True, None)
        except RenderError:
            without_tools = ""
        probe = ProbeRendering(before, "", renders_tools, without_tools=without_tools)
        errors = []
        # arguments as a dict, else as OpenAI's JSON string; content "" or None (DeepSeek R1 renders calls only
        # for `content is none`)
        for arguments, content in (({PROBE_ARG: 1}, ""), ({PROBE_ARG: 1}, None), (json.dumps({PROBE_ARG: 1}), ""),
                                   (json.dumps({PROBE_ARG: 1}), None)):
            # a 9-character alphanumeric id: Mistral templates refuse any other
            call = {"role": "assistant", "content": content, "tool_calls": [{
                "type": "function", "id": "call00000", "function": {"name": PROBE_NAME, "arguments": arguments}}]}
            try:
                probe = replace(probe, with_call=self._apply_template(user + [call], False, [tool]))
            except RenderError as e:
                cause = e.__cause__ or e
                errors.append(f"{type(cause).__name__}: {cause}")
                continue
            if probe.renders_calls:
                two = dict(call, tool_calls=call["tool_calls"] * 2)  # parallel calls, where the template takes them
                try:
                    probe = replace(probe, with_two_calls=self._apply_template(user + [two], False, [tool]))
                except RenderError:
                    pass
                return probe, isinstance(arguments, str)
        if not probe.with_call and errors:
            probe = replace(probe, call_error=errors[-1])
        return probe, False

    def _round_trips(self, probe: ProbeRendering, parser: ToolParser) -> list[RoundTrip]:
        """The template's probe call turn, and its two-call turn where it renders parallel calls, each read back by
        `parser` as sampled ids are: the turn's text after the generation prompt, through the first stop token
        after its last call (the turn's terminator appended where the template writes none), through `parse`."""
        one = _sampled_turn(probe.before, probe.with_call)
        per_call = one.count(PROBE_NAME)
        turns = [(one, 1)]
        if probe.with_two_calls and per_call:
            two = _sampled_turn(probe.before, probe.with_two_calls)
            turns.append((two, min(2, two.count(PROBE_NAME) // per_call)))  # GigaChat 3.1 renders one a turn
        trips = []
        for text, n_calls in turns:
            ids = self._through_stop(text)
            calls = self._parse_with(parser, ids, ROUND_TRIP_TOOLS).tool_calls
            arguments = [json.loads(c.arguments) if isinstance(c.arguments, str) and c.error is None else c.arguments
                         for c in calls]
            trips.append(RoundTrip(parser.name, self.decode(ids), ((PROBE_NAME, {PROBE_ARG: 1}),) * n_calls,
                                   tuple((c.name, a, c.error) for c, a in zip(calls, arguments))))
        return trips

    def _through_stop(self, turn: str) -> list[int]:
        """The ids of `turn` (a rendered call turn) through the first stop token after its last call, as a model
        samples it; the turn's terminator appended where the template closes it only before a later message."""
        last = turn.rfind(PROBE_ARG)
        ends = [(i, t) for t in self.stop_ids if (i := turn.find(self.decode([t]), last)) >= 0]
        if not ends:
            return self.encode(turn) + [self.close_id]
        at, stop = min(ends)
        return self.encode(turn[:at]) + [stop]

    def _value_padding(self) -> ValuePadding | None:
        """What the template writes around a string argument value (Qwen3-Coder: a newline each side), so XML-style
        values are read back exactly as the model wrote them; None where it renders no such value."""
        if not self.renders_tool_calls:
            return None
        arguments = {PROBE_ARG: PROBE_VALUE}
        call = probe_call_message()
        call["tool_calls"][0]["function"]["arguments"] = json.dumps(arguments) if self.string_arguments else arguments
        try:
            return probed_padding(self._apply_template([{"role": "user", "content": "U"}, call], False, [_PROBE_TOOL]))
        except RenderError:
            return None

    def _call_turn_stops(self) -> set[int]:
        """The ids a tool-call turn ends with where a plain turn's terminator does not end it: the first special
        token between a call and its result that the template does not also put between two calls of one turn
        (so DeepSeek's <｜tool▁call▁end｜> is not taken for a turn end), probed with the template's ipython mode
        too (Llama 3.x closes a call turn with <|eom_id|> there)."""
        if not self.renders_tool_calls:
            return set()
        user = {"role": "user", "content": "U"}
        tool = {"role": "tool", "tool_call_id": "call00000", "name": "skyrl_probe_call", "content": PROBE_TEXT}
        between_calls: set[int] = set()
        try:
            two = self._apply_template([user, probe_call_message(2)], False, [_PROBE_TOOL])
            first, second = two.find("skyrl_probe_arg"), two.find("skyrl_probe_call1")
            if 0 <= first < second:
                between_calls = {t for t in self.encode(two[first:second]) if t in self._special_ids}
        except RenderError:
            pass
        stops: set[int] = set()
        for extra in ({}, {"builtin_tools": []}):
            try:
                text = self._apply_template([user, probe_call_message(), tool], True, [_PROBE_TOOL], **extra)
                end = text.find(PROBE_TEXT)
            except RenderError:
                try:
                    text = self._apply_template([user, probe_call_message()], False, [_PROBE_TOOL], **extra)
                except RenderError:
                    continue
                end = len(text)
            at = text.rfind("skyrl_probe_arg", 0, end if end >= 0 else len(text))
            if at < 0:
                continue
            span = [t for t in self.encode(text[at:end if end >= 0 else len(text)])
                    if t in self._special_ids and t not in between_calls]
            if span and not (set(span) & (self.stop_ids | stops)):
                stops.add(span[0])
        return stops

    def _content_call_separator(self) -> str:
        """The whitespace the template writes between an assistant turn's text and its first call ("" if none)."""
        if not self.renders_tool_calls:
            return ""
        try:
            text = self._apply_template([{"role": "user", "content": "U"}, probe_call_message(1, _MARKER)], False,
                                        [_PROBE_TOOL])
        except RenderError:
            return ""
        at = text.find(_MARKER)
        if at < 0:
            return ""
        after = text[at + len(_MARKER):]
        return after[:len(after) - len(after.lstrip())]

    def _turn_terminator(self) -> int | None:
        """The special token the template puts right after an assistant message's content (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>), found by rendering a minimal conversation; where the last turn has none, the token
        that opens the next user turn (GLM's <|user|>, which its model samples to end a turn); None if neither."""
        user = {"role": "user", "content": "U"}
        for messages in ([user, {"role": "assistant", "content": _MARKER}],
                         [user, {"role": "assistant", "content": _MARKER}, {"role": "user", "content": "V"}]):
            try:
                text = self.render(messages, False)
            except RenderError:
                continue
            at = text.rfind(_MARKER)
            if at < 0:
                continue
            for token in self.encode(text[at + len(_MARKER):]):
                if token in self._special_ids:
                    return token
                if self.decode([token]).strip():
                    break  # visible text before any special token: no terminator
        return None


def _sampled_turn(before: str, rendered: str) -> str:
    """What a model writes for the last turn of `rendered` after the generation prompt `before`: the text after
    their common prefix, backed off to a line break or a tag's end (a marker both start, Gemma 4's `<|`, is not cut
    in two; a generation prompt that opens a think block a past call turn lacks does not matter)."""
    shared = len(os.path.commonprefix([before, rendered]))
    while shared and rendered[shared - 1] not in ">\n":
        shared -= 1
    return rendered[shared:]


def generation_config_stops(model_path: str) -> set[int]:
    """The ids a local model folder's generation_config.json stops on (`eos_token_id`, one id or a list): where a
    model ends turns its template never shows (Llama 3.2's <|eom_id|>), its own config says so."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return {int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None}


HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
OTHER_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "Write each function call as:\n{call}")


def with_tools_system_block(messages: list[Message], tools: list[dict], fmt: ToolFormat = HERMES) -> list[Message]:
    """Tool instructions appended to the system message (or as one), for templates that ignore `tools=`: Qwen2.5's
    hermes text (what the Qwen/Hermes templates render, a format models know), or for a template whose calls are
    in another format (DeepSeek R1) the same text asking for that format, so the model is told what we parse."""
    tools_text = "\n".join(json.dumps(t) for t in tools)
    if fmt.name == HERMES.name:
        block = HERMES_TOOLS_PROMPT.format(tools=tools_text)
    else:
        block = OTHER_TOOLS_PROMPT.format(tools=tools_text, call=fmt.expected_format)
    if messages and messages[0].get("role") == "system":
        return [dict(messages[0], content=f"{messages[0]['content']}\n\n{block}"), *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
