"""The environment contract and a by-name registry, so each dataset row picks its env class."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from skyrl_stepwise.chat.base import ParsedTurn

Message = dict[str, str]


@dataclass
class StepResult:
    """What an env returns after one model action: observations are chat messages, never tokens."""

    observations: list[Message]
    reward: float
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)


class Env(Protocol):
    """One episode's state; a fresh instance per trajectory."""

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]: ...

    async def step(self, action_text: str) -> StepResult: ...


@runtime_checkable
class TurnEnv(Protocol):
    """An env that acts on the turn as parsed from the sampled ids (its tool calls, content and reasoning) rather
    than on the decoded text, so the calls it executes are exactly the calls the model sampled (envs/tool.py).
    The generator calls `step_turn` instead of `step` for it. An env may also offer `tool_schemas` (OpenAI function
    schemas), which the renderer shows the model."""

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]: ...

    async def step_turn(self, turn: ParsedTurn) -> StepResult: ...


EnvFactory = Callable[[], Env]


class EnvRegistry:
    """Maps a dataset row's `env_class` to a factory; unknown names fail loudly with the known ones."""

    def __init__(self) -> None:
        self._factories: dict[str, EnvFactory] = {}

    def register(self, name: str, factory: EnvFactory) -> None:
        if name in self._factories:
            raise ValueError(f"env class {name!r} is already registered")
        self._factories[name] = factory

    def make(self, name: str) -> Env:
        try:
            return self._factories[name]()
        except KeyError:
            raise KeyError(f"unknown env_class {name!r}; registered: {sorted(self._factories)}") from None

    def names(self) -> list[str]:
        return sorted(self._factories)
