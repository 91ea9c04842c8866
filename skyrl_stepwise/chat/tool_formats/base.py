"""What every tool-call format shares: its description (`ToolFormat`), the parser built from it (`ToolParser`), and
small readers several formats use (a JSON call object, XML-style arguments: xml_values.py).

A format is recognised from the chat template's own rendering of a probe call (see detect.py), so each one says
what that rendering looks like (`renders`), which text opens a call (`markers`: a turn that contains one but
yields no call is a malformed call, never a final answer) and how a call looks (`expected_format`: told to the
model when its call could not be read).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.xml_values import DEFAULT_PADDING, ValuePadding, xml_call

# (text, tools) -> (content before the first call, every call attempt in order)
TextParser = Callable[[str, "list[dict] | None"], "tuple[str, list[ToolCallRequest]]"]
# tokenizer -> ((ids, decode) -> (content, calls)), or None where the tokenizer lacks the single tokens it reads
LibraryParser = Callable[[Any], "Callable[[list[int], Callable], tuple[str, list[ToolCallRequest]]] | None"]

PROBE_NAME = "skyrl_probe_call"  # the distinctive call the template is asked to render
PROBE_ARG = "skyrl_probe_arg"


@dataclass(frozen=True)
class ToolFormat:
    """One call format: how the template renders the probe call, what opens a call, how to read calls."""

    name: str  # the value of generator.tool_parser that selects it
    expected_format: str  # how one call looks, told to the model with a parse error
    markers: tuple[str, ...]  # text that opens a call attempt
    renders: re.Pattern  # matches the template's rendering of the probe call turn
    parse_text: TextParser
    library: LibraryParser | None = None  # the `renderers` token-level parser, where it has one
    # matches a template's tool instructions, for templates that do not render `tool_calls` (Granite 3.3)
    instructs: re.Pattern | None = None
    description: str = ""
    # XML-style formats: the text reader for values padded as a template writes them (`ValuePadding`, probed);
    # `parse_text` is this reader with DEFAULT_PADDING
    padded: Callable[[ValuePadding], TextParser] | None = None


class ToolParser:
    """Sampled ids -> (content, calls) in one format; a call marker that yields no call is a malformed call."""

    def __init__(self, fmt: ToolFormat, tokenizer, padding: ValuePadding | None = None) -> None:
        self.format = fmt
        self.name = fmt.name
        self._library = fmt.library(tokenizer) if fmt.library is not None else None
        self._parse_text = fmt.padded(padding) if padding is not None and fmt.padded is not None else fmt.parse_text

    def parse(self, ids: list[int], decode, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
        """Every call attempt, each malformed one carrying its error kind and this format's expected_format."""
        text = decode(ids)
        if self._library is not None:
            content, calls = self._library(list(ids), decode)
        else:
            content, calls = self._parse_text(text, tools)
        if not calls:
            at = first_marker(text, self.format.markers)
            if at >= 0:  # the model opened a call we cannot read: answer it, do not end the episode on it
                return text[:at], [ToolCallRequest(None, None, text[at:], "unparsed_call_marker",
                                                   expected_format=self.format.expected_format)]
        return content, [c if c.error is None or c.expected_format else
                         replace(c, expected_format=self.format.expected_format) for c in calls]


def first_marker(text: str, markers: tuple[str, ...]) -> int:
    """Where the first call marker starts in `text`, -1 if none."""
    found = [i for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else -1


def call_from_object(obj: Any, raw: str, name_key: str = "name", args_keys: tuple[str, ...] = ("arguments",),
                     call_id: str | None = None) -> ToolCallRequest:
    """A call from a decoded JSON object `{name_key: ..., <args key>: {...}}`; missing_name where it has none."""
    if not isinstance(obj, dict):
        return ToolCallRequest(None, None, raw, "malformed_structure", call_id)
    name = obj.get(name_key)
    arguments = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(name, str) or not name:
        return ToolCallRequest(None, arguments, raw, "missing_name", call_id)
    return ToolCallRequest(name, arguments, raw, None, call_id)


def json_list_calls(body: str, name_key: str, args_keys: tuple[str, ...],
                    id_key: str | None = None) -> list[ToolCallRequest]:
    """Calls from a JSON list of call objects (Command R): one invalid_json call if the list
    does not decode, one call per element otherwise."""
    try:
        items = json.loads(body)
    except json.JSONDecodeError:
        return [ToolCallRequest(None, None, body, "invalid_json")]
    items = items if isinstance(items, list) else [items]
    return [call_from_object(item, json.dumps(item), name_key, args_keys,
                             str(item[id_key]) if id_key and isinstance(item, dict) and id_key in item else None)
            for item in items]


def parse_marked_json(text: str, marker: str, name_key: str = "name",
                      args_keys: tuple[str, ...] = ("arguments", "parameters"),
                      consecutive: bool = False) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first `marker`, every call of the JSON value (a call object or a list of them) after
    each marker): Granite's `<|tool_call|>`, Firefunction's `functools`, Nemotron Nano 2's `<TOOLCALL>`. The value
    is read where it ends (`raw_decode`), not up to the next marker, a close tag or the end of the turn: text the
    model writes after the list or a marker quoted inside an argument does not break a well-formed call.
    `consecutive`: further JSON values right after the first (whitespace apart) are calls too (MiniMax-M1 writes
    one object a line inside one `<tool_calls>` block)."""
    start = text.find(marker)
    if start < 0:
        return text, []
    calls, at = [], start
    while at >= 0:  # a model may open each call with the marker
        body = at + len(marker)
        value_start = len(text) - len(text[body:].lstrip())
        try:
            value, end = _DECODER.raw_decode(text, value_start)
        except json.JSONDecodeError:
            nxt = text.find(marker, body)
            calls.append(ToolCallRequest(None, None, text[body:nxt if nxt >= 0 else len(text)].strip(),
                                         "invalid_json"))
            at = nxt
            continue
        items = value if isinstance(value, list) else [value]
        calls.extend(call_from_object(item, json.dumps(item), name_key, args_keys) for item in items)
        while consecutive and text[end:].lstrip()[:1] in ("{", "["):
            value_start = len(text) - len(text[end:].lstrip())
            try:
                value, end = _DECODER.raw_decode(text, value_start)
            except json.JSONDecodeError:
                nxt = text.find(marker, value_start)
                calls.append(ToolCallRequest(None, None, text[value_start:nxt if nxt >= 0 else len(text)].strip(),
                                             "invalid_json"))
                end = nxt if nxt >= 0 else len(text)
                break
            items = value if isinstance(value, list) else [value]
            calls.extend(call_from_object(item, json.dumps(item), name_key, args_keys) for item in items)
        at = text.find(marker, end)
    return text[:start], calls


_DECODER = json.JSONDecoder()


def schema_params(tools: list[dict] | None) -> dict[str, dict[str, dict]]:
    """tool name -> parameter name -> JSON schema: how XML-style values are typed (the library's index)."""
    from renderers.parsing import _build_param_type_index

    return _build_param_type_index(tools)


def xml_arguments(name: str, pairs: list[tuple[str, str]], tools: list[dict] | None, raw: str,
                  padding: ValuePadding = DEFAULT_PADDING) -> ToolCallRequest:
    """A call from (key, value as written) pairs, each value unpadded and typed by the tool's schema
    (xml_values.py); never refused here: a wrong type or an unknown tool is the executor's to answer."""
    return xml_call(name, pairs, schema_params(tools).get(name, {}), raw, padding)


def parse_blocks(text: str, open_tag: str, close_tag: str, read_block: Callable[[str], list[ToolCallRequest]]
                 ) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first block, the calls of every `open_tag ... close_tag` block): `read_block` reads the
    body of a closed block (one call or several); a block the turn ended inside is one unclosed_block call."""
    start, found = blocks(text, open_tag, close_tag)
    if start < 0:
        return text, []
    calls = []
    for body, closed in found:
        calls.extend(read_block(body) if closed else [ToolCallRequest(None, None, body, "unclosed_block")])
    return text[:start], calls


def blocks(text: str, open_tag: str, close_tag: str) -> tuple[int, list[tuple[str, bool]]]:
    """(start of the first block, [(body, closed)]) of every `open_tag ... close_tag` block; an unclosed block
    runs to the end of the text and is the last."""
    start = text.find(open_tag)
    if start < 0:
        return -1, []
    found, at = [], start
    while at >= 0:
        end = text.find(close_tag, at + len(open_tag))
        if end < 0:
            found.append((text[at + len(open_tag):], False))
            break
        found.append((text[at + len(open_tag):end], True))
        at = text.find(open_tag, end + len(close_tag))
    return start, found


def library_token_parser(name: str, markers: tuple[str, ...]) -> LibraryParser:
    """A `LibraryParser` for the `renderers` token-level parser `name`: it finds calls by token id, so it is used
    only where every one of `markers` is a single token (else None: the text reader runs)."""

    def build(tokenizer):
        from renderers.parsers import get_tool_parser

        if any(tokenizer.convert_tokens_to_ids(m) in (None, tokenizer.unk_token_id) for m in markers):
            return None
        library = get_tool_parser(name, tokenizer)

        def parse(ids: list[int], decode) -> tuple[str, list[ToolCallRequest]]:
            content_ids, parsed = library.extract(ids)
            return decode(content_ids), [ToolCallRequest(c.name, c.arguments, c.raw, None if c.status == "ok"
                                                         else str(c.status), c.id) for c in parsed]
        return parse
    return build

