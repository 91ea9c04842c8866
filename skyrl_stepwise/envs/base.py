"""The environment contract and a by-name registry, so each dataset row picks its env class."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from skyrl_stepwise.chat.base import ParsedTurn

Message = dict[str, str]
# An env's step metric, 1.0 when the episode's grading suspected a forgery attempt (envs/grading.py): the generator
# reports it under this name (the fraction of a step's episodes), not under environment/, and report.md shows it.
TAMPER_METRIC = "reward/tamper_suspected"


@dataclass
class StepResult:
    """What an env returns after one model action: observations are chat messages, never tokens."""

    observations: list[Message]
    reward: float
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)


class Env(Protocol):
    """One episode's state; a fresh instance per trajectory. An env holding a connection (envs/openenv.py) may also
    define `async def aclose(self)`: the generator calls it when the trajectory ends, however it ends."""

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Start an episode from the dataset row's prompt and `extra_info`; returns the messages the first prompt
        is rendered from (usually the prompt as given), so an env can add a system message or tools."""
        ...

    async def step(self, action_text: str) -> StepResult:
        """Act on the decoded text of one sampled turn; observations come back as messages, which the renderer
        turns into ids after the sampled ones."""
        ...


@runtime_checkable
class TurnEnv(Protocol):
    """An env that acts on the turn as parsed from the sampled ids (its tool calls, content and reasoning) rather
    than on the decoded text, so the calls it executes are exactly the calls the model sampled (envs/tool.py).
    The generator calls `step_turn` instead of `step` for it. An env may also offer `tool_schemas` (OpenAI function
    schemas), which the renderer shows the model."""

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]: ...

    async def step_turn(self, turn: ParsedTurn) -> StepResult:
        """Act on the turn parsed from the sampled ids (tool calls included); malformed calls are answered in
        the observations, never raised."""
        ...


EnvFactory = Callable[[], Env]


class EnvRegistry:
    """Maps a dataset row's `env_class` to a factory; unknown names fail loudly with the known ones."""

    def __init__(self) -> None:
        self._factories: dict[str, EnvFactory] = {}

    def register(self, name: str, factory: EnvFactory) -> None:
        """Add an env class; registering a name twice fails, so a plugin cannot silently replace a built-in."""
        if name in self._factories:
            raise ValueError(f"env class {name!r} is already registered")
        self._factories[name] = factory

    def make(self, name: str) -> Env:
        """A fresh env for one trajectory: envs hold episode state, so instances are never shared."""
        try:
            return self._factories[name]()
        except KeyError:
            raise KeyError(f"unknown env_class {name!r}; registered: {sorted(self._factories)} (a run adds its own "
                           "with environment.env_classes: {name: pkg.module:Class})") from None

    def names(self) -> list[str]:
        """The registered env classes, for config validation and error messages."""
        return sorted(self._factories)
