"""HumanEval as a multi-turn code task (env class `humaneval`, rows from data/humaneval.py). A run adds it with
`+environment.env_classes.humaneval=skyrl_stepwise.envs.humaneval:HumanEvalEnv` (envs/builtin.py's plugin path).

Per trajectory a sandbox (skyrl_stepwise/sandbox) backs a `python` tool: the model writes a solution, may run it
and its own checks, reads the output and revises. A turn without a tool call is its answer: the last ```python
block (or the whole text). The reward is the hidden tests (`check(entry_point)` from the row's reward_spec, never
shown to the model), run in a fresh sandbox holding nothing the model wrote: 1.0 when every assertion passes.

The grading program ends by printing a random token the model never saw, so a solution that exits early with
status 0 (`sys.exit(0)` at import) does not pass. (Code that introspects its own process could still find the
token: the tests run in the same interpreter as the solution, as in HumanEval's own harness; the sandbox bounds
what such code can do, not what it can claim.)
"""

from __future__ import annotations

import asyncio
import re
import secrets
from typing import Any

from skyrl_stepwise.chat.base import ParsedTurn
from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.sandbox import Limits, Sandbox, SandboxMetrics, StopReason
from skyrl_stepwise.sandbox.backends import open_sandbox
from skyrl_stepwise.tools import ToolExecutor, to_messages
from skyrl_stepwise.tools.executor import run_turn_calls
from skyrl_stepwise.tools.code import PythonTool

CODE_BLOCK_RE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
GRADE_LIMITS = Limits(wall_s=15.0, cpu_s=10, memory_bytes=1 << 30, output_bytes=16 << 10)


def extract_code(content: str) -> str | None:
    """The answer's code: the last fenced block, else the whole text if it defines a function, else None."""
    blocks = CODE_BLOCK_RE.findall(content or "")
    if blocks:
        return blocks[-1]
    return content if content and "def " in content else None


def grading_program(spec: dict[str, Any], solution: str, token: str) -> str:
    """The stub (its imports), the model's solution, the hidden tests, the check, then the pass token."""
    return (f"{spec['prompt']}\n\n{solution}\n\n{spec['test']}\n\n"
            f"check({spec['entry_point']})\nprint({token!r})\n")


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
        passed, reason = (await asyncio.to_thread(self._grade, solution)) if solution else (False, None)
        metrics = {"humaneval/passed": float(passed), "answered": float(solution is not None),
                   "tool_calls": float(len(calls)), "turns": float(self.turns)}
        if reason is not None and reason is not StopReason.EXITED:
            metrics[f"humaneval/grade_{reason.value}"] = 1.0
        # the episode's tool runs by stop reason (sandbox/runs, sandbox/stop/timeout, ...): an attack or a runaway
        # program shows in the run's metrics, not only in its trajectory's tool messages
        metrics.update({k: float(v) for k, v in self.sandbox_metrics.as_dict().items()
                        if k in ("sandbox/runs", "sandbox/seconds") or k.startswith("sandbox/stop/")})
        return StepResult([], float(passed), True, metrics)

    def _grade(self, solution: str) -> tuple[bool, StopReason]:
        """Run the hidden tests on the solution in a fresh, empty sandbox."""
        token = f"HUMANEVAL-PASSED-{secrets.token_hex(16)}"
        with open_sandbox(limits=GRADE_LIMITS) as grader:
            result = grader.run("python3 -", stdin=grading_program(self.spec, solution, token))
        passed = result.ok and result.stdout.rstrip("\n").rsplit("\n", 1)[-1] == token
        return passed, result.stop_reason

    async def aclose(self) -> None:
        """Kill whatever the episode's sandbox still runs and remove its directory."""
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)
