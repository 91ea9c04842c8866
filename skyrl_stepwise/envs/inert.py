"""Scoring an answer without running it: a third-party scorer that evaluates the answer text never runs the
policy's code in the trainer.

Why: several reasoning-gym scorers `eval()` the answer (string_insertion, spiral_matrix, binary_matrix, n_queens) or
hand it to sympy's `parse_expr`, which evals too (countdown, puzzle24, the integration and polynomial tasks). Their
scorers run in the trainer, so an answer like `[setattr(__import__('skyrl_stepwise.envs.reasoning_gym', ...),
'_scorer', lambda t: lambda a, e: 1.0), 'x'][1]` rewrote the scorer and every later episode was paid 1.0, and
`__import__('sys')._getframe(1).f_locals['oracle_answer']` read the expected answer out of the scorer's frame.

So while a scorer grades an answer (`inert_scoring`), every source text this process compiles from a string
(`eval`, `exec`, `compile`: Python's "compile" audit event, whichever library asks) must be inert data: literals,
containers, names, arithmetic with a bounded power, and calls only to pure math functions and the wrappers sympy
writes around numbers and symbols. Anything else (an attribute, a subscript, a call to any other name, a lambda, a
comprehension, a name starting with `_`, powers of powers past a bound) aborts that compile before a byte of it runs
(`AnswerIsCode`), and the answer is refused: it pays 0, whatever the scorer does with the error. Modules imported
from files are not answers and compile as usual. The gate is one audit hook, installed once per process and idle
outside `inert_scoring`; data/reasoning_gym.py checks at build time that every task's own answers still score the
same through it, so a task the gate would underpay is refused loudly before training, not paid 0 silently.
"""

from __future__ import annotations

import ast
import os
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

MAX_SOURCE_CHARS = 10_000  # an answer longer than this is not scored as an expression
MAX_EXPONENT = 1_000  # x**1000 is a polynomial; 10**10**10 is a denial of service
MAX_GROWTH = 1_000_000  # (x**12)**7 is fine; ((9**1000)**1000)**1000 has a billion digits
# pure functions of numbers and symbols (sympy's and Python's names), and what sympy's parser wraps literals in
MATH_CALLS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh", "tanh", "asinh",
    "acosh", "atanh", "exp", "log", "ln", "sqrt", "Abs", "abs",
    "Integral"})  # unevaluated until asked: intermediate_integration's own answers hold one where sympy found none
WRAPPERS = frozenset({"Integer", "Float", "Symbol", "Rational"})  # each takes a literal; none evaluates a string
_OPERATORS = (ast.UAdd, ast.USub, ast.Not, ast.Invert, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod,
              ast.Pow, ast.LShift, ast.RShift, ast.BitXor, ast.BitAnd, ast.BitOr, ast.And, ast.Or, ast.Eq, ast.NotEq,
              ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_GROWING = (ast.Pow, ast.LShift)  # the operators whose result grows with their right operand: bounded
_NODES = (ast.Expression, ast.Module, ast.Expr, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Name,
          ast.Load, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.Call, *_OPERATORS)


class AnswerIsCode(Exception):
    """A compile during scoring was refused: the answer text is code, not data."""


@dataclass
class _Scoring:
    refused: list[str] = field(default_factory=list)  # why each refused compile was refused


_ACTIVE: ContextVar[_Scoring | None] = ContextVar("skyrl_inert_scoring", default=None)
_installed = False


def why_not_inert(source: str | bytes) -> str | None:
    """Why `source` is not inert data (None: it is, or it is not Python at all, so compiling it runs nothing)."""
    if isinstance(source, bytes):
        try:
            source = source.decode()
        except UnicodeDecodeError:
            return "source that is not UTF-8"
    if len(source) > MAX_SOURCE_CHARS:
        return f"an expression longer than {MAX_SOURCE_CHARS} characters"
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # its compile fails the same way: nothing runs
    except (RecursionError, MemoryError, ValueError):
        return "an expression nested too deeply to read"
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.ImportFrom) and tree.body[0].module == "sympy" and \
            [alias.name for alias in tree.body[0].names] == ["*"]:
        return None  # what sympy's parse_expr runs first to build its namespace, on every call
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return "statements"
    return _why_not(tree.body[0].value)


def _why_not(node: ast.AST) -> str | None:
    for child in ast.walk(node):
        if not isinstance(child, _NODES):
            return f"an expression of kind {type(child).__name__}"
        if isinstance(child, ast.Name) and child.id.startswith("_"):
            return f"the name {child.id!r}"
        if isinstance(child, ast.Call):
            name = child.func.id if isinstance(child.func, ast.Name) else None
            if name not in MATH_CALLS | WRAPPERS or child.keywords:
                return f"a call to {ast.unparse(child.func)!r}"
            if name not in WRAPPERS and any(_bare_string(a) for a in child.args):
                return f"a string passed to {name!r}"  # sympy functions sympify a string argument: an eval
        if isinstance(child, ast.BinOp) and isinstance(child.op, _GROWING):
            exponent = _number(child.right)
            if exponent is None or abs(exponent) > MAX_EXPONENT:
                return f"an exponent or shift other than a number up to {MAX_EXPONENT}"
            if _growth(child) > MAX_GROWTH:
                return f"powers of powers whose exponents multiply past {MAX_GROWTH}"
        if isinstance(child, ast.BinOp) and isinstance(child.op, ast.Mult) and any(
                isinstance(side, (ast.List, ast.Tuple, ast.Set)) or
                isinstance(side, ast.Constant) and isinstance(side.value, (str, bytes))
                for side in (child.left, child.right)):
            return "a repeated sequence"
    return None


def _bare_string(node: ast.AST) -> bool:
    """A string literal in `node` outside the wrappers' own arguments (`Symbol('x')` is a symbol, not a string)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (str, bytes))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in WRAPPERS:
        return False
    return any(_bare_string(child) for child in ast.iter_child_nodes(node))


def _growth(node: ast.AST) -> float:
    """The largest product of the exponents along a chain of powers nested in each other's bases in `node` (1
    without powers): how many digits a tower can reach, which the exponents one by one do not bound."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, _GROWING):
        exponent = _number(node.right)
        return max(1.0, abs(exponent if exponent is not None else float("inf"))) * _growth(node.left)
    return max((_growth(child) for child in ast.iter_child_nodes(node)), default=1.0)


def _number(node: ast.AST) -> float | None:
    """The value of a numeric literal (signed, wrapped as sympy writes it: Integer(2), Float('0.5'), or a sum,
    difference, product or quotient of such: 3/2), None for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _number(node.operand)
        return None if value is None else -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _number(node.left), _number(node.right)
        if left is None or right is None or abs(left) > MAX_EXPONENT or abs(right) > MAX_EXPONENT:
            return None
        if isinstance(node.op, ast.Div):
            return None if right == 0 else left / right
        return left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
            else left * right
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Integer", "Float") \
            and len(node.args) == 1:
        return _number(node.args[0])
    if isinstance(node, ast.Constant) and not isinstance(node.value, bool):
        try:
            return float(node.value)
        except (TypeError, ValueError, OverflowError):
            return None
    return None


# code generators that compile their own text while scoring (the standard library's namedtuple __new__ and dataclass
# __init__, when a type is first made; sympy's monomial arithmetic for a polynomial ring of N generators, when the
# answer's expression first has N symbols): nothing of an answer's text reaches them, only counts and names of theirs
_STDLIB = os.path.dirname(os.__file__)
_GENERATORS = frozenset(os.path.join(_STDLIB, name) for name in (
    "collections/__init__.py", "dataclasses.py", "typing.py", "enum.py", "string.py"))
_LIBRARY_GENERATORS = (os.path.join("sympy", "polys", "monomials.py"),)


def _generator(caller: str) -> bool:
    """Whether `caller` (the file of the code that asked for the compile) is one of the code generators above."""
    return caller in _GENERATORS or caller.endswith(_LIBRARY_GENERATORS) and "site-packages" in caller


def _audit(event: str, args: tuple) -> None:
    if event != "compile":
        return
    scoring = _ACTIVE.get()
    if scoring is None:
        return
    token = _ACTIVE.set(None)  # the check parses with ast, which compiles: not a second check of its own
    try:
        _check(scoring, args, sys._getframe(1).f_code.co_filename)
    finally:
        _ACTIVE.reset(token)


def _check(scoring: _Scoring, args: tuple, caller: str) -> None:
    source, filename = (args + (None, None))[:2]
    if isinstance(filename, (str, bytes)) and os.path.isfile(filename) or _generator(caller):
        return  # a module imported from its file, or a standard type being made, while scoring
    if isinstance(source, ast.AST):
        why = _why_not(source.body[0].value) if isinstance(source, ast.Module) and len(source.body) == 1 and \
            isinstance(source.body[0], ast.Expr) else _why_not(source.body) if isinstance(source, ast.Expression) \
            else "a syntax tree of statements"
    elif isinstance(source, (str, bytes)):
        why = why_not_inert(source)
    else:
        why = f"a source of type {type(source).__name__}"
    if why is not None:
        scoring.refused.append(why)
        raise AnswerIsCode(f"scoring compiled {why}: the answer is code, not data; it is not run")


@contextmanager
def inert_scoring():
    """Within the block every compile from a string must be inert (see the module docstring); yields the record
    of what was refused (`.refused`: empty when nothing was)."""
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        _installed = True
    scoring = _Scoring()
    token = _ACTIVE.set(scoring)
    try:
        yield scoring
    finally:
        _ACTIVE.reset(token)
