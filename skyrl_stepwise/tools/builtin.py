"""Builtin tools: a safe calculator and a Search-R1 retriever search (class_name "calculator" / "search").

The calculator never calls `eval`: it walks the expression's `ast` and allows numbers, + - * / // % **,
unary +/- and parentheses only, with the exponent and the size of every intermediate result bounded, so a
model that writes `9**9**9` gets a refusal instead of freezing the rollout worker.

The search tool shares the Search-R1 env's retrieval client (timeout, bounded retries) and document format
(`Doc {index}(Title: {title}) {text}`), so tool-calling and tag-based Search-R1 runs see identical evidence.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any

import httpx

from skyrl_stepwise.retrieval.index import format_documents
from skyrl_stepwise.retrieval.client import (RetrievalClient, RetrievalError, RetrievalUnavailable,
                                             RetrieverEndpointConfig)
from skyrl_stepwise.tools.base import FailedCall, Tool, ToolUnavailable
from skyrl_stepwise.tools.config import ToolConfigError


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


@dataclass
class CalculatorConfig:
    """Bounds that keep one expression cheap: every integer stays under `max_digits` digits."""

    max_exponent: float = 100
    max_digits: int = 1000
    max_expression_chars: int = 1000
    float_precision: int = 15  # significant digits shown for non-integer results

    def __post_init__(self) -> None:
        """Reject bounds that would disable the safety they exist for."""
        for key in ("max_exponent", "max_digits", "max_expression_chars", "float_precision"):
            if getattr(self, key) <= 0:
                raise ToolConfigError(f"calculator config {key!r} must be > 0, got {getattr(self, key)!r}")
        if self.max_digits > 4000:  # Python refuses to print ints past 4300 digits
            raise ToolConfigError(f"calculator config 'max_digits' must be <= 4000, got {self.max_digits}")


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REFUSED = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attribute access",
            ast.Subscript: "subscripts", ast.Compare: "comparisons", ast.BoolOp: "boolean operators",
            ast.Lambda: "lambdas", ast.IfExp: "conditional expressions"}
_ALLOWED = "use only numbers, + - * / // % ** and parentheses"


def _check_size(value: int | float, max_bits: int) -> int | float:
    """Refuse integers beyond the digit bound right after each operation, so the next one stays cheap."""
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > max_bits:
        raise CalculatorError("the result is too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is too large (not finite)")
    return value


def _power(base: int | float, exponent: int | float, cfg: CalculatorConfig, max_bits: int) -> int | float:
    """`base ** exponent` with |exponent| bounded and the integer result size estimated before computing it."""
    if abs(exponent) > cfg.max_exponent:
        raise CalculatorError(f"exponent {exponent!r} is too large (|exponent| must be <= {cfg.max_exponent:g})")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if (abs(base).bit_length() - 1) * exponent > max_bits:  # lower bound of the result's bit length
            raise CalculatorError("the result is too large")
    return base ** exponent


def _eval(node: ast.AST, cfg: CalculatorConfig, max_bits: int) -> int | float:
    """Evaluate an allowed node; anything else is refused by name, never executed."""
    if isinstance(node, ast.Expression):
        return _eval(node.body, cfg, max_bits)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check_size(node.value, max_bits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, cfg, max_bits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, cfg, max_bits), _eval(node.right, cfg, max_bits)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right, cfg, max_bits), max_bits)
        return _check_size(_BINARY[type(node.op)](left, right), max_bits)
    if isinstance(node, ast.Name):
        raise CalculatorError(f"not allowed: names ({node.id!r}); {_ALLOWED}")
    what = _REFUSED.get(type(node))
    if what is None:
        op = getattr(node, "op", None)
        what = f"the operator {type(op).__name__}" if op is not None else type(node).__name__
    raise CalculatorError(f"not allowed: {what}; {_ALLOWED}")


def safe_eval(expression: str, cfg: CalculatorConfig | None = None) -> int | float:
    """Evaluate arithmetic without `eval`; raises CalculatorError with a reason the model can act on."""
    cfg = cfg or CalculatorConfig()
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty")
    if len(expression) > cfg.max_expression_chars:
        raise CalculatorError(f"the expression is too long ({len(expression)} > {cfg.max_expression_chars} chars)")
    max_bits = math.ceil(cfg.max_digits * math.log2(10))
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not a valid arithmetic expression: {getattr(e, 'msg', None) or e}") from None
    try:
        return _eval(tree, cfg, max_bits)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("the result is too large") from None
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: int | float, precision: int = 15) -> str:
    """Integers exactly; floats to `precision` significant digits, so 0.1 + 0.2 reads as 0.3."""
    if isinstance(value, int):
        return str(value)
    return format(value, f".{precision}g")


class CalculatorTool(Tool):
    """`calculator(expression)`: exact integer / float arithmetic for models that cannot multiply reliably."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4.5) * 2 ** 10"}},
                "required": ["expression"],
            },
        },
    }

    config_class = CalculatorConfig

    async def call(self, arguments: dict[str, Any]) -> str:
        """The value of `arguments["expression"]` as text; refusals raise CalculatorError (a tool_error)."""
        return format_number(safe_eval(arguments.get("expression", ""), self.cfg), self.cfg.float_precision)


@dataclass
class SearchToolConfig(RetrieverEndpointConfig):
    """The retriever endpoint and retry policy (the Search-R1 env's keys) and the text the model reads."""

    doc_template: str = "Doc {index}(Title: {title}) {text}\n"
    failure_template: str = "Search failed: {error}"
    empty_message: str = "No documents found."

    def __post_init__(self) -> None:
        """Fail when the tools file loads, not mid-rollout, on a bad template or topk."""
        super().__post_init__()
        if self.topk < 1:
            raise ToolConfigError(f"search config 'topk' must be >= 1, got {self.topk}")
        for key, fields in (("doc_template", {"index": 1, "title": "", "text": ""}),
                            ("failure_template", {"error": ""})):
            try:
                getattr(self, key).format(**fields)
            except (KeyError, IndexError, ValueError) as e:
                raise ToolConfigError(f"search config {key!r} must only use the fields {sorted(fields)}: "
                                      f"{e!r}") from None


class SearchTool(Tool):
    """`search(query)`: top-k passages from a Search-R1 retriever; a failing retriever yields a readable
    'Search failed: ...' text (counted in `failures`, and a FailedCall: not a result), never an exception, so the
    episode goes on."""

    config_class = SearchToolConfig
    retrieval = True

    default_schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search a Wikipedia index and return the most relevant passages.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to search for"}},
                "required": ["query"],
            },
        },
    }

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None,
                 client: RetrievalClient | None = None) -> None:
        super().__init__(config, tool_schema)
        self.client = client or RetrievalClient(self.cfg.client_config())
        self.failures = 0

    async def call(self, arguments: dict[str, Any]) -> str:
        """The Search-R1 doc list for `arguments["query"]` (one line per passage)."""
        query = str(arguments.get("query", "")).strip()
        if not query:
            return FailedCall("Search failed: the query is empty.")
        try:
            docs = (await self.client.search([query], self.cfg.topk))[0]
        except RetrievalUnavailable as e:
            if self.cfg.retriever_down == "fail":  # down through every retry: the trajectory fails, not the model
                raise ToolUnavailable(f"search: {e}") from e
            self.failures += 1
            return FailedCall(self.cfg.failure_template.format(error=(str(e) or type(e).__name__)[:300]))
        except (RetrievalError, httpx.HTTPError) as e:  # a broken retriever must not end the episode
            self.failures += 1
            return FailedCall(self.cfg.failure_template.format(error=(str(e) or type(e).__name__)[:300]))
        text = format_documents(docs, self.cfg.doc_template).strip()
        return text or self.cfg.empty_message

    async def aclose(self) -> None:
        """Close the retrieval client's pooled connections."""
        await self.client.aclose()
