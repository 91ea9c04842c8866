"""reasoning-gym tasks (procedural, offline, each with its own answer scorer) as rows of our dataset format.

Each row carries the task's name and its generated entry (JSON) in `reward_spec`, so the `reasoning_gym` env class
(envs/reasoning_gym.py) scores an answer with the task's own scorer on exactly the entry it was asked about.
Two ways in: `skyrl-stepwise data reasoning-gym --task chain_sum --size 200 --seed 1 --out DIR` (train and
validation parquet files), or `data.train_path=reasoning_gym:chain_sum:200:1` in a run (built once, cached).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_CLASS = "reasoning_gym"
SPEC_PREFIX = "reasoning_gym:"
SYSTEM_PROMPT = ("Solve the task. Think briefly, then give only the final answer inside <answer> and </answer>, "
                 "for example <answer>42</answer>.")


@dataclass(frozen=True)
class TaskSpec:
    """One reasoning-gym dataset: task name, how many rows and the generator seed."""

    name: str
    size: int
    seed: int


def task_names() -> list[str]:
    """Every task reasoning-gym registers (106 in 0.1.25)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task(name: str, key: str = "task") -> None:
    """An unknown task fails naming the key and the closest registered names, before anything is generated."""
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; tasks: {', '.join(names)}"
        raise ValueError(f"{key}: unknown reasoning-gym task {name!r}{hint}")


def parse_spec(value: str, key: str) -> TaskSpec:
    """`reasoning_gym:NAME[:SIZE[:SEED]]` (a data path in a run's config) -> TaskSpec; sizes default to 200, seed 0."""
    parts = value[len(SPEC_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"{key}: {value!r} is not reasoning_gym:NAME[:SIZE[:SEED]]")
    try:
        size = int(parts[1]) if len(parts) > 1 else 200
        seed = int(parts[2]) if len(parts) > 2 else 0
    except ValueError:
        raise ValueError(f"{key}: {value!r}: SIZE and SEED must be integers") from None
    if size <= 0:
        raise ValueError(f"{key}: {value!r}: SIZE must be positive")
    check_task(parts[0], key)
    return TaskSpec(parts[0], size, seed)


def task_rows(spec: TaskSpec, split: str = "train") -> list[dict[str, Any]]:
    """The task's generated entries as our rows: system instruction + the question; the entry kept for scoring."""
    import reasoning_gym

    check_task(spec.name)
    dataset = reasoning_gym.create_dataset(spec.name, size=spec.size, seed=spec.seed)
    rows = []
    for i in range(spec.size):
        entry = dataset[i]
        rows.append({
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": entry["question"]}],
            "env_class": ENV_CLASS,
            "reward_spec": {"ground_truth": {"target": [str(entry["answer"])]}, "task": spec.name,
                            "entry": json.dumps(entry, default=str)},
            "data_source": f"reasoning_gym/{spec.name}",
            "extra_info": {"split": split, "index": i, "seed": spec.seed},
            "instance_id": f"{spec.name}-{spec.seed}-{i}",
        })
    return rows


def cached_task_file(spec: TaskSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """The parquet file of `spec`, generated on first use (generation is seeded, so the cache is exact)."""
    from skyrl_stepwise.data.dataset import write_parquet
    from skyrl_stepwise.models.prepare import cache_root

    path = cache_root(cache_dir) / "data" / "reasoning_gym" / f"{spec.name}-{spec.size}-{spec.seed}.parquet"
    if not path.is_file():
        write_parquet(task_rows(spec), path)
    return path


def main(argv: list[str] | None = None) -> int:
    """`skyrl-stepwise data reasoning-gym --task NAME [--size N] [--val-size M] [--seed S] --out DIR`: writes
    DIR/train.parquet and DIR/validation.parquet (seed S and S+1, so no validation row is a train row's twin)."""
    from skyrl_stepwise.data.dataset import load_prompt_dataset, write_parquet

    parser = argparse.ArgumentParser(prog="skyrl-stepwise data reasoning-gym", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, help="a reasoning-gym task name (e.g. chain_sum; --list shows all)")
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--val-size", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output folder (default: ./reasoning_gym_<task>)")
    args = parser.parse_args(argv)
    try:
        check_task(args.task, "--task")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or f"reasoning_gym_{args.task}")
    for split, size, seed in (("train", args.size, args.seed), ("validation", args.val_size, args.seed + 1)):
        if size > 0:
            path = out / f"{split}.parquet"
            write_parquet(task_rows(TaskSpec(args.task, size, seed), split), path)
            print(f"{path}: {len(load_prompt_dataset(path))} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
