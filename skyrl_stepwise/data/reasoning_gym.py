"""reasoning-gym tasks (procedural, offline, each with its own answer scorer) as rows of our dataset format.

Each row carries the task's name and its generated entry in `reward_spec`, so the `reasoning_gym` env class
(envs/reasoning_gym.py) scores an answer with the task's own scorer on exactly the entry it was asked about. The
entry is kept losslessly (`encode_entry`: JSON with tagged tuples, sets and non-string keys; plain JSON turned
`arc_agi`'s tuple grids into lists, and the right grid then scored 0.05, like an all-zero one), and every row is
checked when it is built: the task's own answer scores the same on the stored entry as on the generated one, or the
task is refused, named.
Two ways in: `skyrl-stepwise data reasoning-gym --task chain_sum --size 200 --seed 1 --out DIR` (train and
validation parquet files), or `data.train_path=reasoning_gym:chain_sum:200:1` in a run (built once, cached).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_stepwise.envs.reasoning_gym import ENTRY_ENCODING, decode_entry, encode_entry, score_answer  # noqa: F401

ENV_CLASS = "reasoning_gym"
# Registered tasks `create_dataset(name, size, seed)` cannot build, with the reason (shown by check_task and --list).
NEEDS_CONFIG = {"composite": "it mixes other tasks and needs their list in its config (datasets=...), which a task "
                             "name, size and seed cannot give"}
SPEC_PREFIX = "reasoning_gym:"
ROWS_CHECKED = "inert1"  # in a cached file's name: files built before the env's scoring gate are built (checked) again
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
    if name in NEEDS_CONFIG:
        raise ValueError(f"{key}: reasoning-gym task {name!r} cannot be built from a name, size and seed: "
                         f"{NEEDS_CONFIG[name]}")
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


def check_entry(task: str, index: int, entry: dict[str, Any], stored: str) -> None:
    """Refuse `task` (named) unless the stored entry restores equal to the generated one and the task's own answer
    scores the same on both: a difference would train every answer with a reward the task never gives."""
    import reasoning_gym

    restored = decode_entry(stored)
    answer = None if entry.get("answer") is None else str(entry["answer"])
    score = reasoning_gym.get_score_answer_fn(task)
    try:
        original, kept = score(answer, entry), score(answer, restored)
    except Exception as e:  # noqa: BLE001 - the task's own code; named, never a bare traceback
        raise ValueError(f"reasoning-gym task {task!r}: its scorer failed on entry {index}'s own answer "
                         f"({type(e).__name__}: {e}), so it cannot be trained on") from e
    if restored != entry or original != kept:
        differs = "" if restored == entry else "; the stored entry differs from it"
        raise ValueError(f"reasoning-gym task {task!r}: entry {index} is not kept faithfully (its own answer scores "
                         f"{original} on the generated entry, {kept} on the stored one{differs}), so it cannot be "
                         "trained on")
    paid, refused = score_answer(task, answer, restored)
    if paid != original:  # the gate that keeps answers from running as code must pay a right answer in full
        why = f"its scorer compiles {refused}" if refused else "the env pays it differently"
        raise ValueError(f"reasoning-gym task {task!r}: entry {index}'s own answer scores {original}, but {paid} as "
                         f"the env scores it ({why}): the env cannot score this task without running answers as "
                         "code or underpaying right ones, so it cannot be trained on")


def task_rows(spec: TaskSpec, split: str = "train") -> list[dict[str, Any]]:
    """The task's generated entries as our rows: system instruction + the question; the entry kept losslessly for
    scoring, each checked (`check_entry`)."""
    import reasoning_gym

    check_task(spec.name)
    dataset = reasoning_gym.create_dataset(spec.name, size=spec.size, seed=spec.seed)
    rows = []
    for i in range(spec.size):
        entry = dataset[i]
        try:
            stored = encode_entry(entry)
        except TypeError as e:
            raise ValueError(f"reasoning-gym task {spec.name!r}: entry {i} cannot be stored losslessly ({e}), so "
                             "it cannot be trained on") from None
        check_entry(spec.name, i, entry, stored)
        rows.append({
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": entry["question"]}],
            "env_class": ENV_CLASS,
            "reward_spec": {"ground_truth": {"target": [str(entry["answer"])]}, "task": spec.name,
                            "entry": stored, "entry_encoding": ENTRY_ENCODING},
            "data_source": f"reasoning_gym/{spec.name}",
            "extra_info": {"split": split, "index": i, "seed": spec.seed},
            "instance_id": f"{spec.name}-{spec.seed}-{i}",
        })
    return rows


def cached_task_file(spec: TaskSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """The parquet file of `spec`, generated on first use (generation is seeded, so the cache is exact); the name
    carries the entry encoding, so a file cached with the old lossy entries is never read again."""
    from skyrl_stepwise.data.dataset import write_parquet
    from skyrl_stepwise.models.prepare import cache_root

    name = f"{spec.name}-{spec.size}-{spec.seed}.{ENTRY_ENCODING.replace('/', '')}.{ROWS_CHECKED}.parquet"
    path = cache_root(cache_dir) / "data" / "reasoning_gym" / name
    if not path.is_file():
        write_parquet(task_rows(spec), path)
    return path


def main(argv: list[str] | None = None) -> int:
    """`skyrl-stepwise data reasoning-gym --task NAME [--size N] [--val-size M] [--seed S] --out DIR`: writes
    DIR/train.parquet and DIR/validation.parquet (seed S and S+1, so no validation row is a train row's twin)."""
    from skyrl_stepwise.data.dataset import load_prompt_dataset, write_parquet

    parser = argparse.ArgumentParser(prog="skyrl-stepwise data reasoning-gym", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", help="a reasoning-gym task name (e.g. chain_sum; --list shows all)")
    parser.add_argument("--list", action="store_true", help="print the registered task names and exit")
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--val-size", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output folder (default: ./reasoning_gym_<task>)")
    args = parser.parse_args(argv)
    if args.list:
        for name in task_names():
            print(f"{name}  (not buildable: {NEEDS_CONFIG[name]})" if name in NEEDS_CONFIG else name)
        return 0
    if not args.task:
        parser.error("--task is required (--list shows the tasks)")
    try:
        check_task(args.task, "--task")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or f"reasoning_gym_{args.task}")
    wanted = (("train", args.size, args.seed), ("validation", args.val_size, args.seed + 1))
    try:  # both splits built (and checked) before either is written: a refused task leaves no half-built folder
        splits = [(split, task_rows(TaskSpec(args.task, n, seed), split)) for split, n, seed in wanted if n > 0]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, rows in splits:
        path = out / f"{split}.parquet"
        write_parquet(rows, path)
        print(f"{path}: {len(load_prompt_dataset(path))} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
