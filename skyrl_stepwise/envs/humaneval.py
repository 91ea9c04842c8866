"""HumanEval as a multi-turn code task (env class `humaneval`, rows from data/humaneval.py). A run adds it with
`+environment.env_classes.humaneval=skyrl_stepwise.envs.humaneval:HumanEvalEnv` (envs/builtin.py's plugin path).

Per trajectory a sandbox (skyrl_stepwise/sandbox) backs a `python` tool: the model writes a solution, may run it
and its own checks, reads the output and revises. A turn without a tool call is its answer: the last ```python
block (or the whole text). The reward is the hidden tests (`check(candidate)` from the row's reward_spec, never
shown to the model), graded by envs/grading.py: the answer (after the stub's imports and helpers) is a module of its
own, `solution.py`, in a FRESH sandbox holding nothing else; the test runs on the HOST, against a candidate that
replays what `solution.<entry_point>` returned in that sandbox for the same arguments (type-tagged plain values).
No test, expected value, token or verdict is ever in a process that runs the model's code: 1.0 when the test
finishes. `reward/tamper_suspected` is 1 when the grading saw a forgery attempt (tests/test_reward_hacking.py),
e.g. an answer that compiles only when the tests are pasted after it (one ending in a decorator line).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from skyrl_stepwise.chat.base import ParsedTurn
from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.envs.grading import Grade, grade_check, introspection
from skyrl_stepwise.sandbox import Limits, Sandbox, SandboxMetrics, StopReason
from skyrl_stepwise.sandbox.backends import open_sandbox
from skyrl_stepwise.tools import ToolExecutor, to_messages
from skyrl_stepwise.tools.executor import run_turn_calls
from skyrl_stepwise.tools.code import PythonTool

CODE_BLOCK_RE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
SOLUTION_MODULE = "solution"
GRADE_LIMITS = Limits(wall_s=15.0, cpu_s=10, memory_bytes=1 << 30, output_bytes=1 << 20)


def extract_code(content: str) -> str | None:
    """The answer's code: the last fenced block, else the whole text if it defines a function, else None."""
    blocks = CODE_BLOCK_RE.findall(content or "")
    if blocks:
        return blocks[-1]
    return content if content and "def " in content else None


def solution_source(spec: dict[str, Any], solution: str) -> str:
    """The answer as a module of its own: the stub (its imports and helpers), then the model's code."""
    return f"{spec['prompt']}\n\n{solution}\n"


def pasted_only(source: str, test: str) -> bool:
    """Whether the module does not compile alone but does with the tests pasted after it: an answer written to
    swallow what follows (a trailing decorator turns `def check` into a no-op when pasted)."""
    try:
        compile(source, "solution.py", "exec")
        return False
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        pass
    try:
        compile(f"{source}\n\n{test}\n", "pasted.py", "exec")
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


class HumanEvalEnv:
    """One HumanEval problem: a sandbox and a `python` tool for the episode, hidden tests as the reward."""

    max_turns_default = 6
    tool_timeout_s = 60.0

    def __init__(self) -> None:
        self.spec: dict[str, Any] = {}
        self.sandbox: Sandbox | None = None
        self.sandbox_metrics = SandboxMetrics()  # this episode's tool runs, by why they stopped
        self.executor: ToolExecutor | None = None
        self.tool_schemas: list[dict] = [PythonTool.default_schema]
        self.turns, self.max_turns = 0, self.max_turns_default

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Keep the hidden tests, start the trajectory's sandbox and bind the python tool to it."""
        spec = extras.get("reward_spec") or {}
        missing = [k for k in ("prompt", "test", "entry_point") if not spec.get(k)]
        if missing:
            raise ValueError(f"instance {extras.get('instance_id')!r}: env_class humaneval needs reward_spec "
                             f"{missing} (the hidden tests; rows from skyrl_stepwise.data.humaneval)")
        self.spec = dict(spec)
        self.max_turns = int(extras.get("max_turns", self.max_turns_default))
        self.turns = 0
        self.sandbox = await asyncio.to_thread(open_sandbox, metrics=self.sandbox_metrics)
        self.executor = ToolExecutor({"python": PythonTool().bound_to(self.sandbox)}, self.tool_timeout_s)
        return list(prompt_messages)

    async def step(self, action_text: str) -> StepResult:
        """Only reachable when nothing parsed the turn."""
        return await self.step_turn(ParsedTurn(action_text))

    async def step_turn(self, turn: ParsedTurn) -> StepResult:
        """Tool calls -> their outputs; a turn without calls (or the last turn) -> graded, episode ends."""
        self.turns += 1
        calls = turn.tool_calls
        if calls and self.turns < self.max_turns:
            results, metrics = await run_turn_calls(self.executor, calls)
            return StepResult(to_messages(results), 0.0, False, metrics)
        solution = extract_code(turn.content) if not calls else None
        grade = (await asyncio.to_thread(self._grade, solution)) if solution else Grade((False,))
        grade.log_suspicions(self.spec.get("task_id"))
        passed, reason = all(grade.passed), grade.stop_reason
        metrics = {**grade.metrics(), "humaneval/passed": float(passed), "answered": float(solution is not None),
                   "tool_calls": float(len(calls)), "turns": float(self.turns)}
        if reason is not None and reason is not StopReason.EXITED:
            metrics[f"humaneval/grade_{reason.value}"] = 1.0
        # the episode's tool runs by stop reason (sandbox/runs, sandbox/stop/timeout, ...): an attack or a runaway
        # program shows in the run's metrics, not only in its trajectory's tool messages
        metrics.update({k: float(v) for k, v in self.sandbox_metrics.as_dict().items()
                        if k in ("sandbox/runs", "sandbox/seconds") or k.startswith("sandbox/stop/")})
        return StepResult([], float(passed), True, metrics)

    def _grade(self, solution: str) -> Grade:
        """The hidden test on the host against the answer's calls made in a fresh sandbox (envs/grading.py)."""
        source = solution_source(self.spec, solution)
        files = {f"{SOLUTION_MODULE}.py": source}
        suspicions = introspection(files)
        if pasted_only(source, self.spec["test"]):
            suspicions.append("the answer compiles only with the tests pasted after it")
        grade = grade_check(files, SOLUTION_MODULE, self.spec["entry_point"], self.spec["test"],
                            prelude=self.spec["prompt"], limits=GRADE_LIMITS)
        return grade.with_tamper(suspicions)

    async def aclose(self) -> None:
        """Kill whatever the episode's sandbox still runs and remove its directory."""
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)
