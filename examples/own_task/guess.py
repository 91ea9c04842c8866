"""A multi-turn env of your own: guess the number. Registered by name from the command line or a recipe:

    +environment.env_classes.guess=guess:GuessEnv        (this folder on PYTHONPATH)

An env is any class with `async reset(prompt_messages, extras) -> messages` and `async step(action_text) ->
StepResult`; a fresh instance plays each trajectory. `extras` holds the dataset row's `reward_spec`, `extra_info`
and the generator's `max_turns`.
"""

from __future__ import annotations

import re

from skyrl_stepwise.envs.base import StepResult


class GuessEnv:
    """The model guesses a number; the env answers "higher" or "lower" until it is right or the turns run out.
    Reward 1.0 for the right number, else 0."""

    async def reset(self, prompt_messages, extras):
        self.target = int(extras["reward_spec"]["ground_truth"]["target"][0])
        self.max_turns = int(extras.get("max_turns", 3))
        self.turn = 0
        return list(prompt_messages)

    async def step(self, action_text):
        self.turn += 1
        numbers = re.findall(r"-?\d+", action_text)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.target:
            return StepResult([], 1.0, True, {"guessed": 1.0, "turns": float(self.turn)})
        if self.turn >= self.max_turns:
            return StepResult([], 0.0, True, {"guessed": 0.0, "turns": float(self.turn)})
        hint = "Say a number." if guess is None else ("Higher." if guess < self.target else "Lower.")
        return StepResult([{"role": "user", "content": f"{hint} Guess again."}], 0.0, False)
