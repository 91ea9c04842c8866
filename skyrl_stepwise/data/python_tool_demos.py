"""SFT demonstrations for the python-tool task, each played through the real env and kept only when it paid 1.

Why: SmolLM2-135M rarely calls a tool it was only told about, so RL from the base model gets no reward to learn
from. A short warm start on episodes of the wanted shape fixes the format first (the Search-R1 recipe's lesson,
data/demonstrations.py). One demonstration, in the model's own tool-call format (OpenAI-shaped `tool_calls`, which
SFT renders with the chat format's tool syntax, as it renders the RL prompts):

    system + user       the row's own prompt
    assistant           a `python` call whose code is the problem's one-line program (no text before it)
    tool                the sandbox's real output for that call, byte for byte (PythonToolEnv's observation)
    assistant           `<answer>` + that output + `</answer>`

The answer is copied from what the sandbox printed, not from the expected value, and the env grades it on the host:
a demonstration the env did not pay 1 is dropped (none should be; tests/test_python_tool.py checks). Problems come
from the train split only (data/python_tool.py's `demos` stream). The file is cached under the shared cache, keyed
by every input (the rows, this builder's version, the tool schema), so a change rebuilds it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from skyrl_stepwise.data.python_tool import TaskSpec, task_rows

DEMOS_VERSION = 1


async def play_demo(row: dict[str, Any], code: str) -> dict[str, Any] | None:
    """One episode through PythonToolEnv: run `code`, answer with its output. None unless the env paid 1."""
    from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest
    from skyrl_stepwise.envs.python_tool import PythonToolEnv

    env = PythonToolEnv()
    try:
        messages = await env.reset(row["prompt"], row)
        call = ToolCallRequest("python", {"code": code}, id="call_0")
        step = await env.step_turn(ParsedTurn("", tool_calls=[call]))
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call_0", "function": {"name": "python", "arguments": json.dumps({"code": code})}}]})
        messages += step.observations
        answer = f"<answer>{step.observations[0]['content'].strip()}</answer>"
        final = await env.step_turn(ParsedTurn(answer))
        messages.append({"role": "assistant", "content": answer})
    finally:
        await env.aclose()
    if not final.done or final.reward != 1.0:
        return None
    return {"messages": messages, "instance_id": row["instance_id"], "reward": final.reward,
            "level": row["extra_info"]["level"]}


def build_demos(spec: TaskSpec) -> list[dict[str, Any]]:
    """Every demonstration of the `demos` stream's problems that earned reward 1, in order."""
    from skyrl_stepwise.data.python_tool import problems

    pairs = list(zip(task_rows(spec), problems(spec)))

    async def play_all() -> list[dict[str, Any]]:
        played = [await play_demo(row, problem.code) for row, problem in pairs]
        return [d for d in played if d is not None]

    return asyncio.run(play_all())


def cache_key(spec: TaskSpec) -> str:
    """Hash of everything that changes the file: the rows, the programs, this builder and the tool schema."""
    from skyrl_stepwise.data.python_tool import problems
    from skyrl_stepwise.tools.code import PythonTool

    inputs = {"version": DEMOS_VERSION, "rows": task_rows(spec), "code": [p.code for p in problems(spec)],
              "schema": PythonTool.default_schema}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def cached_demos_file(spec: TaskSpec, cache_dir: str | Path | None = None) -> Path:
    """The demonstrations parquet of `spec` (python_tool:demos:SIZE:SEED), played on first use."""
    from skyrl_stepwise.data.dataset import write_parquet
    from skyrl_stepwise.models.prepare import cache_root

    if spec.split != "demos":
        raise ValueError(f"sft.data: demonstrations come from python_tool:demos:SIZE:SEED, got split {spec.split!r}")
    path = cache_root(cache_dir) / "data" / "python_tool" / f"demos-{spec.size}-{spec.seed}-{cache_key(spec)}.parquet"
    if not path.is_file():
        demos = build_demos(spec)
        if not demos:
            raise ValueError(f"python_tool:demos:{spec.size}:{spec.seed}: no demonstration earned reward 1 "
                             "(is the sandbox working? `skyrl-stepwise` logs its start-up check)")
        write_parquet(demos, path)
    return path
