"""Short generated problems a 135M model solves by writing and running Python (env class `python_tool`).

Why this task: SmolLM2-135M cannot add two five-digit numbers or sort twelve letters in its head, but it can copy
them into a one-line program. So the reward depends on whether it runs the code and answers with what the run
printed, which is what the python-tool recipe (conf/experiment/python_tool_tiny.yaml) teaches and measures. Four
kinds, three levels each (the `level` in extra_info; data_source `python_tool/levelN`, so an eval's line splits by
level):
  add      1: a + b (4 digits)      2: a + b - c (5 digits)       3: a * b + c (4-5 digits)
  reverse  a string of 5 / 8 / 12 random letters
  sort     the letters of a 5 / 8 / 12 letter string in alphabetical order
  count    how many times a letter appears in 8 / 14 / 24 letters drawn from 3 / 4 / 5 letters

Deterministic from a seed, and the splits are disjoint by construction, whatever their seeds: a problem belongs to
validation when the sha256 of its question is 0 mod 4, to train otherwise, and each split only keeps its own.
The train split is sampled easy-to-hard (row i's level is drawn with weights (1 - p, 1/2, p), p = i / size), so a
run reading it in file order (data.shuffle=false) meets level 1 first; validation cycles the levels evenly.
The expected answer is in `reward_spec` only (the env compares on the host); the prompt never shows it.

Two ways in: `data.train_path=python_tool:train:SIZE:SEED` / `data.val_path=python_tool:validation:SIZE:SEED`
in a run (built once, cached), and `sft.data=python_tool:demos:SIZE:SEED` for the warm start's demonstrations:
train problems played through the real env (data/python_tool_demos.py), each kept only when the env paid 1.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_CLASS = "python_tool"
SPEC_PREFIX = "python_tool:"
SPLITS = ("train", "validation", "demos")  # demos: train problems, played as demonstrations
VALIDATION_BUCKET = 4  # sha256(question) % 4 == 0 -> validation
KINDS = ("add", "reverse", "sort", "count")
LEVELS = (1, 2, 3)
BUILD_VERSION = 1  # part of the cached files' names: a change to the problems rebuilds them
STRING_LENGTHS = {1: 5, 2: 8, 3: 12}
COUNT_SHAPES = {1: (8, "abc"), 2: (14, "abcd"), 3: (24, "abcde")}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYSTEM_PROMPT = ("Solve the task by writing a short Python program and running it with the python tool. "
                 "Then reply with only what the program printed, inside <answer> and </answer>, "
                 "for example <answer>42</answer>.")


@dataclass(frozen=True)
class Problem:
    """One problem: its question, the expected answer (host only) and the one-line program that computes it."""

    kind: str
    level: int
    question: str
    answer: str
    code: str  # what a demonstration runs: printing exactly `answer`


@dataclass(frozen=True)
class TaskSpec:
    """`python_tool:SPLIT:SIZE:SEED`: which split, how many rows, the generator's seed."""

    split: str
    size: int
    seed: int


def parse_spec(value: str, key: str) -> TaskSpec:
    """`python_tool:SPLIT[:SIZE[:SEED]]` (a data path or sft.data in a run's config) -> TaskSpec; size 256, seed 0."""
    parts = value[len(SPEC_PREFIX):].split(":")
    if parts[0] not in SPLITS or len(parts) > 3:
        raise ValueError(f"{key}: {value!r} is not python_tool:SPLIT[:SIZE[:SEED]] with SPLIT one of {list(SPLITS)}")
    try:
        size = int(parts[1]) if len(parts) > 1 else 256
        seed = int(parts[2]) if len(parts) > 2 else 0
    except ValueError:
        raise ValueError(f"{key}: {value!r}: SIZE and SEED must be integers") from None
    if size <= 0:
        raise ValueError(f"{key}: {value!r}: SIZE must be positive")
    return TaskSpec(parts[0], size, seed)


# ------------------------------------------------------------------------------------------------ problems

def _add(rng: random.Random, level: int) -> tuple[str, str, str]:
    """(expression, question, program) of an arithmetic problem."""
    if level == 1:
        expr = f"{rng.randint(1000, 9999)} + {rng.randint(1000, 9999)}"
    elif level == 2:
        expr = f"{rng.randint(10000, 99999)} + {rng.randint(10000, 99999)} - {rng.randint(10000, 99999)}"
    else:
        expr = f"{rng.randint(1000, 9999)} * {rng.randint(100, 999)} + {rng.randint(10000, 99999)}"
    return expr, f"Compute {expr}.", f"print({expr})"


def _word(rng: random.Random, n: int, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def make_problem(rng: random.Random, kind: str, level: int) -> Problem:
    """A fresh problem of `kind` at `level`; its answer is what its program prints (computed here, on the host)."""
    if kind == "add":
        expr, question, code = _add(rng, level)
        answer = str(eval(expr, {"__builtins__": {}}))  # noqa: S307 - our own generated digits and + - *
    elif kind == "reverse":
        word = _word(rng, STRING_LENGTHS[level])
        question, code, answer = f'Reverse the string "{word}".', f'print("{word}"[::-1])', word[::-1]
    elif kind == "sort":
        word = _word(rng, STRING_LENGTHS[level])
        question = f'Sort the letters of "{word}" in alphabetical order.'
        code, answer = f'print("".join(sorted("{word}")))', "".join(sorted(word))
    elif kind == "count":
        n, alphabet = COUNT_SHAPES[level]
        word, letter = _word(rng, n, alphabet), rng.choice(alphabet)
        question = f'How many times does the letter "{letter}" appear in "{word}"?'
        code, answer = f'print("{word}".count("{letter}"))', str(word.count(letter))
    else:
        raise ValueError(f"unknown python_tool problem kind {kind!r}; kinds: {list(KINDS)}")
    return Problem(kind, level, question, answer, code)


def split_of(question: str) -> str:
    """Which split a question belongs to, from its text alone: the same question is never in both."""
    bucket = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % VALIDATION_BUCKET
    return "validation" if bucket == 0 else "train"


def level_for(index: int, size: int, split: str, rng: random.Random) -> int:
    """Validation: levels in turn (an even mix). Train: sampled easy-to-hard along the file."""
    if split == "validation":
        return LEVELS[index % len(LEVELS)]
    p = index / max(size - 1, 1)
    return rng.choices(LEVELS, weights=(1.0 - p, 0.5, p))[0]


def problems(spec: TaskSpec) -> list[Problem]:
    """`spec.size` distinct problems of the split (demos: train problems, from a seed stream of their own)."""
    split = "train" if spec.split == "demos" else spec.split
    rng = random.Random(f"python_tool/{spec.split}/{spec.seed}")
    out: list[Problem] = []
    seen: set[str] = set()
    while len(out) < spec.size:
        level = level_for(len(out), spec.size, split, rng)
        problem = make_problem(rng, KINDS[len(out) % len(KINDS)], level)
        if problem.question in seen or split_of(problem.question) != split:
            continue
        seen.add(problem.question)
        out.append(problem)
    return out


def problem_row(problem: Problem, spec: TaskSpec, index: int) -> dict[str, Any]:
    """One problem as a row: the question in the prompt, the expected answer only in reward_spec."""
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem.question}],
        "env_class": ENV_CLASS,
        "reward_spec": {"answer": problem.answer, "kind": problem.kind, "level": problem.level},
        "data_source": f"python_tool/level{problem.level}",
        "extra_info": {"split": spec.split, "index": index, "seed": spec.seed, "kind": problem.kind,
                       "level": problem.level, "question": problem.question},
        "instance_id": f"python_tool-{spec.split}-{spec.seed}-{index}",
    }


def task_rows(spec: TaskSpec) -> list[dict[str, Any]]:
    """The split's rows, in file order (train: easy-to-hard)."""
    return [problem_row(p, spec, i) for i, p in enumerate(problems(spec))]


def cached_task_file(spec: TaskSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """The parquet file of `spec`, generated on first use (seeded, so the cache is exact)."""
    from skyrl_stepwise.data.dataset import write_parquet
    from skyrl_stepwise.models.prepare import cache_root

    if spec.split == "demos":
        raise ValueError("python_tool:demos is SFT data (sft.data), not a prompt dataset; use python_tool:train")
    path = cache_root(cache_dir) / "data" / "python_tool" / f"{spec.split}-{spec.size}-{spec.seed}.v{BUILD_VERSION}.parquet"
    if not path.is_file():
        write_parquet(task_rows(spec), path)
    return path
