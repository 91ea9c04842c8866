"""Repo fixing as a multi-turn task (env class `repo_fix`, rows from data/repo_fix.py). A run adds it with
`+environment.env_classes.repo_fix=skyrl_stepwise.envs.repo_fix:RepoFixEnv` (conf/experiment/repo_fix_tiny.yaml
does).

Per trajectory a sandbox (skyrl_stepwise/sandbox) holds a private copy of the task's package and its failing test;
the model works on it with `bash`, `edit` and `view` (tools/repo.py). A turn without a tool call (or the last turn)
ends the episode, and then the hidden tests (reward_spec.hidden_tests, never shown to the model, never written to
disk) run on the working directory as the model left it.

Reward: the fraction of the task's bugs whose hidden tests all pass (`hidden_*` functions of the hidden tests, one
per bug), and 0 when a `hidden_regression*` function fails (a fix that breaks another function earns nothing).
Why a fraction and not all-or-nothing: a level-3 task has two bugs, and fixing one of them is real progress a
135M model should be paid for; why per bug and not per assertion: a bug whose function still fails half its
cases is not fixed, and the untouched package must score exactly 0 (tests/test_repo_fix.py checks both).

The grading program runs as `python3 -I -B -X pycache_prefix=/tmp/...` (stdin; no script dir on sys.path, no
sitecustomize from the working dir, no bytecode from it), writes its verdict with a random token the model never
saw through a file descriptor it captured before importing the package, and ends with os._exit (no atexit handler of the package runs after it). Code that
introspects its own process could still forge the verdict, as in HumanEval's harness: the sandbox bounds what such
code can do, not what it can claim.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from skyrl_stepwise.chat.base import ParsedTurn
from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.sandbox import Limits, Sandbox, SandboxMetrics, SandboxPathError, StopReason
from skyrl_stepwise.sandbox.backends import open_sandbox
from skyrl_stepwise.tools import ToolExecutor, to_messages
from skyrl_stepwise.tools.executor import run_turn_calls
from skyrl_stepwise.tools.repo import REPO_TOOLS

GRADE_LIMITS = Limits(wall_s=20.0, cpu_s=10, memory_bytes=1 << 30, output_bytes=16 << 10)
# -I: no script dir on sys.path, no PYTHON* variables; -B and a pycache prefix on the private /tmp: no bytecode the
# episode left in the working dir is read (a same-size edit within a second of a .pyc write would otherwise be
# invisible to the grader), and none is written there
GRADE_COMMAND = "python3 -I -B -X pycache_prefix=/tmp/grade-pycache -"
_RUNNER_HEAD = ("import sys as _sys\nfrom os import write as _write, _exit as _exit\n"
                "_sys.path.insert(0, '/work')\nimport json as _json\n")
_RUNNER_TAIL = """
_verdict = {}
for _name, _fn in list(globals().items()):
    if _name.startswith("hidden_") and callable(_fn):
        try:
            _fn()
            _verdict[_name] = True
        except BaseException:
            _verdict[_name] = False
_write(1, ("\\n" + __TOKEN__ + _json.dumps(_verdict) + "\\n").encode())
_exit(0)
"""


class RepoFixError(ValueError):
    """A task row the env cannot run (no files, no hidden tests): the message names the row and what is missing."""


def grading_program(hidden_tests: str, token: str) -> str:
    """The hidden tests between a head that makes the working dir importable and a tail that runs every
    `hidden_*` function and writes the verdict after the token."""
    return _RUNNER_HEAD + hidden_tests + "\n" + _RUNNER_TAIL.replace("__TOKEN__", repr(token))


def parse_verdict(stdout: str, token: str) -> dict[str, bool] | None:
    """The verdict the grading program wrote (its last line), or None when it never got there."""
    last = stdout.rstrip("\n").rsplit("\n", 1)[-1]
    if not last.startswith(token):
        return None
    try:
        verdict = json.loads(last[len(token):])
    except ValueError:
        return None
    return {str(k): v is True for k, v in verdict.items()} if isinstance(verdict, dict) else None


def reward_of(verdict: dict[str, bool] | None) -> tuple[float, int, int]:
    """(reward, bug groups passing, bug groups): the fraction of bug groups passing, 0 if a regression group fails
    or there is no verdict."""
    if not verdict:
        return 0.0, 0, 0
    bugs = {k: v for k, v in verdict.items() if not k.startswith("hidden_regression")}
    passed = sum(bugs.values())
    if not bugs or not all(v for k, v in verdict.items() if k.startswith("hidden_regression")):
        return 0.0, passed, len(bugs)
    return passed / len(bugs), passed, len(bugs)


def check_task(spec: dict[str, Any], instance_id: Any) -> tuple[list[dict[str, str]], str]:
    """The row's files and hidden tests, or RepoFixError naming the row and the missing piece."""
    files = spec.get("files")
    hidden = spec.get("hidden_tests")
    where = f"instance {instance_id!r}: env_class repo_fix"
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("content"), str)
            for f in files):
        raise RepoFixError(f"{where} needs reward_spec.files, a non-empty list of {{path, content}} (the package "
                           "to fix; rows from skyrl_stepwise.data.repo_fix)")
    if not isinstance(hidden, str) or "def hidden_" not in hidden:
        raise RepoFixError(f"{where} has no tests: reward_spec.hidden_tests must be Python source defining "
                           "`hidden_*` functions (without them the task cannot be graded)")
    return files, hidden


class RepoFixEnv:
    """One repo-fixing task: a sandbox holding the package, bash/edit/view tools, hidden tests as the reward."""

    max_turns_default = 8
    tool_timeout_s = 60.0

    def __init__(self) -> None:
        self.hidden_tests = ""
        self.sandbox: Sandbox | None = None
        self.sandbox_metrics = SandboxMetrics()
        self.executor: ToolExecutor | None = None
        self.tool_schemas: list[dict] = [cls.default_schema for cls in REPO_TOOLS.values()]
        self.turns, self.max_turns = 0, self.max_turns_default

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Check the row, start the trajectory's sandbox with the package in it, bind the tools to it."""
        files, self.hidden_tests = check_task(extras.get("reward_spec") or {}, extras.get("instance_id"))
        self.max_turns = int(extras.get("max_turns", self.max_turns_default))
        self.turns = 0
        self.sandbox = await asyncio.to_thread(open_sandbox, metrics=self.sandbox_metrics)
        try:
            for f in files:  # write_file is confined: a row naming "../x" is refused, never written outside
                await asyncio.to_thread(self.sandbox.write_file, f["path"], f["content"])
        except SandboxPathError as e:
            raise RepoFixError(f"instance {extras.get('instance_id')!r}: a task file leaves the working "
                               f"directory: {e}") from e
        tools = {name: cls().bound_to(self.sandbox) for name, cls in REPO_TOOLS.items()}
        self.executor = ToolExecutor(tools, self.tool_timeout_s)
        return list(prompt_messages)

    async def step(self, action_text: str) -> StepResult:
        """Only reachable when nothing parsed the turn."""
        return await self.step_turn(ParsedTurn(action_text))

    async def step_turn(self, turn: ParsedTurn) -> StepResult:
        """Tool calls -> their outputs; a turn without calls (or the last turn) -> hidden tests, episode ends."""
        self.turns += 1
        calls = turn.tool_calls
        if calls and self.turns < self.max_turns:
            results, metrics = await run_turn_calls(self.executor, calls)
            return StepResult(to_messages(results), 0.0, False, metrics)
        (reward, passed, total), reason = await asyncio.to_thread(self._grade)
        metrics = {"repo_fix/reward": reward, "repo_fix/solved": float(reward == 1.0),
                   "repo_fix/bugs_fixed": float(passed), "repo_fix/bugs": float(total),
                   "tool_calls": float(len(calls)), "turns": float(self.turns)}
        if reason is not StopReason.EXITED:
            metrics[f"repo_fix/grade_{reason.value}"] = 1.0
        metrics.update({k: float(v) for k, v in self.sandbox_metrics.as_dict().items()
                        if k in ("sandbox/runs", "sandbox/path_refusals", "sandbox/seconds")
                        or k.startswith("sandbox/stop/")})
        return StepResult([], reward, True, metrics)

    def _grade(self) -> tuple[tuple[float, int, int], StopReason]:
        """Run the hidden tests on the working dir as the model left it (stdin: never on disk, never shown)."""
        token = f"REPO-FIX-VERDICT-{secrets.token_hex(16)}"
        result = self.sandbox.run(GRADE_COMMAND, stdin=grading_program(self.hidden_tests, token),
                                  limits=GRADE_LIMITS)
        verdict = parse_verdict(result.stdout, token) if result.stop_reason is StopReason.EXITED else None
        return reward_of(verdict), result.stop_reason

    async def aclose(self) -> None:
        """Kill whatever the episode's sandbox still runs and remove its directory."""
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)
