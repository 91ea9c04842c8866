"""A reasoning-gym row scored by the task's own scorer: one turn, the last `<answer>...</answer>` is the answer.

A missing answer scores what the task's scorer gives `None` (0 for every task): the model produced no answer, a
real outcome. A scorer that raises is not an outcome: the error propagates and the generator drops the trajectory
(counted), so no made-up reward is trained.
"""

from __future__ import annotations

from typing import Any, Callable

from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.envs.rewards import ANSWER_RE


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
        from skyrl_stepwise.data.reasoning_gym import ENTRY_ENCODING, decode_entry

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
