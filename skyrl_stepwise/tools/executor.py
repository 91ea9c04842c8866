"""Run the tool calls of one assistant turn: concurrently, each with its own timeout, never raising.

A rollout must survive whatever the model writes, so every call gets an answer the model can read: a
malformed call becomes an error message with a kind (the parser's own kind, `unknown_tool`,
`invalid_arguments`, `too_many_calls`, `timeout`, `tool_error`) instead of an exception that would kill the
trajectory. Kinds are also counted per tool (`executor.counts`) so an env can report them as metrics: a
policy that learns to call tools badly shows up as a rising `calculator/invalid_arguments`.

Calls run off the rollout's event loop (tools/offloop.py): a tool that blocks inside `call` (`time.sleep(90)`)
stalls neither the batch nor its own timeout; it is named in a warning and counted as `<tool>/blocked_loop`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from referencing.exceptions import Unresolvable

from skyrl_stepwise.chat.base import Message, ParsedTurn, ToolCallRequest
from skyrl_stepwise.tools.base import FailedCall, ToolLike, ToolUnavailable
from skyrl_stepwise.tools.offloop import RUNNER, OffLoopRunner
from skyrl_stepwise.tools.schema import validator_class

# What the model is told about each parser error kind (ToolCallRequest.error).
PARSE_HINTS = {
    "invalid_json": "the call is not valid JSON",
    "unclosed_block": "the tool call block was not closed",
    "missing_name": "the call has no tool name",
    "malformed_structure": "the call does not have the expected structure",
    "unknown_tool": "the call names a tool that does not exist",
    "missing_arguments": "the call has no arguments part",
    "unparsed_call_marker": "a tool call was opened but could not be read",
}
MAX_SCHEMA_ERRORS = 3  # enough to fix a call, short enough not to flood the context


@dataclass
class ToolResult:
    """The answer to one call, in call order. `ok` False means `content` is an error message for the model and
    `error_kind` says which (a metric name)."""

    call_id: str
    name: str
    content: str
    ok: bool
    error_kind: str | None = None
    seconds: float = 0.0


def error_kind_of(error: str) -> str:
    """A parser's error as a short kind: 'ToolCallParseStatus.INVALID_JSON' and 'invalid_json' both ->
    'invalid_json', so metric names do not depend on how an enum prints."""
    return error.rsplit(".", 1)[-1].strip().lower() or "parse_error"


def call_ids(calls: list[ToolCallRequest]) -> list[str]:
    """The id each result answers: the ids `ParsedTurn.message()` gives the calls, so tool messages match the
    assistant's `tool_calls` (malformed calls included, where a template needs them there)."""
    return ParsedTurn("", tool_calls=list(calls)).call_ids()


def validator(parameters: dict[str, Any]) -> Draft202012Validator:
    """A call's argument checker for a tool's parameters, in the draft its `$schema` names (2020-12 by default)."""
    return validator_class(parameters)(parameters)


def schema_errors(validator: Draft202012Validator, arguments: dict[str, Any]) -> str | None:
    """Readable schema violations naming the field ("field 'expression': 3 is not of type 'string'"), or None.
    A missing required field is named by jsonschema's own message ("'query' is a required property")."""
    errors = sorted(validator.iter_errors(arguments), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    if not errors:
        return None
    parts = []
    for e in errors[:MAX_SCHEMA_ERRORS]:
        path = ".".join(str(p) for p in e.absolute_path)
        parts.append(f"field {path!r}: {e.message}" if path else e.message)
    more = f" (and {len(errors) - MAX_SCHEMA_ERRORS} more)" if len(errors) > MAX_SCHEMA_ERRORS else ""
    return "; ".join(parts) + more


def decode_arguments(arguments: dict | str | None) -> tuple[dict[str, Any] | None, str | None]:
    """(arguments as a dict, None) or (None, why not). JSON strings are decoded (OpenAI sends them that way);
    None and "" mean a call without arguments."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}, None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return None, f"arguments are not valid JSON ({e.msg} at position {e.pos})"
        except RecursionError:  # `[[[[...` thousands deep: Python's reader gives up
            return None, "arguments are nested too deeply to read"
    if not isinstance(arguments, dict):
        return None, f"arguments must be a JSON object, got {type(arguments).__name__}"
    return arguments, None


def non_finite_field(value: Any, path: str = "") -> str | None:
    """The path of the first NaN or infinite number in decoded arguments ("" for the top level), or None. Python's
    JSON reader accepts `NaN`, `Infinity` and overflowing numbers (1e400); a JSON schema's `number` accepts them
    too, but no JSON encoder can send them on (an MCP client sends `null`), so the tool would run on a value the
    model never wrote."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = non_finite_field(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def parse_refusal(call: ToolCallRequest) -> tuple[str, str] | None:
    """(kind, message) for a call the parser could not read: its kind, what that means, the call as written and how
    to write one; None when it was read. `unknown_tool` is not refused here: whether a tool exists is for whoever
    runs it (our tool list, an OpenEnv server's) to say. Shared with envs/openenv.py, so every env answers a broken
    call in the same words."""
    if call.error is None:
        return None
    kind = error_kind_of(call.error)
    if kind == "unknown_tool":
        return None
    hint = PARSE_HINTS.get(kind, "the call could not be parsed")
    raw = f" The call was: {call.raw[:200]!r}." if call.raw else ""
    how = f" Write a tool call as {call.expected_format}." if call.expected_format else ""
    return kind, f"tool call not understood ({kind}): {hint}.{raw}{how}"


def readable_arguments(name: str, raw: dict | str | None) -> tuple[dict[str, Any] | None, str | None]:
    """(arguments, None), or (None, the `invalid_arguments` message) for arguments that are not a JSON object, are
    nested too deeply to read, or hold NaN/infinite numbers. Never `{}` for arguments that could not be read: a
    tool without required arguments would then run, and the model read a success for a broken call. Shared with
    envs/openenv.py."""
    arguments, why = decode_arguments(raw)
    if arguments is None:
        return None, f"invalid arguments for tool {name!r}: {why}."
    try:
        bad = non_finite_field(arguments)
    except RecursionError:  # a parser's dict nested deeper than checking can follow
        return None, f"invalid arguments for tool {name!r}: nested too deeply to check."
    if bad is not None:
        return None, (f"invalid arguments for tool {name!r}: field {bad!r}: NaN and infinite numbers are not JSON; "
                      "write a finite number.")
    return arguments, None


class ToolExecutor:
    """Executes parsed tool calls against named tools; one instance may serve many trajectories at once."""

    def __init__(self, tools: dict[str, ToolLike], timeout_s: float = 30.0, max_calls_per_turn: int = 8,
                 max_result_chars: int | None = None, runner: OffLoopRunner | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"ToolExecutor timeout_s must be > 0, got {timeout_s}")
        if max_calls_per_turn < 1:
            raise ValueError(f"ToolExecutor max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.tools = dict(tools)
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.counts: Counter[str] = Counter()
        self.runner = runner or RUNNER
        # Compiled once: validating the same schema on every call is the hot path of a tool-heavy rollout.
        self._validators = {name: validator(tool.schema["function"].get("parameters", {"type": "object",
                                                                              "properties": {}}))
                            for name, tool in self.tools.items()}

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI schemas, for the renderer's `tools=` argument."""
        return [tool.schema for tool in self.tools.values()]

    def reset_counts(self) -> dict[str, int]:
        """Hand back the counts so far and start again (e.g. once per training step's metrics)."""
        counts, self.counts = dict(self.counts), Counter()
        return counts

    async def execute(self, calls: list[ToolCallRequest]) -> list[ToolResult]:
        """One result per call, in call order; all runnable calls of the turn run concurrently, so a turn takes
        as long as its slowest call (bounded by timeout_s), not the sum."""
        ids = call_ids(calls)
        jobs = [self._one(i, call, ids[i]) for i, call in enumerate(calls)]
        results = list(await asyncio.gather(*jobs))
        for result in results:
            key = result.error_kind or "ok"
            self.counts[f"{result.name}/{key}" if result.name in self.tools else key] += 1
        return results

    async def _one(self, index: int, call: ToolCallRequest, call_id: str) -> ToolResult:
        """Answer one call: refuse it with a readable error, or run it under its own timeout."""
        name = call.name or ""

        def fail(kind: str, message: str) -> ToolResult:
            return ToolResult(call_id, name, f"Error: {message}", ok=False, error_kind=kind)

        if index >= self.max_calls_per_turn:
            return fail("too_many_calls", f"too many tool calls in one turn: at most {self.max_calls_per_turn} "
                                          f"are run per turn, so call #{index + 1} ({name or 'unnamed'}) was not run.")
        refused = parse_refusal(call)
        if refused is not None:
            return fail(*refused)
        tool = self.tools.get(name)
        if tool is None:  # also a call the parser found unknown: the parser's tool list may differ from ours
            return self._unknown(call_id, name)
        arguments, why = readable_arguments(name, call.arguments)
        if arguments is None:
            return fail("invalid_arguments", why)
        try:
            why = schema_errors(self._validators[name], arguments)
        except RecursionError:  # a parser's dict nested deeper than checking can follow
            return fail("invalid_arguments", f"invalid arguments for tool {name!r}: nested too deeply to check.")
        except Unresolvable as e:  # a `$ref` in the tool's own schema (built without the load-time check)
            return fail("tool_error", f"tool {name!r} could not be run: its argument schema has a reference that "
                                      f"does not resolve ({type(e).__name__}: {str(e)[:200]}).")
        if why is not None:
            return fail("invalid_arguments", f"invalid arguments for tool {name!r}: {why}.")
        return await self._run(tool, name, call_id, arguments)

    def _unknown(self, call_id: str, name: str) -> ToolResult:
        """The model called a tool that is not configured: tell it which ones are."""
        available = ", ".join(sorted(self.tools)) or "none"
        return ToolResult(call_id, name, f"Error: unknown tool {name!r}. Available tools: {available}.",
                          ok=False, error_kind="unknown_tool")

    async def _run(self, tool: ToolLike, name: str, call_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run a validated call; its own timeout, its exceptions turned into text (CancelledError still
        propagates, so cancelling a rollout cancels its tools)."""
        t0 = time.perf_counter()
        try:
            content = await run_with_timeout(self.runner.start(tool, name, arguments), self.timeout_s)
        except ToolUnavailable:
            self.counts[f"{name}/unavailable"] += 1
            raise  # the trajectory fails (see ToolUnavailable); the env and agent loop count it
        except ToolTimeout:
            self._count_block(tool, name)
            return ToolResult(call_id, name, f"Error: tool {name!r} timed out after {self.timeout_s:g} s.",
                              ok=False, error_kind="timeout", seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - any tool failure is the model's observation, not a crash
            self._count_block(tool, name)
            return self._tool_error(call_id, name, e, time.perf_counter() - t0)  # its own TimeoutError too
        self._count_block(tool, name)
        seconds = time.perf_counter() - t0
        if isinstance(content, FailedCall):  # the tool's own failure text, shown as written but not a result
            return ToolResult(call_id, name, str(content), ok=False, error_kind="tool_error", seconds=seconds)
        if not isinstance(content, str):
            return ToolResult(call_id, name, f"Error: tool {name!r} returned {type(content).__name__}, not text.",
                              ok=False, error_kind="tool_error", seconds=seconds)
        if self.max_result_chars is not None and len(content) > self.max_result_chars:
            content = (content[:self.max_result_chars]
                       + f"\n[truncated: {len(content) - self.max_result_chars} more characters]")
        return ToolResult(call_id, name, content, ok=True, seconds=seconds)

    def _count_block(self, tool: ToolLike, name: str) -> None:
        """Count `<tool>/blocked_loop` when this call held its tool's loop (half the timeout, at most 1 s), so a
        blocking tool shows in the step's metrics, not only in one warning."""
        if self.runner.check_blocked(tool, name, min(self.runner.block_s, self.timeout_s / 2)) is not None:
            self.counts[f"{name}/blocked_loop"] += 1

    @staticmethod
    def _tool_error(call_id: str, name: str, error: BaseException, seconds: float) -> ToolResult:
        """The tool raised: the model sees the exception type and message (often enough to fix its call)."""
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return ToolResult(call_id, name, f"Error: tool {name!r} failed: {detail[:500]}", ok=False,
                          error_kind="tool_error", seconds=seconds)


class ToolTimeout(Exception):
    """Our timeout expired (a tool's own TimeoutError is a tool error, not this)."""


async def run_with_timeout(awaitable, timeout_s: float, tick_s: float = 0.05):
    """Await a tool call, failing with ToolTimeout once it has had `timeout_s` of the event loop's time.

    A wall-clock deadline would charge the tool for time the loop itself was stalled (a blocking call
    elsewhere: the tool's reply arrived, but the loop could not run it), and a call that had finished would
    be answered "timed out" and trained on. So time is counted in ticks: a gap between two ticks longer than
    two ticks is a stalled loop, and only two ticks of it are charged to the tool.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    used, last = 0.0, loop.time()
    try:
        while True:
            await asyncio.wait({task}, timeout=max(min(tick_s, timeout_s - used), 0.0))
            if task.done():
                return task.result()
            now = loop.time()
            used += min(now - last, 2 * tick_s)
            last = now
            if used >= timeout_s:
                raise ToolTimeout
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def to_messages(results: list[ToolResult]) -> list[Message]:
    """OpenAI `role: tool` messages, one per result in call order, ready to append to the conversation."""
    return [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content} for r in results]


async def run_turn_calls(executor: ToolExecutor, calls: list) -> tuple[list[ToolResult], dict[str, float]]:
    """One turn's tool calls through `executor`, with the step metrics every tool-calling env reports (its
    executor's counts as `tool/<name>`, and `tool_calls`): the envs differ in what a result earns, not in this."""
    results = await executor.execute(calls)
    metrics = {f"tool/{k}": float(v) for k, v in executor.reset_counts().items()}
    metrics["tool_calls"] = float(len(calls))
    return results, metrics
