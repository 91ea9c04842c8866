"""The python-tool task (env class `python_tool`, rows from data/python_tool.py): run Python, answer what it printed.

Per trajectory a sandbox (skyrl_stepwise/sandbox, bwrap) backs a `python` tool (tools/code.py's PythonTool bound to
it, as envs/humaneval.py does): the model writes a program, reads its output as the tool message, and ends with a
turn without a call, its answer (the last `<answer>...</answer>`, else the whole text). A run adds the env with
`environment.env_classes.python_tool=skyrl_stepwise.envs.python_tool:PythonToolEnv` (the recipe does).

Grading happens here, on the host, against `reward_spec.answer`, which never enters the sandbox: the sandbox starts
empty, the model's code runs there, and only the answer TEXT comes back to be compared. Reward 1.0 for the exact
answer (surrounding whitespace and one pair of quotes ignored), else 0. No partial credit, on purpose: for one value
there is no honest part to pay. Numeric closeness pays an estimate made without running anything (the skill this
task must not reward), a format credit pays `<answer>` around any text, and "digits right" pays a guessed length.
The signal a 135M model needs comes from the warm start on demonstrations instead (data/python_tool_demos.py).

Metrics per trajectory (the run's `environment/*`, averaged over trajectories): `tool_calls` (summed over its
turns), `python_tool/solved`, `answered`, and `answer_from_output`: 1 when the answer equals a line (or the whole
text) of a successful tool output of this episode, i.e. the model answered with what its run printed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from skyrl_stepwise.chat.base import ParsedTurn
from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.envs.tool import final_answer
from skyrl_stepwise.sandbox import Sandbox, SandboxMetrics
from skyrl_stepwise.sandbox.backends import open_sandbox
from skyrl_stepwise.tools import ToolExecutor, to_messages
from skyrl_stepwise.tools.code import PythonTool
from skyrl_stepwise.tools.executor import run_turn_calls


def normalize(text: str) -> str:
    """Surrounding whitespace and one pair of matching quotes dropped: `"cba"` and cba are the same answer."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text


def answer_matches(answer: str | None, expected: str) -> bool:
    """Exact: the normalized answer is the expected value's text (case and inner spacing count: a sorted string
    with a space in it is a different string)."""
    return answer is not None and normalize(answer) == normalize(expected)


def from_output(answer: str | None, outputs: list[str]) -> bool:
    """Whether the answer is what a run printed: equal to one of its lines, or to its whole text."""
    if answer is None or not normalize(answer):
        return False
    wanted = normalize(answer)
    return any(wanted == normalize(out) or wanted in {normalize(line) for line in out.splitlines()}
               for out in outputs)


class PythonToolEnv:
    """One problem: a sandbox and a `python` tool for the episode; the answer graded on the host."""

    max_turns_default = 3
    tool_timeout_s = 30.0

    def __init__(self) -> None:
        self.expected = ""
        self.sandbox: Sandbox | None = None
        self.sandbox_metrics = SandboxMetrics()
        self.executor: ToolExecutor | None = None
        self.tool_schemas: list[dict] = [PythonTool.default_schema]
        self.outputs: list[str] = []  # this episode's successful tool outputs, as the model read them
        self.turns, self.max_turns = 0, self.max_turns_default

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Keep the expected answer on the host, start the trajectory's (empty) sandbox, bind the tool to it."""
        spec = extras.get("reward_spec") or {}
        if spec.get("answer") is None:
            raise ValueError(f"instance {extras.get('instance_id')!r}: env_class python_tool needs "
                             "reward_spec.answer (rows from skyrl_stepwise.data.python_tool)")
        self.expected = str(spec["answer"])
        self.max_turns = int(extras.get("max_turns", self.max_turns_default))
        self.turns, self.outputs = 0, []
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
            self.outputs += [r.content for r in results if r.ok]
            return StepResult(to_messages(results), 0.0, False, metrics)
        answer = final_answer(turn.content) if not calls else None
        solved = answer_matches(answer, self.expected)
        metrics = {"python_tool/solved": float(solved), "answered": float(bool(answer)),
                   "answer_from_output": float(from_output(answer, self.outputs)),
                   "tool_calls": float(len(calls)), "turns": float(self.turns)}
        return StepResult([], float(solved), True, metrics)

    async def aclose(self) -> None:
        """Kill whatever the episode's sandbox still runs and remove its directory."""
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)
