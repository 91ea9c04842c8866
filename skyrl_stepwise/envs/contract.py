"""The env contract checked where env output enters the generator: what `reset` and `step` return.

An env is user code (a plugin); what it returns becomes rewards and prompts. A NaN reward would reach every
advantage of its group and make the step's gradient non-finite (the whole step skipped); an observation whose
content is not text fails later inside the chat template, reported as the template's fault. Checked here instead,
each mistake names the env class and the field, and fails that trajectory only (generator/agent_loop.py).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from skyrl_stepwise.envs.base import StepResult


class EnvOutputError(ValueError):
    """An env returned something outside the contract; the message names the env class, the method and the field."""


def env_name(env: Any) -> str:
    """The env's class as a user would look it up: module and class name."""
    cls = type(env)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_messages(messages: Any, where: str) -> list[dict]:
    """Chat messages as the renderer needs them: a list of {'role': str, 'content': str} dicts (an assistant message
    carrying tool_calls may have content None). `where` names the env and the field, e.g. 'MyEnv.step observations'."""
    if not isinstance(messages, list):
        raise EnvOutputError(f"{where} must be a list of chat messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise EnvOutputError(f"{where}[{i}] must be a dict {{'role': str, 'content': str}}, got "
                                 f"{type(message).__name__}: {str(message)[:80]!r}")
        if not isinstance(message.get("role"), str):
            raise EnvOutputError(f"{where}[{i}]['role'] must be a string, got {message.get('role')!r}")
        content = message.get("content")
        if isinstance(content, str) or (content is None and message.get("tool_calls")):
            continue
        raise EnvOutputError(f"{where}[{i}]['content'] must be a string, got {type(content).__name__}: "
                             f"{str(content)[:80]!r}")
    return messages


def check_reward(reward: Any, where: str) -> float:
    """A reward as a finite float: a NaN or inf would poison its group's advantages and the step's gradient."""
    if isinstance(reward, (str, bytes)) or reward is None:
        raise EnvOutputError(f"{where} must be a real number, got {type(reward).__name__}: {reward!r}")
    try:
        value = float(reward)
    except (TypeError, ValueError):
        raise EnvOutputError(f"{where} must be a real number, got {type(reward).__name__}: {reward!r}") from None
    if not math.isfinite(value):
        raise EnvOutputError(f"{where} is {value}, not a finite number; the trajectory is failed, not trained")
    return value


def check_step_result(result: Any, env: Any, method: str = "step") -> StepResult:
    """A `StepResult` whose observations are chat messages, reward a finite number and metrics numbers."""
    name = f"{env_name(env)}.{method}"
    if not isinstance(result, StepResult):
        raise EnvOutputError(f"{name} must return a StepResult, got {type(result).__name__}")
    check_messages(result.observations, f"{name} observations")
    check_reward(result.reward, f"{name} reward")
    if not isinstance(result.metrics, dict):
        raise EnvOutputError(f"{name} metrics must be a dict of numbers, got {type(result.metrics).__name__}")
    for key, value in result.metrics.items():
        if not isinstance(value, numbers.Real):
            raise EnvOutputError(f"{name} metrics[{key!r}] must be a number, got {type(value).__name__}: {value!r}")
    return result
