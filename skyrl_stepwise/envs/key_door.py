"""A three-turn text game whose outcome is decided at the middle turn and paid only at the end: credit matters.

Turn 0: the model reads which key opens the door and greets the guard (any answer; it changes nothing).
Turn 1: it picks one of two keys (the decision). Turn 2: it tries the door; reward 1.0 if it holds the right
key, else 0. Only turn 1 decides the reward, yet the reward arrives after turn 2: outcome advantages credit all
three turns alike, per-step credit (trainer.algorithm.step_advantage) can single out turn 1. SmolLM2-135M learns
it on CPU in a few steps (benchmarks/credit_learning.py). The row's extra_info picks the keys:
`{"door_key": "red", "other_key": "blue"}` (order shown to the model: extra_info.first_key, default door_key).
"""

from __future__ import annotations

import re
from typing import Any

from skyrl_stepwise.envs.base import Message, StepResult

COLOURS = ("red", "blue", "green", "yellow", "white", "black")
TURNS = 3


def key_door_prompt(door_key: str) -> list[Message]:
    """The first user message: the door's key is stated here, to be recalled at turn 1."""
    return [{"role": "user", "content": f"A locked door. A sign says: only the {door_key} key opens it. "
                                        f"Greet the guard."}]


def picked_key(action_text: str, options: tuple[str, str]) -> str | None:
    """The first of the two keys the action names (whole words, any case), or None: a 135M model rarely answers
    with a bare colour, so the first one it names is the one it takes."""
    for word in re.findall(r"[a-z]+", action_text.lower()):
        if word in options:
            return word
    return None


class KeyDoorEnv:
    """One episode: greet, pick a key, try the door; reward on the last turn only, decided at turn 1."""

    def __init__(self) -> None:
        self.turn = 0
        self.door_key, self.other_key, self.first_key = "red", "blue", "red"
        self.held: str | None = None

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Read the two keys from extra_info; the prompt passes through (key_door_prompt builds one)."""
        info = extras.get("extra_info") or {}
        self.door_key = str(info.get("door_key", self.door_key)).lower()
        self.other_key = str(info.get("other_key", self.other_key)).lower()
        self.first_key = str(info.get("first_key", self.door_key)).lower()
        if self.door_key == self.other_key or {self.first_key} - {self.door_key, self.other_key}:
            raise ValueError(f"key_door env: extra_info needs two different keys (door_key, other_key) and first_key "
                             f"among them, got {info}")
        self.turn, self.held = 0, None
        return list(prompt_messages)

    async def step(self, action_text: str) -> StepResult:
        """Turn 0 -> the key room; turn 1 -> the chosen key is kept; turn 2 -> the door opens or not (done)."""
        self.turn += 1
        if self.turn == 1:
            keys = (self.first_key, self.other_key if self.first_key == self.door_key else self.door_key)
            text = f"Two keys: {keys[0]} and {keys[1]}. Which key opens the door, {keys[0]} or {keys[1]}?"
            return StepResult([{"role": "user", "content": text}], 0.0, False)
        if self.turn == 2:
            self.held = picked_key(action_text, (self.door_key, self.other_key))
            text = "You take it to the door. Say open."
            return StepResult([{"role": "user", "content": text}], 0.0, False,
                              {"picked_door_key": float(self.held == self.door_key),
                               "picked_no_key": float(self.held is None)})
        opened = self.held == self.door_key
        return StepResult([], float(opened), True, {"door_opened": float(opened)})
