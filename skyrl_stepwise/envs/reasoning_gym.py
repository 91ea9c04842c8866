"""A reasoning-gym row scored by the task's own scorer: one turn, the last `<answer>...</answer>` is the answer.

A missing answer scores what the task's scorer gives `None` (0 for every task): the model produced no answer, a
real outcome. A scorer that raises is not an outcome: the error propagates and the generator drops the trajectory
(counted), so no made-up reward is trained.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.envs.rewards import ANSWER_RE

ENTRY_ENCODING = "tagged-json/1"  # reward_spec.entry_encoding: rows without it are from the lossy format
_TAG = "__rg_type__"


def _tagged(value: Any, path: str) -> Any:
    """`value` as plain JSON values, tuples/sets/frozensets/bytes and dicts with non-string keys tagged so
    `decode_entry` gives them back as they were; any other type fails naming where it is (never its repr)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_tagged(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (tuple, set, frozenset)):
        return {_TAG: type(value).__name__, "items": [_tagged(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, bytes):
        return {_TAG: "bytes", "hex": value.hex()}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _tagged(v, f"{path}.{k}") for k, v in value.items()}
        return {_TAG: "dict", "items": [[_tagged(k, f"{path} key {k!r}"), _tagged(v, f"{path}[{k!r}]")]
                                        for k, v in value.items()]}
    raise TypeError(f"{path}: a value of type {type(value).__name__} cannot be stored losslessly")


def _untagged(obj: dict) -> Any:
    """json.loads' object_hook (called innermost first): a tagged value back as its type (`_tagged`'s inverse)."""
    kind = obj.get(_TAG)
    if kind is None:
        return obj
    if kind == "bytes":
        return bytes.fromhex(obj["hex"])
    if kind == "dict":
        return {k: v for k, v in obj["items"]}
    return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](obj["items"])


def encode_entry(entry: dict[str, Any]) -> str:
    """A reasoning-gym entry as text that `decode_entry` turns back into an equal entry (tuples stay tuples, int
    keys stay ints). Plain `json.dumps(default=str)` lost both, and a scorer comparing grids then never matched."""
    return json.dumps(_tagged(entry, "entry"))


def decode_entry(text: str) -> dict[str, Any]:
    """`encode_entry`'s inverse."""
    return json.loads(text, object_hook=_untagged)


def _scorer(task: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


class ReasoningGymEnv:
    """One question of a reasoning-gym task; the reward is the task scorer's value for the sampled answer."""

    def __init__(self) -> None:
        self.task: str = ""
        self.entry: dict[str, Any] = {}

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Read the task and its entry from reward_spec (written by data/reasoning_gym.py); a row without them
        fails naming what is missing, and a row from before the lossless encoding fails asking for a rebuild (its
        tuples and int keys are gone, so the right answer of some tasks would score like a wrong one)."""
        spec = extras.get("reward_spec") or {}
        if not spec.get("task") or not spec.get("entry"):
            raise ValueError(f"instance {extras.get('instance_id')!r}: env_class reasoning_gym needs reward_spec.task "
                             "and reward_spec.entry (rows from `skyrl-stepwise data reasoning-gym`)")
        if spec.get("entry_encoding") != ENTRY_ENCODING:
            raise ValueError(f"instance {extras.get('instance_id')!r}: reasoning_gym row with "
                             f"reward_spec.entry_encoding {spec.get('entry_encoding')!r}, expected {ENTRY_ENCODING!r}: "
                             "its entry was stored by an older, lossy version; rebuild the rows with "
                             "`skyrl-stepwise data reasoning-gym`")
        self.task = str(spec["task"])
        self.entry = decode_entry(spec["entry"])
        return list(prompt_messages)

    async def step(self, action_text: str) -> StepResult:
        """Score the last <answer> with the task's scorer; the episode ends after this one turn."""
        answers = ANSWER_RE.findall(action_text)
        answer = answers[-1].strip() if answers else None
        score = float(_scorer(self.task)(answer, self.entry))
        return StepResult(observations=[], reward=score, done=True,
                          metrics={"reasoning_gym_answered": float(answer is not None),
                                   "reasoning_gym_score": score})
