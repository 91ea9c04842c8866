"""Repo fixing as a multi-turn task (env class `repo_fix`, rows from data/repo_fix.py). A run adds it with
`+environment.env_classes.repo_fix=skyrl_stepwise.envs.repo_fix:RepoFixEnv` (conf/experiment/repo_fix_tiny.yaml
does).

Per trajectory a sandbox (skyrl_stepwise/sandbox) holds a private copy of the task's package and its failing test;
the model works on it with `bash`, `edit` and `view` (tools/repo.py). A turn without a tool call (or the last turn)
ends the episode, and then the hidden cases (reward_spec.cases: calls and expected values, never shown to the model)
are graded by envs/grading.py: the package's sources as the model left them, and nothing else of its working dir,
are copied into a FRESH sandbox that makes the calls; the expected values never leave the host, which compares each
returned value with its own, type included.

Reward: the fraction of the task's bugs whose hidden cases all pass (group `bug<k>`, one per bug), and 0 when a
`regression` case fails (a fix that breaks another function earns nothing).
Why a fraction and not all-or-nothing: a level-3 task has two bugs, and fixing one of them is real progress a
135M model should be paid for; why per bug and not per assertion: a bug whose function still fails half its
cases is not fixed, and the untouched package must score exactly 0 (tests/test_repo_fix.py checks both).
`reward/tamper_suspected` is 1 when the grading saw a forgery attempt (tests/test_reward_hacking.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import PurePosixPath
from typing import Any

from skyrl_stepwise.chat.base import ParsedTurn
from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.envs.grading import Call, Case, Grade, grade_cases, introspection, task_sources
from skyrl_stepwise.envs.grading_harness import decode
from skyrl_stepwise.sandbox import Limits, Sandbox, SandboxMetrics, SandboxPathError, StopReason
from skyrl_stepwise.sandbox.backends import open_sandbox
from skyrl_stepwise.tools import ToolExecutor, to_messages
from skyrl_stepwise.tools.executor import run_turn_calls
from skyrl_stepwise.tools.repo import REPO_TOOLS

GRADE_LIMITS = Limits(wall_s=20.0, cpu_s=10, memory_bytes=1 << 30, output_bytes=1 << 20)


class RepoFixError(ValueError):
    """A task row the env cannot run (no files, no hidden tests): the message names the row and what is missing."""


def reward_of(groups: dict[str, bool]) -> tuple[float, int, int]:
    """(reward, bug groups passing, bug groups): the fraction of bug groups passing, 0 if a regression group fails
    or there is no group."""
    bugs = {k: v for k, v in groups.items() if not k.startswith("regression")}
    passed = sum(bugs.values())
    if not bugs or not all(v for k, v in groups.items() if k.startswith("regression")):
        return 0.0, passed, len(bugs)
    return passed / len(bugs), passed, len(bugs)


def group_verdicts(cases: list[Case], grade: Grade) -> dict[str, bool]:
    """Each group passes when every case of it passed."""
    groups: dict[str, bool] = {}
    for case, passed in zip(cases, grade.passed):
        groups[case.group] = groups.get(case.group, True) and passed
    return groups


def parse_cases(raw: Any, where: str) -> list[Case]:
    """reward_spec.cases as grading cases; RepoFixError naming the row when one is malformed."""
    keys = ("group", "module", "function", "args", "kwargs", "expected")
    if not isinstance(raw, (list, tuple)) or not raw:
        raise RepoFixError(f"{where} has no tests: reward_spec.cases must be a non-empty list of hidden cases "
                           "(rows from skyrl_stepwise.data.repo_fix; a row with `hidden_tests` source is from an "
                           "older version: write the data again)")
    cases = []
    for k, c in enumerate(raw):
        if not isinstance(c, dict) or not all(isinstance(c.get(key), str) for key in keys):
            raise RepoFixError(f"{where}: reward_spec.cases[{k}] needs string fields {list(keys)}")
        try:
            args, kwargs, expected = (decode(json.loads(c[key])) for key in ("args", "kwargs", "expected"))
        except ValueError as e:
            raise RepoFixError(f"{where}: reward_spec.cases[{k}] is not type-tagged JSON ({e})") from None
        cases.append(Case(Call(c["module"], c["function"], tuple(args), kwargs), expected, c["group"]))
    return cases


def check_task(spec: dict[str, Any], instance_id: Any) -> tuple[list[dict[str, str]], list[Case]]:
    """The row's files and hidden cases, or RepoFixError naming the row and the missing piece."""
    files = spec.get("files")
    where = f"instance {instance_id!r}: env_class repo_fix"
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("content"), str)
            for f in files):
        raise RepoFixError(f"{where} needs reward_spec.files, a non-empty list of {{path, content}} (the package "
                           "to fix; rows from skyrl_stepwise.data.repo_fix)")
    return files, parse_cases(spec.get("cases"), where)


class RepoFixEnv:
    """One repo-fixing task: a sandbox holding the package, bash/edit/view tools, hidden tests as the reward."""

    max_turns_default = 8
    tool_timeout_s = 60.0

    def __init__(self) -> None:
        self.cases: list[Case] = []
        self.instance_id: Any = None
        self.roots: set[str] = set()
        self.sandbox: Sandbox | None = None
        self.sandbox_metrics = SandboxMetrics()
        self.executor: ToolExecutor | None = None
        self.tool_schemas: list[dict] = [cls.default_schema for cls in REPO_TOOLS.values()]
        self.turns, self.max_turns = 0, self.max_turns_default

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Check the row, start the trajectory's sandbox with the package in it, bind the tools to it."""
        self.instance_id = extras.get("instance_id")
        files, self.cases = check_task(extras.get("reward_spec") or {}, self.instance_id)
        self.roots = {PurePosixPath(f["path"]).parts[0] for f in files if len(PurePosixPath(f["path"]).parts) > 1}
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
        """Tool calls -> their outputs; a turn without calls (or the last turn) -> hidden cases, episode ends."""
        self.turns += 1
        calls = turn.tool_calls
        if calls and self.turns < self.max_turns:
            results, metrics = await run_turn_calls(self.executor, calls)
            return StepResult(to_messages(results), 0.0, False, metrics)
        grade = await asyncio.to_thread(self._grade)
        grade.log_suspicions(self.instance_id)
        reward, passed, total = reward_of(group_verdicts(self.cases, grade))
        reason = grade.stop_reason
        metrics = {**grade.metrics(), "repo_fix/reward": reward, "repo_fix/solved": float(reward == 1.0),
                   "repo_fix/bugs_fixed": float(passed), "repo_fix/bugs": float(total),
                   "tool_calls": float(len(calls)), "turns": float(self.turns)}
        if reason is not None and reason is not StopReason.EXITED:
            metrics[f"repo_fix/grade_{reason.value}"] = 1.0
        metrics.update({k: float(v) for k, v in self.sandbox_metrics.as_dict().items()
                        if k in ("sandbox/runs", "sandbox/path_refusals", "sandbox/seconds")
                        or k.startswith("sandbox/stop/")})
        return StepResult([], reward, True, metrics)

    def _grade(self) -> Grade:
        """The package's sources as the model left them, graded in a fresh sandbox (envs/grading.py); a module the
        episode wrote where a grader reading the working dir would import it, or a source reading the grading
        process's frames, is counted as suspected tampering."""
        files, stray = task_sources(self.sandbox, sorted(self.roots))
        grade = grade_cases(files, self.cases, GRADE_LIMITS, self.sandbox_metrics)
        return grade.with_tamper(stray + introspection(files))

    async def aclose(self) -> None:
        """Kill whatever the episode's sandbox still runs and remove its directory."""
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)
