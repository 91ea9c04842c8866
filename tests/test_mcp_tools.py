"""MCP tool servers as tools: a real stdio server written with the `mcp` SDK, listed at load, called through the
SDK's client; server errors and timeouts answer the call as tool errors, a dead server fails the trajectory."""

from __future__ import annotations

import sys
import textwrap

import pytest
import yaml
from test_generator import canonical

from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.envs.base import EnvRegistry
from skyrl_stepwise.envs.tool import ToolEnvConfig, register_tool_env
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.tools import ToolExecutor, load_tools
from skyrl_stepwise.tools.base import ToolUnavailable, close_tools
from skyrl_stepwise.tools.config import ToolConfigError

SERVER = textwrap.dedent('''
    import os, time
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("tiny")

    @app.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @app.tool()
    def fail(msg: str) -> str:
        """Always raises."""
        raise ValueError(msg)

    @app.tool()
    def slow(seconds: float) -> str:
        """Sleeps, then answers."""
        time.sleep(seconds)
        return "done"

    @app.tool()
    def die() -> str:
        """Kills the server."""
        os._exit(3)

    if __name__ == "__main__":
        app.run()
''')


# A server that lists tools no call could satisfy (the SDK's decorator would never build these schemas, so the
# low-level server lists them as written): a `required` argument it does not declare, and a dotted name.
ODD_SERVER = textwrap.dedent('''
    import anyio
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    TOOLS = [
        types.Tool(name="echo", description="Echo.", input_schema={
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
        types.Tool(name="web.search", description="A dotted name.", input_schema={"type": "object"}),
        types.Tool(name="typo", description="Requires what it does not declare.", input_schema={
            "type": "object", "properties": {"query": {"type": "string"}}, "required": ["querry"],
            "additionalProperties": False}),
    ]

    async def list_tools(ctx, params):
        return types.ListToolsResult(tools=TOOLS)

    async def call_tool(ctx, params):
        return types.CallToolResult(content=[types.TextContent(type="text", text=params.arguments["text"])])

    async def main():
        server = Server("odd", on_list_tools=list_tools, on_call_tool=call_tool)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)
''')


# A server that initializes but never answers tools/list: plain JSON-RPC over stdio (no SDK import, so it starts in
# a fraction of the time the test waits for the listing).
HANGING_LIST_SERVER = textwrap.dedent('''
    import json, sys

    for line in sys.stdin:
        message = json.loads(line)
        if message.get("method") == "initialize":
            result = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                      "serverInfo": {"name": "hangs", "version": "0"}}
            print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
        elif "id" in message and message.get("method") != "tools/list":  # e.g. server/discover: not supported
            error = {"code": -32601, "message": "Method not found"}
            print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "error": error}), flush=True)
''')

# Results of every shape the protocol allows, and an input schema as pydantic writes it for a model argument.
SHAPES_SERVER = textwrap.dedent('''
    import anyio
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    POINT = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                 "required": ["x", "y"], "title": "Point"}},
             "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"},
                                              "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
             "required": ["p"], "additionalProperties": False}
    TEXT = lambda text: types.TextContent(type="text", text=text)
    RESULTS = {
        "multi": types.CallToolResult(content=[TEXT("one"), TEXT("two")]),
        "image": types.CallToolResult(content=[TEXT("a cat"), types.ImageContent(type="image", data="aGk=",
                                                                                  mime_type="image/png")]),
        "resource": types.CallToolResult(content=[types.EmbeddedResource(type="resource", resource=
                                                  types.TextResourceContents(uri="file:///r.txt", text="inside"))]),
        "link": types.CallToolResult(content=[types.ResourceLink(type="resource_link", uri="file:///a.txt",
                                                                 name="a.txt")]),
        "silent_error": types.CallToolResult(content=[], is_error=True),
        "structured": types.CallToolResult(content=[], structured_content={"a": 2}),
    }

    async def list_tools(ctx, params):
        return types.ListToolsResult(tools=[types.Tool(name="point", input_schema=POINT)] + [
            types.Tool(name=name, input_schema={"type": "object"}) for name in RESULTS])

    async def call_tool(ctx, params):
        return RESULTS.get(params.name) or types.CallToolResult(content=[TEXT(repr(params.arguments))])

    async def main():
        server = Server("shapes", on_list_tools=list_tools, on_call_tool=call_tool)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)
''')

@pytest.fixture(scope="module")
def server_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "tiny_server.py"
    path.write_text(SERVER)
    return path


def _tools_file(tmp_path, *entries) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": list(entries)}))
    return str(path)


def _server(server_path, **extra) -> dict:
    return {"mcp_server": {"command": [sys.executable, str(server_path)], **extra}}


def _call(name: str, **arguments) -> ToolCallRequest:
    return ToolCallRequest(name=name, arguments=arguments)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_listed_tools_are_called_and_server_errors_are_tool_errors(server_path, tmp_path, caplog):
    tools = load_tools(_tools_file(tmp_path, _server(server_path, tools=["add", "fail", "slow"])))
    try:
        assert sorted(tools) == ["add", "fail", "slow"]
        assert tools["add"].schema["function"]["parameters"]["required"] == ["a", "b"]
        assert tools["add"].schema["function"]["description"] == "Add two integers."
        assert (await ToolExecutor(tools, timeout_s=60).execute([_call("add", a=0, b=0)]))[0].content == "0"  # connect
        executor = ToolExecutor(tools, timeout_s=60)
        add, fail, bad = await executor.execute([_call("add", a=2, b=3), _call("fail", msg="boom"),
                                                 _call("add", a="x", b=1)])
        slow, = await ToolExecutor(tools, timeout_s=0.5).execute([_call("slow", seconds=3)])
        assert (add.ok, add.content) == (True, "5")
        assert not fail.ok and fail.error_kind == "tool_error" and "fail" in fail.content  # never a result
        # mcp 2.x withholds a plain exception's text ("boom"): the console says so, once, naming ToolError
        assert "boom" not in fail.content
        assert any("withhold" in r.getMessage() and "ToolError" in r.getMessage() for r in caplog.records)
        assert not slow.ok and slow.error_kind == "timeout"
        assert not bad.ok and bad.error_kind == "invalid_arguments"  # our schema check, before the server
        again = await ToolExecutor(tools, timeout_s=60).execute([_call("add", a=1, b=1)])
        assert again[0].content == "2"  # the session survives an error and a timeout
    finally:
        await close_tools(tools)


@pytest.mark.integration  # two more server start-ups (a few seconds each on a loaded machine)
async def test_a_dead_server_raises_and_the_next_call_reconnects(server_path, tmp_path):
    tools = load_tools(_tools_file(tmp_path, _server(server_path, tools=["add", "die"])))
    try:
        executor = ToolExecutor(tools, timeout_s=10.0)
        with pytest.raises(ToolUnavailable, match="closed the connection"):
            await executor.execute([_call("die")])
        assert (await executor.execute([_call("add", a=20, b=22)]))[0].content == "42"
    finally:
        await close_tools(tools)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a quiet 2-core box)
def test_start_up_errors_name_the_file_and_entry(server_path, tmp_path):
    clash = {"class_name": "calculator", "tool_schema": {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}}
    with pytest.raises(ToolConfigError, match=r"tools\[1\]\.mcp_server: tool name 'add' clashes with tools\[0\]"):
        load_tools(_tools_file(tmp_path, clash, _server(server_path, tools=["add"])))
    assert sorted(load_tools(_tools_file(tmp_path, clash, _server(server_path, tools=["add"], prefix="mcp_")))) \
        == ["add", "mcp_add"]
    with pytest.raises(ToolConfigError, match=r"mcp_server.tools: \['nope'\] not listed.*'add'"):
        load_tools(_tools_file(tmp_path, _server(server_path, tools=["nope"])))
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.mcp_server: cannot list the tools of MCP server"):
        load_tools(_tools_file(tmp_path, {"mcp_server": {"command": [sys.executable, "-c", "pass"],
                                                         "connect_timeout_s": 10}}))
    with pytest.raises(ToolConfigError, match=r"mcp_server: unknown config key 'comand'"):
        load_tools(_tools_file(tmp_path, {"mcp_server": {"comand": ["x"]}}))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_tools_whose_schema_no_call_can_satisfy_are_refused_by_name(tmp_path):
    """A listed tool we cannot offer is refused at load, naming the file, entry, tool and reason; listing all of a
    server's tools names every such tool and the usable ones to put in `mcp_server.tools`; selecting those loads."""
    path = tmp_path / "odd_server.py"
    path.write_text(ODD_SERVER)
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.mcp_server tool 'typo' .*required: \['querry'\] not among "
                                              r"the declared properties \['query'\]"):
        load_tools(_tools_file(tmp_path, _server(path, tools=["typo"])))
    with pytest.raises(ToolConfigError, match=r"tool 'web\.search' .*function\.name: must be 1-64 characters"):
        load_tools(_tools_file(tmp_path, _server(path, tools=["web.search"])))
    with pytest.raises(ToolConfigError) as every:
        load_tools(_tools_file(tmp_path, _server(path)))
    assert "'web.search'" in str(every.value) and "'typo'" in str(every.value)
    assert "2 tool(s) whose schema no call could satisfy" in str(every.value)
    assert "tools[0].mcp_server.tools (usable: ['echo'])" in str(every.value)
    tools = load_tools(_tools_file(tmp_path, _server(path, tools=["echo"])))
    try:
        result, = await ToolExecutor(tools, timeout_s=60).execute([_call("echo", text="hi")])
        assert result.ok and result.content == "hi"
    finally:
        await close_tools(tools)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_a_trajectory_whose_server_dies_is_dropped_and_counted(server_path, tmp_path, tokenizer):
    eos = tokenizer.eos_token_id
    die = canonical(tokenizer, '<tool_call>{"name": "die", "arguments": {}}</tool_call>') + [eos]
    answer = canonical(tokenizer, "<answer> x </answer>") + [eos]
    engine = ScriptedEngine(lambda p, s, i: die if "Stop" in tokenizer.decode(p) else answer, tokenizer)
    registry = EnvRegistry()
    register_tool_env(registry, ToolEnvConfig(tools_path=_tools_file(tmp_path, _server(server_path, tools=["die"]))))
    cfg = GeneratorConfig(max_turns=3, max_input_length=4096, show_progress=False, merge_stepwise_output=True,
                          sampling=GeneratorSamplingConfig(max_generate_length=64))
    extras = {"reward_spec": {"ground_truth": {"target": ["x"]}}}
    out = await StepwiseGenerator(tokenizer, engine, registry, cfg).generate(
        [[{"role": "user", "content": "Stop the server."}], [{"role": "user", "content": "Answer x."}]],
        ["tool", "tool"], [extras, extras], [TrajectoryID("q", 0), TrajectoryID("r", 0)])
    assert out.rollout_metrics["generate/failed_trajectories"] == 1
    assert out.trajectory_rewards() == [1.0]  # only the healthy trajectory is trained; none scored 0 for the crash


@pytest.mark.integration  # slow for the fast suite (> 2 s on a quiet 2-core box)
def test_a_server_that_never_lists_its_tools_fails_the_start_up_in_time(tmp_path):
    """Connected, but no tools/list answer: the start-up fails within connect_timeout_s, naming why, not hangs."""
    path = tmp_path / "hanging_server.py"
    path.write_text(HANGING_LIST_SERVER)
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.mcp_server: cannot list the tools of MCP server .*"
                                              r"no answer to tools/list within connect_timeout_s=4 s"):
        # 4 s: the server's own start (python + mcp's import) must fit in it on a loaded 2-core box, so the
        # timeout that fires is the tools/list one under test, not the connection's
        load_tools(_tools_file(tmp_path, _server(path, connect_timeout_s=4)))


def test_a_server_that_never_answers_the_handshake_fails_the_start_up_in_time(tmp_path):
    """A started process that never answers `initialize`: unreachable after connect_timeout_s, said so, not hung."""
    path = tmp_path / "mute_server.py"
    path.write_text("import sys\nfor line in sys.stdin:\n    pass\n")
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.mcp_server: cannot list the tools of MCP server .* is "
                                              r"unreachable: no connection within connect_timeout_s=0\.5 s"):
        load_tools(_tools_file(tmp_path, _server(path, connect_timeout_s=0.5)))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_results_of_every_shape_and_a_model_argument(tmp_path):
    """Several blocks are joined; an embedded text resource shows its text; what the model cannot see is named; an
    error without a message still reads as an error; a `$defs`/`$ref` schema loads and checks calls."""
    path = tmp_path / "shapes_server.py"
    path.write_text(SHAPES_SERVER)
    tools = load_tools(_tools_file(tmp_path, _server(path)))
    try:
        results = await ToolExecutor(tools, timeout_s=60).execute(
            [_call(name) for name in ("multi", "image", "resource", "link", "silent_error", "structured")]
            + [_call("point", p={"x": 1, "y": 2}, note=None), _call("point", p={"x": 1})])
        assert [(r.ok, r.content) for r in results[:4]] == [
            (True, "one\ntwo"), (True, "a cat\n[image content]"), (True, "inside"),
            (True, "[resource_link content: file:///a.txt]")]
        silent = results[4]
        assert (silent.ok, silent.error_kind) == (False, "tool_error")
        assert silent.content == "Error: tool 'silent_error' failed: (the server gave no message)"
        assert (results[5].ok, results[5].content) == (True, '{"a": 2}')
        assert (results[6].ok, results[6].content) == (True, "{'p': {'x': 1, 'y': 2}, 'note': None}")
        assert results[7].error_kind == "invalid_arguments" and "field 'p': 'y' is a required property" in results[7].content
    finally:
        await close_tools(tools)


def test_python_in_a_server_command_is_the_runs_own_interpreter():
    from skyrl_stepwise.tools.mcp import server_command

    assert server_command(["python", "s.py"]) == [sys.executable, "s.py"]
    assert server_command(["python3.11", "-u", "s.py"]) == [sys.executable, "-u", "s.py"]
    assert server_command(["/opt/other/bin/python", "s.py"]) == ["/opt/other/bin/python", "s.py"]  # as written
    assert server_command(["node", "server.js"]) == ["node", "server.js"]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_the_readme_example_server_runs_as_written_and_its_tool_errors_reach_the_model(monkeypatch):
    """examples/mcp_server: the tools YAML says `python` (the host's python may lack mcp) and the server is written
    for mcp 2.x (MCPServer); a ToolError's own message is what the model reads."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)  # the YAML's paths are relative to the repo root, as the README runs it
    tools = load_tools(repo / "examples" / "mcp_server" / "tools.yaml")
    try:
        assert sorted(tools) == ["convert"]
        ok, refused = await ToolExecutor(tools, timeout_s=60).execute([
            _call("convert", value=10, unit_from="km", unit_to="mi"),
            _call("convert", value=1, unit_from="km", unit_to="lb")])
        assert (ok.ok, ok.content) == (True, "6.214 mi")
        assert not refused.ok and refused.error_kind == "tool_error"
        assert "cannot convert km to lb; known: km->mi" in refused.content  # the server's own words
    finally:
        await close_tools(tools)
