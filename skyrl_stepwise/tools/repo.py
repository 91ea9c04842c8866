"""`bash`, `edit` and `view`: the tools of a repo-fixing agent (envs/repo_fix.py), each bound to one trajectory's
sandbox (skyrl_stepwise/sandbox), so a command runs there and a file path means a file of its working directory.

- `bash(command)` runs a shell command in the sandbox (the sandbox's limits: wall/CPU time, memory, processes,
  output); the model reads stdout, stderr and, when the run did not exit 0, why it stopped. A command matching one
  of the config's `forbidden` patterns is never run: the model reads which rule refused it.
- `edit(path, old, new)` replaces the one exact occurrence of `old` in a working-dir file. A path outside the
  working dir (absolute, `..`, a symlink pointing out) is refused with a clear tool error, never read or written.
- `view(path)` shows a working-dir file with line numbers (same confinement).

The schemas here are what conf/tools/repo_fix.yaml lists, so SFT prompts (which render the run's tools YAML) equal
the prompts the env renders in RL; tests/test_repo_fix.py checks the two agree.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from skyrl_stepwise.sandbox import Limits, Sandbox, SandboxPathError, SandboxUnavailable
from skyrl_stepwise.tools.base import FailedCall, Tool, ToolUnavailable
from skyrl_stepwise.tools.code import check_sandbox_available, format_run
from skyrl_stepwise.tools.config import ToolConfigError

# Commands a repo-fixing episode has no use for: the sandbox has no network, so these can only waste a turn (or,
# for `pip`, try to fetch); refusing them says so instead of a confusing network error.
DEFAULT_FORBIDDEN = (r"\bpip3?\s+install\b", r"\b(curl|wget|ssh|scp|nc|ncat)\b")


@dataclass
class BashToolConfig:
    """Limits of one command and the patterns (Python regexes, searched in the command) the policy forbids."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 64
    output_bytes: int = 4096  # stdout + stderr shown; past it the run is stopped and the reply says it was cut
    forbidden: list[str] = field(default_factory=lambda: list(DEFAULT_FORBIDDEN))

    def __post_init__(self) -> None:
        """Refuse limits that would disable the sandbox's bounds, and patterns that do not compile, naming them."""
        for key in ("wall_s", "cpu_s", "memory_mb", "processes", "output_bytes"):
            if getattr(self, key) <= 0:
                raise ToolConfigError(f"bash tool config {key!r} must be > 0, got {getattr(self, key)!r}")
        for pattern in self.forbidden:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ToolConfigError(f"bash tool config 'forbidden': {pattern!r} is not a regex ({e})") from None

    def limits(self) -> Limits:
        """The sandbox limits of one command."""
        return Limits(wall_s=self.wall_s, cpu_s=self.cpu_s, memory_bytes=self.memory_mb << 20,
                      processes=self.processes, output_bytes=self.output_bytes)


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


class _BoundTool(Tool):
    """A tool that needs one trajectory's sandbox: built unbound from YAML (its schema is what SFT renders), then
    `bound_to(sandbox)` by the env for each episode. An unbound call is refused: there is no working dir to use."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None,
                 sandbox: Sandbox | None = None) -> None:
        super().__init__(config, tool_schema)
        check_sandbox_available()  # refuse at start-up, with the reason, instead of ever running unsandboxed
        self.sandbox = sandbox

    def bound_to(self, sandbox: Sandbox):
        """The same tool (config, schema) acting on one trajectory's sandbox."""
        return type(self)(self.config, self.schema, sandbox=sandbox)

    def _sandbox(self) -> Sandbox:
        if self.sandbox is None:
            raise ToolUnavailable(f"{self.name}: not bound to a trajectory's sandbox (use env_class repo_fix)")
        return self.sandbox


class BashTool(_BoundTool):
    """`bash(command)`: one shell command in the trajectory's sandbox, cwd its working directory."""

    default_schema = _function(
        "bash", "Run a shell command in the repository's working directory (no network) and return its output, "
                "e.g. `python3 test_strings.py` or `cat pkg/strings.py`.",
        {"command": {"type": "string", "description": "the shell command"}})
    config_class = BashToolConfig

    def refusal(self, command: str) -> str | None:
        """Why the policy refuses `command`, or None when it may run."""
        for pattern in self.cfg.forbidden:
            if re.search(pattern, command):
                return (f"refused: this command matches the forbidden pattern {pattern!r} (the sandbox has no "
                        "network and nothing may be installed); fix the code with the files already here")
        return None

    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the command off the event loop; a forbidden one is answered, never run."""
        command = arguments.get("command", "")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("the command is empty: pass a shell command as `command`")
        refused = self.refusal(command)
        if refused is not None:
            return FailedCall(refused)
        sandbox = self._sandbox()
        try:
            result = await asyncio.to_thread(sandbox.run, command, None, self.cfg.limits())
        except SandboxUnavailable as e:
            raise ToolUnavailable(f"bash: the sandbox failed: {e}") from e
        text = format_run(result)
        if result.truncated:
            text += f"\n[output truncated at {self.cfg.output_bytes} bytes]"
        return text


class EditTool(_BoundTool):
    """`edit(path, old, new)`: replace the single exact occurrence of `old` in a working-dir file."""

    default_schema = _function(
        "edit", "Replace an exact piece of text in a file of the working directory. `old` must occur exactly once "
                "in the file (copy it with its indentation); it is replaced by `new`.",
        {"path": {"type": "string", "description": "file path relative to the working directory"},
         "old": {"type": "string", "description": "the exact text to replace"},
         "new": {"type": "string", "description": "the replacement text"}})

    async def call(self, arguments: dict[str, Any]) -> str:
        """Read, check the occurrence count, write back; a path outside the working dir is a tool error."""
        path, old, new = arguments.get("path", ""), arguments.get("old", ""), arguments.get("new", "")
        if not old:
            return FailedCall("edit: `old` is empty: give the exact text to replace")
        sandbox = self._sandbox()
        try:
            text = await asyncio.to_thread(sandbox.read_file, path, 1 << 20)
            count = text.count(old)
            if count != 1:
                where = "does not occur" if count == 0 else f"occurs {count} times"
                return FailedCall(f"edit: the text to replace {where} in {path}; `old` must match exactly once")
            await asyncio.to_thread(sandbox.write_file, path, text.replace(old, new, 1))
        except SandboxPathError as e:
            return FailedCall(f"edit: {e}")
        line = text[:text.index(old)].count("\n") + 1
        return f"edited {path} at line {line}"


class ViewTool(_BoundTool):
    """`view(path)`: a working-dir file with line numbers."""

    default_schema = _function(
        "view", "Show a file of the working directory with line numbers.",
        {"path": {"type": "string", "description": "file path relative to the working directory"}})

    async def call(self, arguments: dict[str, Any]) -> str:
        """The file's lines, numbered; a path outside the working dir is a tool error."""
        path = arguments.get("path", "")
        try:
            text = await asyncio.to_thread(self._sandbox().read_file, path, 16 << 10)
        except SandboxPathError as e:
            return FailedCall(f"view: {e}")
        return "\n".join(f"{i:3d} {line}" for i, line in enumerate(text.splitlines(), 1)) or "[empty file]"


REPO_TOOLS = {"bash": BashTool, "edit": EditTool, "view": ViewTool}
