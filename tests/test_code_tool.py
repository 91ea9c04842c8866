"""The `python` tool (tools/code.py): the model's code runs in the sandbox, the reply is exactly its output with
a named stop reason, a sandbox failure ends the trajectory (ToolUnavailable), and no sandbox means no tool."""

from __future__ import annotations

import pytest
import yaml

from sandbox_helpers import require_sandbox
from skyrl_stepwise.chat.base import ToolCallRequest
from skyrl_stepwise.sandbox import BwrapSandbox, SandboxUnavailable
from skyrl_stepwise.tools import ToolExecutor, build_tools
from skyrl_stepwise.tools import code as code_module
from skyrl_stepwise.tools.base import ToolUnavailable
from skyrl_stepwise.tools.code import PythonTool
from skyrl_stepwise.tools.config import ToolConfigError, load_tools_yaml

require_sandbox()


def _python_call(code: str) -> ToolCallRequest:
    return ToolCallRequest(name="python", arguments={"code": code}, id="c1")


async def test_runs_code_and_shows_exactly_its_output():
    tool = PythonTool()
    assert await tool.call({"code": "print(6 * 7)"}) == "42"
    failed = await tool.call({"code": "import sys\nprint('out')\nraise ValueError('bad input')"})
    assert failed.startswith("out\n[stderr]\nTraceback") and "ValueError: bad input" in failed
    assert failed.endswith("[exit code 1]")
    assert await tool.call({"code": "pass"}) == "[no output]"
    with pytest.raises(ValueError, match="empty"):
        await tool.call({"code": "  "})


async def test_a_runaway_call_is_stopped_and_says_why():
    tool = PythonTool({"wall_s": 1.0, "output_bytes": 100})
    slept = await tool.call({"code": "import time\ntime.sleep(100)"})
    assert slept.startswith("[stopped: timeout")
    assert tool.metrics.stops == {"timeout": 1}
    # the output cap, with a wall clock a loaded box's interpreter start-up cannot reach first (it did at 1 s)
    chatty = PythonTool({"wall_s": 60.0, "output_bytes": 100})
    printed = await chatty.call({"code": "while True: print('x' * 50)"})
    assert "[output truncated at 100 bytes; the run was stopped]" in printed and "[stopped: output_limit" in printed
    assert chatty.metrics.stops == {"output_limit": 1}


async def test_bound_to_a_trajectory_files_persist_between_calls_unbound_they_do_not():
    shared = PythonTool()
    with BwrapSandbox() as sandbox:
        bound = shared.bound_to(sandbox)
        await bound.call({"code": "open('notes.txt', 'w').write('kept')"})
        assert await bound.call({"code": "print(open('notes.txt').read())"}) == "kept"
        assert sandbox.read_file("notes.txt") == "kept"
    await shared.call({"code": "open('notes.txt', 'w').write('gone')"})
    assert "FileNotFoundError" in await shared.call({"code": "print(open('notes.txt').read())"})


async def test_built_from_a_tools_yaml_and_run_by_the_executor(tmp_path):
    path = tmp_path / "tools.yaml"
    spec = {"class_name": "python", "config": {"wall_s": 5}, "tool_schema": PythonTool.default_schema}
    path.write_text(yaml.safe_dump({"tools": [spec]}))
    tools = build_tools(load_tools_yaml(path))
    assert tools["python"].cfg.wall_s == 5
    executor = ToolExecutor(tools, timeout_s=30)
    [result] = await executor.execute([_python_call("print(sum(range(10)))")])
    assert (result.ok, result.content) == (True, "45")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tools": [{**spec, "config": {"wall_s": 0}}]}))
    with pytest.raises(ToolConfigError, match="wall_s"):
        build_tools(load_tools_yaml(bad))


async def test_a_failing_sandbox_ends_the_trajectory_not_a_tool_result(monkeypatch):
    with BwrapSandbox() as sandbox:
        tool = PythonTool().bound_to(sandbox)

        def broken(*args, **kwargs):
            raise SandboxUnavailable("bwrap could not start the sandbox: 'uid map'")

        monkeypatch.setattr(sandbox, "run", broken)
        executor = ToolExecutor({"python": tool}, timeout_s=30)
        with pytest.raises(ToolUnavailable, match="sandbox failed"):
            await executor.execute([_python_call("print(1)")])


def test_no_sandbox_no_tool(monkeypatch):
    def unavailable():
        raise SandboxUnavailable("user namespaces are disabled")

    monkeypatch.setattr(code_module, "check_sandbox_available", unavailable)
    with pytest.raises(SandboxUnavailable, match="user namespaces"):
        PythonTool()
