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
from dataclasses import replace
from typing import Any

from skyrl_stepwise.chat.base import Message, NextPrompt, ParsedTurn, RenderError, check_observations_kept
from skyrl_stepwise.chat.tool_formats import PROBE_ARG, PROBE_NAME, ToolFormat
from skyrl_stepwise.chat.tool_formats.detect import ProbeRendering
from skyrl_stepwise.chat.tool_formats.hermes import HERMES
from skyrl_stepwise.chat.tool_parsers import parse_harmony_text, tool_parser_for

# Stands in for sampled assistant content when only the template's rendering of the *new* messages is wanted;
# plain ASCII so no template trims or escapes it.
_MARKER = "SKYRLASSISTANTTURNMARKER"
_LAST_MARKER = "SKYRLLASTTURNMARKER"  # the last assistant turn's, so an earlier turn's marker is never taken for it


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
        terminator = self._turn_terminator()
        # A base-model tokenizer can end text with EOS (<|endoftext|>) and turns with another token (<|im_end|>).
        self.close_id = terminator if terminator is not None else tokenizer.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id, self.close_id}
        probe, self.string_arguments = self._tool_support()
        self.renders_tools, self.renders_tool_calls = probe.renders_tools, probe.renders_calls
        # the format the template renders calls in (generator.tool_parser overrides); unknown: fails here
        self.tool_parser = tool_parser_for(probe, tokenizer, tool_parser)
        call_close = self._call_turn_stop(probe)
        if call_close is not None:  # harmony ends a tool-call turn with <|call|>: the engine must stop there too
            self.stop_ids.add(call_close)
        # a call block's own closer (Command R's <|END_ACTION|>, MiniMax's </minimax:tool_call>) is part of the call
        self._call_close = call_close if call_close not in (tokenizer.eos_token_id, self.close_id) else None
        specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        self._special_texts = sorted(specials | {t for t in tokenizer.all_special_tokens if t})

    def render(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The chat template as text; tool schemas go where the template puts them, or in a hermes system block
        if it ignores `tools=` (SmolLM2), so the model always sees what it may call."""
        if tools and not self.renders_tools:
            messages = with_tools_system_block(messages, tools, self.tool_parser.format)
        return self._apply_template(messages, add_generation_prompt, tools)

    def _apply_template(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        """The single place the chat template is applied."""
        kwargs = dict(self.kwargs)
        tools = tools if tools is not None else kwargs.pop("tools", None)  # a template may need `tools` (even [])
        kwargs.pop("tools", None)
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

    def parse(self, completion_ids: list[int], prompt_ids: list[int], tools: list[dict] | None = None) -> ParsedTurn:
        """The sampled text without its closing token (the template handles any reasoning in it); with tools,
        calls in the template's format become calls and the content is the text before them."""
        ends = completion_ids and completion_ids[-1] in self.stop_ids and completion_ids[-1] != self._call_close
        ids = completion_ids[:-1] if ends else completion_ids
        text = self.decode(ids)
        if "<|channel|>" in text:  # gpt-oss (harmony): the template wants final text and analysis apart
            content, thinking, calls = parse_harmony_text(text)
            return ParsedTurn(content, thinking, calls if tools else [], reasoning_key="thinking")
        if not tools:
            return ParsedTurn(text)
        content, calls = self.tool_parser.parse(ids, self.decode, tools)
        if self.string_arguments:  # the template concatenates arguments as text (DeepSeek R1): OpenAI's JSON string
            calls = [replace(c, arguments=json.dumps(c.arguments, ensure_ascii=False))
                     if c.error is None and isinstance(c.arguments, dict) else c for c in calls]
        # a template that cannot render `tool_calls` would drop the calls from a re-rendered history: keep them
        # in the content, as sampled
        return ParsedTurn(content if self.renders_tool_calls else text, None, calls)

    def next_prompt(self, prompt_ids: list[int], completion_ids: list[int], history: list[Message],
                    new_messages: list[Message], tools: list[dict] | None = None) -> NextPrompt:
        """Extend prompt + sampled ids by the template's text for the new messages; re-render where it cannot."""
        closing = [] if completion_ids and completion_ids[-1] in self.stop_ids else [self.close_id]
        prefix = prompt_ids + completion_ids + closing
        rendered = self.render(history, True, tools)
        prefix_text = self.decode(prefix)
        if rendered.startswith(prefix_text):
            suffix = rendered[len(prefix_text):]
        elif self.thinking_retention == "all":
            suffix = self._new_messages_text(history, tools)
            if suffix is None:
                return self._rerender(rendered, new_messages, "template_rerenders_earlier_turns")
        else:
            return self._rerender(rendered, new_messages, "template_rewrites_history")
        check_observations_kept(new_messages, suffix, self.name)
        return NextPrompt(prefix + self.encode(suffix), True)

    def _rerender(self, rendered: str, new_messages: list[Message], reason: str) -> NextPrompt:
        check_observations_kept(new_messages, rendered, self.name)
        return NextPrompt(self.encode(rendered), False, reason)

    def _new_messages_text(self, history: list[Message], tools: list[dict] | None) -> str | None:
        """What the template renders after the last assistant turn's terminator, with that turn's content replaced
        by a marker (so the template's rewriting of sampled content cannot matter); None if it cannot be found.

        A template that renders a tool-call turn without its content (Mistral) shows the marker only once the
        turn's `tool_calls` are left out; what follows the turn (the tool results) does not depend on them."""
        last = max((i for i, m in enumerate(history) if m.get("role") == "assistant"), default=-1)
        marked = [dict(m, content=_LAST_MARKER if i == last else _MARKER) if m.get("role") == "assistant" else m
                  for i, m in enumerate(history)]
        for m in marked:
            m.pop("reasoning_content", None)
        text = self.render(marked, True, tools)
        if _LAST_MARKER not in text and last >= 0 and marked[last].get("tool_calls"):
            marked[last] = {k: v for k, v in marked[last].items() if k != "tool_calls"}
            text = self.render(marked, True, tools)
        at = text.rfind(_LAST_MARKER)
        if at < 0:
            return None
        # the earliest special token after the content closes the turn (harmony closes past turns with <|end|>,
        # the last one with <|return|>)
        closes = [(i, t) for t in self._special_texts if (i := text.find(t, at + len(_LAST_MARKER))) >= 0]
        if not closes:
            return None
        i, t = min(closes)
        return text[i + len(t):]

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
        probe = ProbeRendering(before, "", renders_tools)
        # arguments as a dict, else as OpenAI's JSON string; content "" or None (DeepSeek R1 renders calls only
        # for `content is none`)
        for arguments, content in (({PROBE_ARG: 1}, ""), ({PROBE_ARG: 1}, None), (json.dumps({PROBE_ARG: 1}), ""),
                                   (json.dumps({PROBE_ARG: 1}), None)):
            # a 9-character alphanumeric id: Mistral templates refuse any other
            call = {"role": "assistant", "content": content, "tool_calls": [{
                "type": "function", "id": "call00000", "function": {"name": PROBE_NAME, "arguments": arguments}}]}
            try:
                probe = ProbeRendering(before, self._apply_template(user + [call], False, [tool]), renders_tools)
            except RenderError:
                continue
            if probe.renders_calls:
                two = dict(call, tool_calls=call["tool_calls"] * 2)  # parallel calls, where the template takes them
                try:
                    probe = replace(probe, with_two_calls=self._apply_template(user + [two], False, [tool]))
                except RenderError:
                    pass
                return probe, isinstance(arguments, str)
        return probe, False

    def _call_turn_stop(self, probe: ProbeRendering) -> int | None:
        """The special token that ends a tool-call turn (None: the turn terminator does): harmony's <|call|>, a call
        block's closer (Command R's <|END_ACTION|>). Where every call has a closer of its own (Gemma 4's
        <tool_call|>, Seed-OSS's </seed:tool_call>) it is the token after the last one, so parallel calls are not
        cut after the first."""
        at = probe.with_call.rfind(PROBE_ARG)
        first = self._first_special(probe.with_call[at:]) if at >= 0 else None
        two = probe.with_two_calls
        if first is None or not two:
            return first
        closer = self.decode([first])
        if two.count(closer) - probe.before.count(closer) < 2:
            return first
        return self._first_special(two[two.rfind(closer) + len(closer):])

    def _first_special(self, text: str) -> int | None:
        """The first special token id in `text`."""
        special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        return next((t for t in self.encode(text) if t in special), None)

    def _turn_terminator(self) -> int | None:
        """The special token the template puts right after an assistant message's content (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>), found by rendering a minimal conversation; None if there is none."""
        text = self.render([{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARKER}], False)
        at = text.rfind(_MARKER)
        if at < 0:
            return None
        special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        for token in self.encode(text[at + len(_MARKER):]):
            if token in special:
                return token
            if self.decode([token]).strip():
                return None  # visible text before any special token: no terminator
        return None


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
