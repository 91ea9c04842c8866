"""`python(code)`: run the model's Python in a sandbox (skyrl_stepwise/sandbox) and show it what came out.

Bound to a trajectory's sandbox (`PythonTool.bound_to(sandbox)`, what a code env such as envs/humaneval.py
does), every call runs in that sandbox's working directory, so files the model writes persist across its calls
(processes do not: each call's PID namespace ends with it). Built from a tools YAML for the generic `tool` env
(class_name "python"), the tool is shared by every episode, so each call gets a fresh sandbox of its own, closed
after the call. Either way the code never runs on the host: the tool checks at construction that a sandbox can
start (SandboxUnavailable, naming why, at start-up) and a sandbox failing later ends the trajectory as an
infrastructure failure (ToolUnavailable), never as a result the model would learn from.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from skyrl_stepwise.sandbox import Limits, RunResult, Sandbox, SandboxMetrics, SandboxUnavailable, StopReason
from skyrl_stepwise.sandbox.backends import check_backend_available, open_sandbox
from skyrl_stepwise.tools.base import Tool, ToolUnavailable
from skyrl_stepwise.tools.config import ToolConfigError


def check_sandbox_available() -> str:
    """The configured backend's start-up check (environment.sandbox.backend): SandboxUnavailable, naming why."""
    return check_backend_available()


@dataclass
class PythonToolConfig:
    """Limits of one call (see sandbox.Limits) and how much of the output the model reads."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 64
    output_bytes: int = 8192  # stdout + stderr shown to the model; past it the run is stopped and says so
    network: bool = False  # True only for a task that needs it (the sandbox otherwise has no network at all)

    def __post_init__(self) -> None:
        """Refuse limits that would disable the sandbox's bounds, naming the key."""
        for key in ("wall_s", "cpu_s", "memory_mb", "processes", "output_bytes"):
            if getattr(self, key) <= 0:
                raise ToolConfigError(f"python tool config {key!r} must be > 0, got {getattr(self, key)!r}")

    def limits(self) -> Limits:
        """The sandbox limits of one call."""
        return Limits(wall_s=self.wall_s, cpu_s=self.cpu_s, memory_bytes=self.memory_mb << 20,
                      processes=self.processes, output_bytes=self.output_bytes)


def format_run(result: RunResult) -> str:
    """What the model reads: stdout, stderr (labelled), and a last line when the run did not exit 0, naming why it
    stopped. Exactly what the sandbox returned, nothing added but the labels."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.stop_reason is not StopReason.EXITED:
        parts.append(f"[{result.describe()}]")
    elif result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


class PythonTool(Tool):
    """`python(code)`: the code runs as `python3 -` in the sandbox's /work; the reply is its output."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python 3 code in a sandbox (no network) and return what it prints (stdout and "
                           "stderr). Files written in the current directory persist between calls.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "a complete Python program"}},
                "required": ["code"],
            },
        },
    }
    config_class = PythonToolConfig

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None,
                 sandbox: Sandbox | None = None, metrics: SandboxMetrics | None = None) -> None:
        super().__init__(config, tool_schema)
        check_sandbox_available()  # refuse at start-up, with the reason, instead of ever running unsandboxed
        self.sandbox = sandbox
        self.metrics = metrics if metrics is not None else (sandbox.metrics if sandbox else SandboxMetrics())

    def bound_to(self, sandbox: Sandbox) -> PythonTool:
        """The same tool (config, schema) running every call in one trajectory's sandbox."""
        return PythonTool(self.config, self.schema, sandbox=sandbox, metrics=sandbox.metrics)

    async def call(self, arguments: dict[str, Any]) -> str:
        """Run `arguments["code"]` off the event loop and return its output as the model reads it."""
        code = arguments.get("code", "")
        if not isinstance(code, str) or not code.strip():
            raise ValueError("the code is empty: pass a Python program as `code`")
        try:
            result = await asyncio.to_thread(self._run, code)
        except SandboxUnavailable as e:
            raise ToolUnavailable(f"python: the sandbox failed: {e}") from e
        return format_run(result)

    def _run(self, code: str) -> RunResult:
        """One call in the bound sandbox, or in a fresh one closed right after (an unbound, shared tool)."""
        limits = self.cfg.limits()
        if self.sandbox is not None:
            return self.sandbox.run("python3 -", stdin=code, limits=limits)
        with open_sandbox(limits=limits, network=self.cfg.network, metrics=self.metrics) as sandbox:
            return sandbox.run("python3 -", stdin=code)
