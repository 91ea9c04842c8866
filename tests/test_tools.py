"""Tools: YAML specs and their validation errors, the safe calculator, the search tool (mocked HTTP), and the
executor's guarantees (concurrency, per-call timeouts, every malformed call answered, counts, message shape)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest
from skyrl_stepwise.tools import (Tool, ToolConfigError, ToolExecutor, ToolResult, ToolUnavailable, build_tools,
                                  load_tools, load_tools_yaml, parse_tool_specs, to_messages, tool_schemas)
from skyrl_stepwise.tools.base import check_tool_spec
from skyrl_stepwise.tools.builtin import CalculatorError, CalculatorTool, SearchTool, safe_eval

EXAMPLE = Path(__file__).resolve().parents[1] / "conf" / "tools" / "search_calculator.yaml"


def schema(name: str, properties: dict | None = None, required: list | None = None, **extra) -> dict:
    params = {"type": "object", "properties": properties or {}, **extra}
    if required:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": params}}


@dataclass
class SleepConfig:
    delay: float = 0.0


class SleepTool(Tool):
    """Sleeps `delay` seconds (from its typed config), then answers; records how often it ran."""

    config_class = SleepConfig

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or schema("sleep", {"tag": {"type": "string"}}))
        self.delay = float(self.cfg.delay)
        self.runs = 0

    async def call(self, arguments):
        self.runs += 1
        await asyncio.sleep(self.delay)
        return f"{self.name} done {arguments.get('tag', '')}".strip()


class RaisingTool(Tool):
    def __init__(self, error: BaseException, name: str = "boom"):
        super().__init__({}, schema(name))
        self.error = error

    async def call(self, arguments):
        raise self.error


class NotTextTool(Tool):
    async def call(self, arguments):
        return {"not": "text"}


class SyncCallTool(Tool):
    def call(self, arguments):  # noqa: D401 - deliberately not async
        return "x"



class EchoTool:
    """A bare ToolLike (no Tool base, so no load-time schema check) that echoes its arguments as JSON."""

    config_class = None

    def __init__(self, parameters: dict, name: str = "echo"):
        self.name, self.schema = name, {"type": "function", "function": {"name": name, "parameters": parameters}}

    async def call(self, arguments):
        return json.dumps(arguments)


class EchoYamlTool(Tool):
    """EchoTool built from a tools YAML (so its schema went through the load-time checks)."""

    async def call(self, arguments):
        return json.dumps(arguments)

def calc_executor(**kw) -> ToolExecutor:
    return ToolExecutor({"calculator": CalculatorTool()}, **kw)


def write_yaml(tmp_path: Path, data, name: str = "tools.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


# ----------------------------------------------------------------------------------------------- YAML loading

def test_example_yaml_loads_and_builds():
    specs = load_tools_yaml(EXAMPLE)
    assert [s.name for s in specs] == ["search", "calculator"]
    assert [s.class_name for s in specs] == ["search", "calculator"]
    assert specs[0].config["topk"] == 3
    tools = build_tools(specs)
    assert isinstance(tools["search"], SearchTool) and isinstance(tools["calculator"], CalculatorTool)
    assert tool_schemas(tools) == [s.tool_schema for s in specs]
    assert tools["calculator"].schema["function"]["parameters"]["required"] == ["expression"]


def test_dotted_class_name_and_custom_tool(tmp_path):
    data = {"tools": [{"class_name": "test_tools.SleepTool", "config": {"delay": 0},
                       "tool_schema": schema("nap", {"tag": {"type": "string"}})},
                      {"class_name": "skyrl_stepwise.tools.builtin.CalculatorTool",
                       "tool_schema": schema("calc", {"expression": {"type": "string"}}, ["expression"])}]}
    tools = load_tools(write_yaml(tmp_path, data))
    assert sorted(tools) == ["calc", "nap"] and tools["nap"].name == "nap"
    results = asyncio.run(ToolExecutor(tools).execute([ToolCallRequest("nap", {"tag": "t"}),
                                                       ToolCallRequest("calc", {"expression": "6*7"})]))
    assert [r.content for r in results] == ["nap done t", "42"]


def test_parse_tool_specs_accepts_omegaconf():
    from omegaconf import OmegaConf

    specs = parse_tool_specs(OmegaConf.create(yaml.safe_load(EXAMPLE.read_text())), "cfg.tools")
    assert [s.name for s in specs] == ["search", "calculator"] and isinstance(specs[0].tool_schema, dict)


def _base() -> dict:
    return {"tools": [{"class_name": "calculator", "config": {},
                       "tool_schema": schema("calculator", {"expression": {"type": "string"}}, ["expression"])},
                      {"class_name": "search", "config": {"topk": 2},
                       "tool_schema": schema("search", {"query": {"type": "string"}}, ["query"])}]}


def _set(path: str, value):
    """Mutation that sets a dotted path (ints index lists) in the base config; value DELETE removes the key."""
    def mutate(data):
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = data
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
        return data
    return mutate


DELETE = object()
FN = "tools.1.tool_schema.function"


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: [d], ["top-level 'tools' list"]),
    (lambda d: {"tool": d["tools"]}, ["top-level 'tools' list"]),
    (_set("extra", 1), ["unknown top-level key 'extra'"]),
    (_set("tools", []), ["'tools' must be a non-empty list"]),
    (_set("tools.1", "calculator"), ["tools[1]", "must be a mapping"]),
    (_set("tools.1.klass", "x"), ["tools[1]", "unknown key 'klass'"]),
    (_set("tools.1.class_name", DELETE), ["tools[1].class_name"]),
    (_set("tools.1.class_name", " "), ["tools[1].class_name"]),
    (_set("tools.1.config", [1]), ["tools[1].config", "must be a mapping"]),
    (_set("tools.1.tool_schema", DELETE), ["tools[1]", "missing key 'tool_schema'"]),
    (_set("tools.1.tool_schema", "search"), ["tools[1].tool_schema", "must be a mapping"]),
    (_set("tools.1.tool_schema.type", "functions"), ["tools[1].tool_schema.type", "'function'"]),
    (_set("tools.1.tool_schema.kind", "x"), ["tools[1].tool_schema", "unknown key 'kind'"]),
    (_set("tools.1.tool_schema.function", None), ["tools[1].tool_schema.function", "must be a mapping"]),
    (_set(f"{FN}.name", DELETE), ["tools[1].tool_schema.function.name", "None"]),
    (_set(f"{FN}.name", "web search"), ["tools[1].tool_schema.function.name", "'web search'"]),
    (_set(f"{FN}.name", "calculator"), ["tools[1].tool_schema.function.name", "duplicate", "tools[0]"]),
    (_set(f"{FN}.descripton", "typo"), ["tools[1].tool_schema.function", "unknown key 'descripton'"]),
    (_set(f"{FN}.description", 3), ["tools[1].tool_schema.function.description"]),
    (_set(f"{FN}.parameters", "query: str"), ["tools[1].tool_schema.function.parameters", "JSON schema"]),
    (_set(f"{FN}.parameters.type", "array"), ["tools[1].tool_schema.function.parameters.type", "'object'"]),
    (_set(f"{FN}.parameters.properties.query.type", "strng"),
     ["tools[1].tool_schema.function.parameters.properties.query.type", "not a valid JSON schema"]),
    (_set(f"{FN}.parameters.required", "query"),
     ["tools[1].tool_schema.function.parameters.required", "not a valid JSON schema"]),
])
def test_yaml_validation_errors_name_file_index_and_key(tmp_path, mutate, expected):
    path = write_yaml(tmp_path, mutate(copy.deepcopy(_base())), "bad_tools.yaml")
    with pytest.raises(ToolConfigError) as info:
        load_tools_yaml(path)
    message = str(info.value)
    assert str(path) in message
    for part in expected:
        assert part in message, (part, message)


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ToolConfigError, match="cannot read tools file"):
        load_tools_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ToolConfigError, match="invalid YAML"):
        load_tools_yaml(write_yaml(tmp_path, "tools: [\n  - {class_name: x"))
    assert len(load_tools_yaml(write_yaml(tmp_path, copy.deepcopy(_base())))) == 2


@pytest.mark.parametrize("class_name, config, expected", [
    ("calculatr", {}, "neither a builtin tool"),
    ("no_such_pkg.mod.Tool", {}, "cannot import module 'no_such_pkg.mod'"),
    ("skyrl_stepwise.tools.builtin.NoSuchTool", {}, "has no attribute 'NoSuchTool'"),
    ("skyrl_stepwise.tools.builtin.safe_eval", {}, "is not a class"),
    ("test_tools.SyncCallTool", {}, "must be `async def call"),
    ("calculator", {"max_exponant": 5}, "unknown config key 'max_exponant'"),
    ("calculator", {"max_digits": 10**6}, "'max_digits' must be <= 4000"),
    ("search", {"top_k": 5}, "unknown config key 'top_k'"),
    ("search", {"topk": 0}, "'topk' must be >= 1"),
    ("search", {"doc_template": "{idx} {text}"}, "'doc_template' must only use the fields"),
])
def test_build_errors_name_the_tool_and_key(tmp_path, class_name, config, expected):
    data = {"tools": [{"class_name": class_name, "config": config,
                       "tool_schema": schema("t", {"query": {"type": "string"}})}]}
    path = write_yaml(tmp_path, data)
    specs = load_tools_yaml(path)  # the spec itself is fine; the class or its config is not
    with pytest.raises(ToolConfigError) as info:
        build_tools(specs)
    message = str(info.value)
    assert expected in message and str(path) in message and "tools[0]" in message and class_name in message


# ----------------------------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"),
    ("2 ** 10", "1024"), ("-2 ** 2", "-4"), ("+3", "3"), ("--3", "3"), ("0.1 + 0.2", "0.3"), ("2 ** -1", "0.5"),
    ("2 ** 0.5", "1.4142135623731"), ("10 ** 100", "1" + "0" * 100), ("1_000 * 3", "3000"), ("1e3 / 4", "250"),
    ("  (1250 - 380) * 1.07 ", "930.9"), ("7.5 // 2", "3"), ("2 ** 3 ** 2", "512"),
])
def test_calculator_results(expression, expected):
    assert asyncio.run(CalculatorTool().call({"expression": expression})) == expected


@pytest.mark.parametrize("expression, reason", [
    ("x + 1", "names ('x')"),
    ("__import__('os').system('true')", "function calls"),
    ("abs(-3)", "function calls"),
    ("(1).real", "attribute access"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("[1, 2][0]", "subscripts"),
    ("1 < 2", "comparisons"),
    ("1 and 2", "boolean operators"),
    ("1 if 1 else 2", "conditional expressions"),
    ("lambda: 1", "lambdas"),
    ("1 << 3", "the operator LShift"),
    ("~1", "the operator Invert"),
    ("2 ** 101", "exponent 101 is too large"),
    ("9 ** 9 ** 9", "exponent 387420489 is too large"),
    ("(10 ** 100) ** 40", "too large"),
    ("10 ** 99 * 10 ** 99 * 10 ** 99 * 10 ** 99 * 10 ** 99 * 10 ** 99 * 10 ** 99 * 10 ** 99 * 10 ** 99 * 10 ** 99 "
     "* 10 ** 99", "too large"),
    ("1e308 * 10", "too large"),
    ("1e300 ** 2", "too large"),
    ("10.0 ** 100 * 1e300", "too large"),
    ("(-8) ** (1 / 3)", "not a real number"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("", "empty"),
    ("1 +", "not a valid arithmetic expression"),
    ("1; 2", "not a valid arithmetic expression"),
    ("1" * 1001, "too long"),
    ("(" * 300 + "1" + ")" * 300, "not a valid arithmetic expression"),
])
def test_calculator_refusals_are_fast_and_explained(expression, reason):
    t0 = time.perf_counter()
    with pytest.raises(CalculatorError) as info:
        safe_eval(expression)
    assert reason in str(info.value)
    assert time.perf_counter() - t0 < 0.5


def test_calculator_refusal_reaches_the_model_as_tool_error():
    ex = calc_executor()
    [result] = asyncio.run(ex.execute([ToolCallRequest("calculator", {"expression": "__import__('os')"})]))
    assert not result.ok and result.error_kind == "tool_error"
    assert result.content.startswith("Error: tool 'calculator' failed: CalculatorError: not allowed: function calls")
    assert ex.counts == {"calculator/tool_error": 1}


# ----------------------------------------------------------------------------------------------- search tool

def mock_retriever(monkeypatch, handler):
    """Route the retrieval client's httpx traffic to `handler` (no network)."""
    real = httpx.AsyncClient
    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=transport, **kw))


def test_search_tool_formats_docs_like_search_r1(monkeypatch):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), json.loads(request.content)))
        docs = [{"document": {"id": "1", "contents": '"Canberra"\nCanberra is the capital of Australia.'},
                 "score": 3.0},
                {"document": {"id": "2", "contents": '"Sydney"\nSydney is the largest city.'}, "score": 1.0}]
        return httpx.Response(200, json={"result": [docs]})

    mock_retriever(monkeypatch, handler)
    tools = load_tools(EXAMPLE)
    ex = ToolExecutor(tools)

    async def go():
        try:
            return await ex.execute([ToolCallRequest("search", '{"query": "capital of Australia"}'),
                                     ToolCallRequest("search", {})])
        finally:
            await tools["search"].aclose()

    ok, missing = asyncio.run(go())
    assert ok.ok and ok.content == ('Doc 1(Title: "Canberra") Canberra is the capital of Australia.\n'
                                    'Doc 2(Title: "Sydney") Sydney is the largest city.')
    assert seen == [("http://127.0.0.1:8000/retrieve",
                     {"queries": ["capital of Australia"], "topk": 3, "return_scores": True})]
    assert missing.error_kind == "invalid_arguments" and "'query' is a required property" in missing.content
    assert ex.counts == {"search/ok": 1, "search/invalid_arguments": 1}


@pytest.mark.parametrize("response, expected", [
    (httpx.Response(400, text="bad topk"), "Search failed: HTTP 400"),
    (httpx.Response(503, text="overloaded"), "Search failed: retriever at"),
    (httpx.Response(200, json={"nope": 1}), "Search failed: retriever response has no 'result' list"),
])
def test_search_tool_turns_retriever_errors_into_text(monkeypatch, response, expected):
    mock_retriever(monkeypatch, lambda request: response)
    tool = SearchTool({"max_retries": 0, "backoff_s": 0.0, "retriever_down": "observe"})
    text = asyncio.run(tool.call({"query": "q"}))
    assert text.startswith(expected) and tool.failures == 1


async def test_a_dead_retriever_is_retried_with_backoff_then_fails_the_trajectory_not_the_model(monkeypatch):
    """Connection refused on every try: 1 + max_retries tries, spaced by the backoff, then ToolUnavailable leaves
    the executor (the agent loop fails that trajectory only) instead of a 'Search failed' text trained on."""
    times, calls = [], []

    def handler(request):
        times.append(time.perf_counter())
        if len(times) <= 3:  # down for the first call's three tries
            raise httpx.ConnectError("connection refused", request=request)
        calls.append(1)  # then restarting: 503 twice, then up
        if len(calls) < 3:
            return httpx.Response(503, text="restarting")
        return httpx.Response(200, json={"result": [[{"document": {"contents": '"T"\nbody'}}]]})

    mock_retriever(monkeypatch, handler)
    ex = ToolExecutor({"search": SearchTool({"max_retries": 2, "backoff_s": 0.05})})
    with pytest.raises(ToolUnavailable, match="failed after 3 tries: ConnectError"):
        await ex.execute([ToolCallRequest("search", {"query": "q"})])
    assert len(times) == 3 and times[1] - times[0] >= 0.05 and times[2] - times[1] >= 0.1  # exponential backoff
    assert ex.counts["search/unavailable"] == 1
    # a server that comes back within the retries is a plain success
    [ok] = await ex.execute([ToolCallRequest("search", {"query": "q"})])
    assert ok.ok and "body" in ok.content and len(calls) == 3


def test_search_tool_empty_result_and_empty_query(monkeypatch):
    mock_retriever(monkeypatch, lambda request: httpx.Response(200, json={"result": [[]]}))
    tool = SearchTool({"empty_message": "nothing"})
    assert asyncio.run(tool.call({"query": "q"})) == "nothing"
    assert asyncio.run(tool.call({"query": "  "})) == "Search failed: the query is empty."


# ----------------------------------------------------------------------------------------------- executor

async def test_calls_of_a_turn_run_concurrently_in_call_order():
    slow, fast = SleepTool({"delay": 0.6}, schema("slow")), SleepTool({"delay": 0.5}, schema("fast"))
    ex = ToolExecutor({"slow": slow, "fast": fast})
    t0 = time.perf_counter()
    results = await ex.execute([ToolCallRequest("slow", {}), ToolCallRequest("fast", {})])
    elapsed = time.perf_counter() - t0
    assert [r.content for r in results] == ["slow done", "fast done"]
    assert 0.6 <= elapsed < 0.95, elapsed  # ~max(0.6, 0.5), not the sum 1.1
    assert all(r.ok and r.seconds >= 0.5 for r in results)


async def test_each_call_has_its_own_timeout():
    ex = ToolExecutor({"slow": SleepTool({"delay": 5}, schema("slow")), "calculator": CalculatorTool()},
                      timeout_s=0.2)
    t0 = time.perf_counter()
    timed_out, ok = await ex.execute([ToolCallRequest("slow", {}), ToolCallRequest("calculator", {"expression": "1"})])
    assert time.perf_counter() - t0 < 1.5
    assert timed_out.error_kind == "timeout" and not timed_out.ok
    assert timed_out.content == "Error: tool 'slow' timed out after 0.2 s."
    assert ok.ok and ok.content == "1"
    assert ex.counts == {"slow/timeout": 1, "calculator/ok": 1}


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_a_stalled_event_loop_is_not_charged_to_the_tool():
    """A 0.2 s tool under a 1 s timeout, while something blocks the loop for 1.5 s: the tool finished, so its
    result must come back (a wall-clock deadline answered "timed out" and the model was trained on that)."""
    ex = ToolExecutor({"slow": SleepTool({"delay": 0.2}, schema("slow"))}, timeout_s=1.0)
    call = asyncio.create_task(ex.execute([ToolCallRequest("slow", {})]))
    await asyncio.sleep(0.05)
    time.sleep(1.5)  # a blocking call on the loop (e.g. a Ray get)
    (result,) = await call
    assert result.ok and result.content == "slow done", result
    # a tool that really runs past its budget still times out, stalls or not
    ex = ToolExecutor({"slow": SleepTool({"delay": 5}, schema("slow"))}, timeout_s=0.3)
    call = asyncio.create_task(ex.execute([ToolCallRequest("slow", {})]))
    await asyncio.sleep(0.05)
    time.sleep(1.0)
    t0 = time.perf_counter()
    (result,) = await call
    assert result.error_kind == "timeout" and time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("error, expected", [
    (ValueError("boom"), "Error: tool 'boom' failed: ValueError: boom"),
    (KeyError("k"), "Error: tool 'boom' failed: KeyError: 'k'"),
    (RuntimeError(), "Error: tool 'boom' failed: RuntimeError"),
    (TimeoutError("upstream slow"), "Error: tool 'boom' failed: TimeoutError: upstream slow"),  # not OUR timeout
])
async def test_tool_exceptions_become_tool_errors(error, expected):
    ex = ToolExecutor({"boom": RaisingTool(error)})
    [result] = await ex.execute([ToolCallRequest("boom", {})])
    assert (result.ok, result.error_kind, result.content) == (False, "tool_error", expected)


async def test_non_text_result_is_a_tool_error():
    [result] = await ToolExecutor({"d": NotTextTool({}, schema("d"))}).execute([ToolCallRequest("d", {})])
    assert result.error_kind == "tool_error" and "returned dict, not text" in result.content


@pytest.mark.parametrize("error, kind, hint", [
    ("invalid_json", "invalid_json", "not valid JSON"),
    ("unclosed_block", "unclosed_block", "was not closed"),
    ("missing_name", "missing_name", "has no tool name"),
    ("malformed_structure", "malformed_structure", "expected structure"),
    ("ToolCallParseStatus.INVALID_JSON", "invalid_json", "not valid JSON"),
    ("weird_new_status", "weird_new_status", "could not be parsed"),
])
async def test_parser_errors_are_answered_not_raised(error, kind, hint):
    ex = calc_executor()
    [result] = await ex.execute([ToolCallRequest(None, None, '{"name": "calculator", "arguments": {', error)])
    assert not result.ok and result.error_kind == kind and hint in result.content
    assert result.content.startswith(f"Error: tool call not understood ({kind})")
    assert '{"name": "calculator", "arguments": {' in result.content  # the model sees what it wrote
    assert ex.counts == {kind: 1}


async def test_unknown_tool_lists_available_names():
    ex = ToolExecutor({"calculator": CalculatorTool(), "search": SearchTool()})
    plain, flagged, flagged_known = await ex.execute([
        ToolCallRequest("web_search", {"query": "x"}),
        ToolCallRequest("browse", {}, error="unknown_tool"),  # the parser already knew
        ToolCallRequest("calculator", {"expression": "2+2"}, error="unknown_tool"),  # but our tools decide
    ])
    assert plain.error_kind == flagged.error_kind == "unknown_tool"
    assert plain.content == "Error: unknown tool 'web_search'. Available tools: calculator, search."
    assert "'browse'" in flagged.content and "calculator, search" in flagged.content
    assert flagged_known.ok and flagged_known.content == "4"
    assert ex.counts == {"unknown_tool": 2, "calculator/ok": 1}


@pytest.mark.parametrize("arguments, needle", [
    ([1, 2], "arguments must be a JSON object, got list"),
    ("expression=1+1", "arguments are not valid JSON"),
    ('["1+1"]', "arguments must be a JSON object, got list"),
    ({}, "'expression' is a required property"),
    ({"expression": 3}, "field 'expression': 3 is not of type 'string'"),
    ('{"expression": null}', "field 'expression': None is not of type 'string'"),
    ({"expression": "1", "precision": 3}, "'precision' was unexpected"),
])
async def test_invalid_arguments_name_the_problem(arguments, needle):
    tool = CalculatorTool(tool_schema=schema("calculator", {"expression": {"type": "string"}}, ["expression"],
                                             additionalProperties=False))
    ex = ToolExecutor({"calculator": tool})
    [result] = await ex.execute([ToolCallRequest("calculator", arguments)])
    assert not result.ok and result.error_kind == "invalid_arguments"
    assert result.content.startswith("Error: invalid arguments for tool 'calculator': ")
    assert needle in result.content, result.content
    assert ex.counts == {"calculator/invalid_arguments": 1}


async def test_json_string_and_empty_arguments():
    sleep = SleepTool()
    ex = ToolExecutor({"calculator": CalculatorTool(), "sleep": sleep})
    results = await ex.execute([ToolCallRequest("calculator", '{"expression": "3 * (4 + 5)"}'),
                                ToolCallRequest("sleep", None), ToolCallRequest("sleep", "  "),
                                ToolCallRequest("sleep", '{"tag": "x"}')])
    assert [r.content for r in results] == ["27", "sleep done", "sleep done", "sleep done x"]
    assert all(r.ok for r in results) and sleep.runs == 3


async def test_calls_beyond_the_limit_are_refused_not_run():
    sleep = SleepTool()
    ex = ToolExecutor({"sleep": sleep}, max_calls_per_turn=2)
    results = await ex.execute([ToolCallRequest("sleep", {"tag": str(i)}) for i in range(4)]
                               + [ToolCallRequest(None, None, "{", "invalid_json")])
    assert [r.ok for r in results] == [True, True, False, False, False]
    assert [r.error_kind for r in results[2:]] == ["too_many_calls"] * 3
    assert "at most 2 are run per turn, so call #3 (sleep) was not run" in results[2].content
    assert "call #5 (unnamed)" in results[4].content
    assert sleep.runs == 2
    assert ex.counts == {"sleep/ok": 2, "sleep/too_many_calls": 2, "too_many_calls": 1}


async def test_counts_accumulate_and_reset():
    ex = calc_executor()
    turn = [ToolCallRequest("calculator", {"expression": "1+1"}), ToolCallRequest("calculator", {"expression": 1}),
            ToolCallRequest("nope", {}), ToolCallRequest(None, None, "", "missing_name")]
    await ex.execute(turn)
    await ex.execute(turn[:1])
    assert ex.reset_counts() == {"calculator/ok": 2, "calculator/invalid_arguments": 1, "unknown_tool": 1,
                                 "missing_name": 1}
    assert ex.counts == {}
    assert await ex.execute([]) == []


async def test_results_are_truncated_to_max_result_chars():
    ex = calc_executor(max_result_chars=10)
    [result] = await ex.execute([ToolCallRequest("calculator", {"expression": "10 ** 30"})])
    assert result.content == "1000000000\n[truncated: 21 more characters]" and result.ok


def test_executor_rejects_bad_limits():
    with pytest.raises(ValueError, match="timeout_s"):
        calc_executor(timeout_s=0)
    with pytest.raises(ValueError, match="max_calls_per_turn"):
        calc_executor(max_calls_per_turn=0)


async def test_call_ids_match_the_assistant_message_and_to_messages_shape():
    calls = [ToolCallRequest(None, None, "{", "invalid_json"),
             ToolCallRequest("calculator", {"expression": "2*3"}),
             ToolCallRequest("calculator", {"expression": "1/0"}, id="call_abc")]
    ex = calc_executor()
    results = await ex.execute(calls)
    assistant = ParsedTurn("", tool_calls=calls).message()
    assert [r.call_id for r in results[1:]] == [c["id"] for c in assistant["tool_calls"]] == ["call_0", "call_abc"]
    assert results[0].call_id == "invalid_call_0"
    messages = to_messages(results)
    assert messages[1] == {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "6"}
    assert messages[2]["content"] == "Error: tool 'calculator' failed: CalculatorError: division by zero"
    assert all(set(m) == {"role", "tool_call_id", "name", "content"} and m["role"] == "tool" for m in messages)
    assert messages[0]["name"] == "" and messages[0]["content"].startswith("Error: tool call not understood")
    assert isinstance(results[0], ToolResult)
    assert ex.schemas == [CalculatorTool.default_schema]


# ------------------------------------------------------------------------------- no silent inputs (issue 29)

class NoConfigTool(Tool):
    """A custom tool that declares no config_class."""

    async def call(self, arguments):
        return "ok"


def test_custom_tool_config_keys_are_checked_against_its_typed_config(tmp_path):
    """A typo in a custom tool's `config:` fails at load, like a built-in's; a tool without config_class takes
    none (its keys used to be accepted and ignored)."""
    for class_name, config, expected in (("test_tools.SleepTool", {"dealy": 1}, "unknown config key 'dealy'"),
                                         ("test_tools.NoConfigTool", {"retries": 3}, "declares no `config_class`")):
        path = write_yaml(tmp_path, {"tools": [{"class_name": class_name, "config": config,
                                                "tool_schema": schema("t")}]})
        with pytest.raises(ToolConfigError, match=expected) as info:
            check_tool_spec(load_tools_yaml(path)[0])  # what a run checks at start-up, nothing built
        assert str(path) in str(info.value) and "tools[0]" in str(info.value)
        with pytest.raises(ToolConfigError, match=expected):
            build_tools(load_tools_yaml(path))
    assert isinstance(check_tool_spec(load_tools_yaml(write_yaml(tmp_path, {"tools": [
        {"class_name": "test_tools.SleepTool", "config": {"delay": 0.5}, "tool_schema": schema("t")}]}))[0]), type)


def test_a_schema_requiring_an_undeclared_property_is_refused_at_load(tmp_path):
    bad = schema("search", {"query": {"type": "string"}}, required=["querry"], additionalProperties=False)
    path = write_yaml(tmp_path, {"tools": [{"class_name": "search", "tool_schema": bad}]})
    with pytest.raises(ToolConfigError, match=r"tools\[0\].tool_schema.function.parameters.required: \['querry'\] "
                                              r"not among the declared properties \['query'\]"):
        load_tools_yaml(path)



POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}


@pytest.mark.parametrize(("parameters", "expected"), [
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}},
     r"parameters.properties.p.\$ref: '#/\$defs/Missing' does not resolve within the schema"),
    ({"type": "object", "properties": {"p": {"$ref": "https://example.invalid/point.json"}}},
     r"parameters.properties.p.\$ref: 'https://example.invalid/point.json' does not resolve .* nothing is fetched"),
    ({"type": "object", "$defs": {"Q": {"type": "object", "properties": {"a": {}}, "required": ["b"]}},
      "properties": {"q": {"$ref": "#/$defs/Q"}}},
     r"parameters.\$defs.Q.required: \['b'\] not among the declared properties \['a'\]"),
])
def test_a_schema_whose_refs_no_call_can_pass_is_refused_at_load(tmp_path, parameters, expected):
    """A `$ref` the argument check cannot follow would make every call fail on our side: refused at load, named."""
    path = write_yaml(tmp_path, {"tools": [{"class_name": "search", "tool_schema": {
        "type": "function", "function": {"name": "search", "parameters": parameters}}}]})
    with pytest.raises(ToolConfigError, match=r"tools\[0\].tool_schema.function." + expected):
        load_tools_yaml(path)


async def test_pydantic_style_refs_and_optionals_validate_calls():
    """What pydantic emits for a model argument and an Optional: `$defs`/`$ref`, `anyOf [.., null]`, defaults."""
    params = {"$defs": {"Point": {**POINT, "title": "Point"}}, "type": "object", "required": ["p"],
              "properties": {"p": {"$ref": "#/$defs/Point"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                                                       "default": None},
                             "unit": {"enum": ["m", "km"], "default": "m"}}, "additionalProperties": False}
    executor = ToolExecutor({"echo": EchoTool(params)})
    ok, none, bad, extra = await executor.execute([
        ToolCallRequest(name="echo", arguments={"p": {"x": 1, "y": 2.5}, "unit": "km"}),
        ToolCallRequest(name="echo", arguments={"p": {"x": 0, "y": 0}, "note": None}),
        ToolCallRequest(name="echo", arguments={"p": {"x": "a"}, "note": 3}),
        ToolCallRequest(name="echo", arguments={"p": {"x": 1, "y": 1}, "q": 1})])
    assert (ok.ok, none.ok) == (True, True) and ok.content == json.dumps({"p": {"x": 1, "y": 2.5}, "unit": "km"})
    assert bad.error_kind == "invalid_arguments" and "field 'p': 'y' is a required property" in bad.content
    assert "field 'note': 3 is not valid under any of the given schemas" in bad.content
    assert extra.error_kind == "invalid_arguments" and "'q' was unexpected" in extra.content


async def test_a_tool_whose_schema_ref_does_not_resolve_answers_a_tool_error():
    """A ToolLike built without the load-time check: the unresolvable `$ref` is the tool's error, not a crash."""
    executor = ToolExecutor({"echo": EchoTool({"type": "object", "properties": {"p": {"$ref": "#/$defs/Nope"}}})})
    result, = await executor.execute([ToolCallRequest(name="echo", arguments={"p": 1})])
    assert (result.ok, result.error_kind) == (False, "tool_error") and "does not resolve" in result.content
    assert executor.counts["echo/tool_error"] == 1


async def test_nan_and_infinite_numbers_are_refused_not_sent_on():
    """`NaN`, `Infinity` and 1e400 pass Python's JSON reader and a `number` schema, but cannot be sent as JSON (an
    MCP client turns them into null): refused as invalid arguments naming the field, the tool never runs."""
    executor = ToolExecutor({"echo": EchoTool({"type": "object", "properties": {"x": {"type": "number"},
                                                                                "v": {"type": "array"}}})})
    nan, inf, big, ok = await executor.execute([
        ToolCallRequest(name="echo", arguments='{"x": NaN}'),
        ToolCallRequest(name="echo", arguments={"v": [1, {"y": float("-inf")}]}),
        ToolCallRequest(name="echo", arguments='{"x": 1e400}'), ToolCallRequest(name="echo", arguments='{"x": 1e300}')])
    assert [r.error_kind for r in (nan, inf, big)] == ["invalid_arguments"] * 3
    assert "field 'x': NaN and infinite numbers are not JSON" in nan.content and "field 'v.1.y'" in inf.content
    assert ok.ok and ok.content == '{"x": 1e+300}'


async def test_a_schema_is_checked_in_the_draft_its_schema_key_names(tmp_path):
    """`$schema: draft-07` (as zod-to-json-schema writes for TypeScript MCP servers): a tuple `items: [...]` loads and
    checks calls as a tuple; without `$schema` the same schema is 2020-12's and refused at load, naming the key."""
    tuple_schema = {"type": "object", "properties": {"pair": {"type": "array", "items": [
        {"type": "string"}, {"type": "integer"}]}}, "required": ["pair"], "additionalProperties": False}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **tuple_schema}
    tools = build_tools(load_tools_yaml(write_yaml(tmp_path, {"tools": [{"class_name": "test_tools.EchoYamlTool",
                                                                         "tool_schema": schema("echo") | {
        "function": {"name": "echo", "parameters": draft7}}}]})))
    ok, bad = await ToolExecutor(tools).execute([ToolCallRequest(name="echo", arguments={"pair": ["a", 1]}),
                                                 ToolCallRequest(name="echo", arguments={"pair": [1, "a"]})])
    assert ok.ok and bad.error_kind == "invalid_arguments" and "field 'pair.0': 1 is not of type 'string'" in bad.content
    path = write_yaml(tmp_path, {"tools": [{"class_name": "search", "tool_schema": {
        "type": "function", "function": {"name": "search", "parameters": tuple_schema}}}]})
    with pytest.raises(ToolConfigError, match=r"parameters.properties.pair.items: not a valid JSON schema"):
        load_tools_yaml(path)


async def test_arguments_nested_too_deeply_are_invalid_not_a_crash():
    """A degenerate `[[[[...` call (or a parser's dict as deep): the model's error, never a RecursionError."""
    deep_dict: dict = {}
    for _ in range(5000):
        deep_dict = {"a": deep_dict}
    executor = ToolExecutor({"echo": EchoTool({"type": "object"})})
    text, parsed = await executor.execute([
        ToolCallRequest(name="echo", arguments='{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ToolCallRequest(name="echo", arguments=deep_dict)])
    assert text.error_kind == "invalid_arguments" and "nested too deeply to read" in text.content
    assert parsed.error_kind == "invalid_arguments" and "nested too deeply to check" in parsed.content

def test_yaml_syntax_errors_name_line_and_column(tmp_path):
    path = write_yaml(tmp_path, "tools:\n  - class_name: calculator\n    config: {max_digits: 10\n")
    with pytest.raises(ToolConfigError) as info:
        load_tools_yaml(path)
    first = str(info.value).splitlines()[0]
    assert re.match(rf"{re.escape(str(path))}:\d+:\d+: invalid YAML: ", first), first


# ----------------------------------------------------------------------------------------------- blocking tools

class BlockingTool(Tool):
    """The tool a new user writes first: synchronous code inside `async def call` (here `time.sleep`), or a call
    that never returns (waits on `release`, set by the test so no thread outlives it)."""

    def __init__(self, delay: float, name: str = "block"):
        super().__init__({}, schema(name))
        self.delay, self.release = delay, __import__("threading").Event()
        self.spans: list[tuple[float, float, float]] = []  # (delay, start, end) of each call that woke

    async def call(self, arguments):
        if self.delay < 0:
            self.release.wait()  # "forever"
        else:
            delay, start = self.delay, time.perf_counter()
            time.sleep(delay)  # noqa: ASYNC251 - the point of the test
            self.spans.append((delay, start, time.perf_counter()))
        return "woke"


async def test_a_blocking_tool_stalls_nothing_its_timeout_holds_and_it_is_named(caplog):
    """`time.sleep` inside `call` with a 0.5 s timeout: the call times out at ~0.5 s (on the rollout's loop it
    blocked the loop, no timeout fired and every other trajectory waited), the rollout loop keeps ticking, another
    tool's call is answered meanwhile, and the tool is named in a warning and counted as blocked."""
    from skyrl_stepwise.tools.offloop import OffLoopRunner
    runner = OffLoopRunner()
    blocking = BlockingTool(2.0)
    ex = ToolExecutor({"block": blocking, "calculator": CalculatorTool()}, timeout_s=0.5, runner=runner)
    gaps, last = [], time.perf_counter()

    async def ticker():
        nonlocal last
        while True:
            await asyncio.sleep(0.02)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        blocked, other = await asyncio.gather(ex.execute([ToolCallRequest("block", {})]),
                                              ex.execute([ToolCallRequest("calculator", {"expression": "2+2"})]))
    elapsed = time.perf_counter() - t0
    tick.cancel()
    assert elapsed < 1.2, elapsed  # the timeout held (it used to wait the full sleep, then answer "woke")
    assert max(gaps) < 0.3, max(gaps)  # the rollout loop never stalled
    assert blocked[0].error_kind == "timeout" and other[0].content == "4"
    assert ex.counts["block/blocked_loop"] == 1 and ex.counts["block/timeout"] == 1
    assert any("tool 'block' blocked its event loop" in r.getMessage() for r in caplog.records)
    # later calls each get their own thread: three 0.3 s blocking calls sleep together, not one after another (all
    # three had started before the first one woke; a wall-clock bound said the same, and flaked on a loaded box)
    blocking.delay = 0.3
    results = await ex.execute([ToolCallRequest("block", {})] * 3)
    assert [r.content for r in results] == ["woke"] * 3
    spans = [(start, end) for delay, start, end in blocking.spans if delay == 0.3]
    assert len(spans) == 3 and max(start for start, _ in spans) < min(end for _, end in spans), spans


async def test_a_tool_that_never_returns_does_not_hang_the_rollout():
    from skyrl_stepwise.tools.offloop import OffLoopRunner
    forever = BlockingTool(-1)
    ex = ToolExecutor({"block": forever}, timeout_s=0.3, runner=OffLoopRunner())
    try:
        for _ in range(2):  # the second call is not queued behind the first (stuck) one
            t0 = time.perf_counter()
            (result,) = await ex.execute([ToolCallRequest("block", {})])
            assert result.error_kind == "timeout" and time.perf_counter() - t0 < 0.8
    finally:
        forever.release.set()


async def test_idle_tool_loops_cost_no_cpu_and_end_with_their_tool():
    """Envs bind a fresh tool to each trajectory's sandbox (python_tool, HumanEval, repo fixing), so a process meets
    hundreds of tool instances. Each got a loop thread beating 50 times a second for the process's life, and the
    runner kept every tool (and its sandbox) alive: a test worker ended with ~100 such threads at ~11% of a core,
    idle. Now the heartbeat runs only while a call is in flight, and a loop ends when its tool is collected."""
    import gc

    from skyrl_stepwise.tools.offloop import OffLoopRunner

    runner = OffLoopRunner()
    tools = [CalculatorTool() for _ in range(120)]
    executors = [ToolExecutor({"calculator": tool}, timeout_s=5, runner=runner) for tool in tools]
    for ex in executors:
        (result,) = await ex.execute([ToolCallRequest("calculator", {"expression": "2+2"})])
        assert result.content == "4"
    threads = [loop.thread for loop in runner.loops.values()]
    assert len(threads) == 120 and all(t.is_alive() for t in threads)
    before = os.times()
    await asyncio.sleep(1.0)
    after = os.times()
    # 120 loops beating at 50 Hz kept ~27% of a core busy here (60: 14%, 200: 41%); idle ones sleep
    assert (after.user + after.system) - (before.user + before.system) < 0.08

    del tools, executors, ex
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not runner.loops and not any(t.is_alive() for t in threads)


async def test_a_tool_found_blocking_is_forgotten_with_it():
    """The runner knows tools by id; once a blocking tool is gone, a new tool that gets its id must start on a loop
    of its own, not in the dead tool's thread-per-call mode."""
    import gc

    from skyrl_stepwise.tools.offloop import OffLoopRunner

    runner = OffLoopRunner(block_s=0.2)
    blocking = BlockingTool(0.4)
    ex = ToolExecutor({"block": blocking}, timeout_s=5, runner=runner)
    (result,) = await ex.execute([ToolCallRequest("block", {})])
    assert result.content == "woke" and ex.counts["block/blocked_loop"] == 1 and id(blocking) in runner.blocking
    del blocking, ex
    gc.collect()
    assert not runner.blocking and not runner.loops


def test_a_tools_finalizer_never_waits_on_the_runners_lock():
    """A tool can be collected in any thread, e.g. in a new loop's own thread while start() holds the lock and waits
    for that loop to be ready: a finalizer that took the lock hung a test worker there."""
    import threading

    from skyrl_stepwise.tools.offloop import OffLoopRunner, ToolLoop

    runner = OffLoopRunner()
    runner.loops[1] = ToolLoop("gone")
    with runner._lock:
        finalizer = threading.Thread(target=runner._forget, args=(1,))
        finalizer.start()
        finalizer.join(timeout=5)
        assert not finalizer.is_alive() and not runner.loops


async def test_many_short_calls_keep_one_heartbeat():
    """Calls that start and end between two beats must not each start a heartbeat of their own: beats would pile up
    under a steady stream of short calls, each one waking the loop 50 times a second."""
    from skyrl_stepwise.tools.offloop import BEAT_S, OffLoopRunner

    runner = OffLoopRunner()
    tool = CalculatorTool()
    ex = ToolExecutor({"calculator": tool}, timeout_s=5, runner=runner)
    beats = 0
    tool_loop = None
    t0 = time.perf_counter()
    for i in range(200):
        (result,) = await ex.execute([ToolCallRequest("calculator", {"expression": f"{i}+1"})])
        assert result.content == str(i + 1)
        if tool_loop is None:
            tool_loop = runner.loops[id(tool)]
            counted = tool_loop._beat

            def counting_beat():
                nonlocal beats
                beats += 1
                counted()
            tool_loop._beat = counting_beat
    elapsed = time.perf_counter() - t0
    await asyncio.sleep(3 * BEAT_S)
    # one heartbeat chain beats about elapsed / BEAT_S times; a chain per call would beat far more
    assert beats <= elapsed / BEAT_S + 3, (beats, elapsed)
