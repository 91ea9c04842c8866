"""A small multi-turn env a 135M model can learn: say the target word, every turn, for N turns.

Used by the integration tests (real engine, several turns) and the reward-learning benchmark.
"""

from __future__ import annotations

from typing import Any

from skyrl_stepwise.envs.base import Message, StepResult


class KeywordEnv:
    """Reward 1.0 on the last turn if the model's last answer contains the target word, else 0."""

    def __init__(self) -> None:
        self.turn = 0
        self.turns = 3
        self.target = "blue"

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        spec_targets = extras.get("reward_spec", {}).get("ground_truth", {}).get("target") or [self.target]
        self.target = str(extras.get("target", spec_targets[0])).lower()
        self.turns = int(extras.get("turns", extras.get("max_turns", self.turns)))
        self.turn = 0
        return list(prompt_messages)

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        hit = self.target in action_text.lower()
        done = self.turn >= self.turns
        observation = [{"role": "user", "content": f"Turn {self.turn + 1}: say the word {self.target}."}]
        return StepResult(observations=[] if done else observation, reward=float(hit) if done else 0.0,
                          done=done, metrics={"keyword_hit": float(hit)})
