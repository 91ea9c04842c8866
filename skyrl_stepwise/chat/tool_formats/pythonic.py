"""Python-syntax calls: `<|tool_call_start|>[name(k="v", n=1), other()]<|tool_call_end|>` (LFM2; the list is the
one vLLM's `pythonic` parser reads, here inside LFM2's markers). LFM2's template renders no `tool_calls`: it
lists the schemas between `<|tool_list_start|>` and `<|tool_list_end|>`, which is how the format is recognised;
the model writes its calls in its content. Arguments are Python literals (JSON's true/false/null accepted).
"""

from __future__ import annotations

import ast
import re

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.chat.tool_formats.base import ToolFormat, parse_blocks

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
PYTHONIC_FORMAT = f'{OPEN}[<tool name>(<arg>=<Python literal>, ...)]{CLOSE}'
_JSON_NAMES = {"true": True, "false": False, "null": None}


def parse_pythonic_text(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCallRequest]]:
    """(content before the first call block, every call of each block's list)."""
    return parse_blocks(text, OPEN, CLOSE, _read_block)


def _read_block(body: str) -> list[ToolCallRequest]:
    body = body.strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):  # ValueError: a NUL byte; RecursionError: absurd nesting
        # LFM2.5's template writes a string value between quotes as is ('    return x\n' with a real newline):
        # read line breaks inside a quoted value as the characters they are
        try:
            escaped = _escape_line_breaks_in_strings(body)
            tree = ast.parse(escaped, mode="eval").body
            body = escaped  # (the calls' raw text is cut from what was parsed)
        except (SyntaxError, ValueError, RecursionError):
            return [ToolCallRequest(None, None, body, "invalid_syntax")]
    items = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    return [_call(item, body) for item in items]


def _escape_line_breaks_in_strings(body: str) -> str:
    """`body` with each raw line break inside a one-quote string literal written as its escape (\\n, \\r), so a
    value the template wrote unescaped reads back as written; text outside strings is left alone."""
    out, quote, i = [], None, 0
    while i < len(body):
        c = body[i]
        if quote is None:
            if c in "'\"":
                if body.startswith(c * 3, i):  # a triple-quoted string may hold line breaks: copy it whole
                    end = body.find(c * 3, i + 3)
                    end = len(body) if end < 0 else end + 3
                    out.append(body[i:end])
                    i = end
                    continue
                quote = c
        elif c == "\\" and i + 1 < len(body):
            out.append(body[i:i + 2])
            i += 2
            continue
        elif c == quote:
            quote = None
        elif c in "\n\r":
            c = "\\n" if c == "\n" else "\\r"
        out.append(c)
        i += 1
    return "".join(out)


def _call(node: ast.expr, body: str) -> ToolCallRequest:
    raw = ast.get_source_segment(body, node) or body
    if not isinstance(node, ast.Call) or node.args:
        return ToolCallRequest(None, None, raw, "malformed_structure")
    name = _dotted(node.func)
    if not name:
        return ToolCallRequest(None, None, raw, "missing_name")
    arguments = {}
    for kw in node.keywords:
        if kw.arg is None:  # **kwargs
            return ToolCallRequest(name, None, raw, "malformed_structure")
        try:
            arguments[kw.arg] = json_literal(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, an unhashable key, too deep
            return ToolCallRequest(name, None, raw, "invalid_arguments")
    return ToolCallRequest(name, arguments, raw)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def json_literal(node: ast.expr):
    """The JSON value a Python literal expression writes (`true`/`null` names too); ValueError where JSON cannot
    hold it (complex, bytes, sets, non-string keys)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [json_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [json_literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("JSON object keys are strings")
        return dict(zip(keys, (json_literal(v) for v in node.values)))
    value = ast.literal_eval(node)
    if value is not None and not isinstance(value, (str, int, float, bool)):  # complex, bytes, sets: not JSON
        raise ValueError(f"not a JSON value: {type(value).__name__}")
    return value


PYTHONIC = ToolFormat(
    name="pythonic", expected_format=PYTHONIC_FORMAT, markers=(OPEN,),
    renders=re.compile(re.escape(OPEN) + r"\s*\[\s*skyrl_probe_call\("),
    instructs=re.compile(re.escape("<|tool_list_start|>")),
    parse_text=parse_pythonic_text, description="<|tool_call_start|>[name(k=v)] Python syntax (LFM2)")
