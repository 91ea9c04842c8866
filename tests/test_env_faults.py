"""Faults at the end of an episode, contained per trajectory (scripted engine, real SmolLM2 tokenizer).

A reward function raising in the final step fails that trajectory (counted under env_step, never trained on a made-up
reward); if every trajectory of the batch fails, the batch stops naming the cause. An env whose `aclose` raises (or
is not even awaitable) keeps its trajectory, whose reward came from completed steps, and the close failure is
counted in generate/env_close_errors. A hung env call (step or close) is bounded by generator.env_timeout_s instead
of hanging the batch forever.
"""

from __future__ import annotations

import asyncio

import pytest

from skyrl_stepwise.envs.base import StepResult
from test_generator import PROMPT, ScriptedEnv, canonical, make_generator
from skyrl_stepwise.generator import TrajectoryID


class CloseRaises(ScriptedEnv):
    async def aclose(self):
        raise RuntimeError("close failed")


class SyncClose(ScriptedEnv):
    def aclose(self):  # not a coroutine: awaiting its None is itself an error
        return None


class CloseHangs(ScriptedEnv):
    async def aclose(self):
        await asyncio.sleep(3600)


class RewardRaisesAtTheEnd(ScriptedEnv):
    async def step(self, action_text):
        result = await super().step(action_text)
        if result.done:
            raise ZeroDivisionError("reward function failed")
        return result


class StepHangs(ScriptedEnv):
    async def step(self, action_text):
        await asyncio.sleep(3600)
        return StepResult([], 0.0, True)


def _generator(tokenizer, envs: list, **overrides):
    gen, _, _ = make_generator(tokenizer, lambda p, s, i: canonical(tokenizer, "<search> x </search>"), turns=2,
                               **overrides)
    made = iter(envs)
    gen.env_registry._factories["scripted"] = lambda: next(made)  # the registry refuses a second register
    return gen


async def _run(gen, n):
    return await asyncio.wait_for(gen.generate([PROMPT] * n, ["scripted"] * n, [{}] * n,
                                               [TrajectoryID("q0", i) for i in range(n)]), 30)


@pytest.mark.parametrize("env_class", [CloseRaises, SyncClose])
async def test_a_failing_close_keeps_the_trajectory_and_is_counted(tokenizer, env_class):
    out = await _run(_generator(tokenizer, [env_class(2), ScriptedEnv(2)]), 2)
    assert out.failed_trajectory_ids == [] and len(out) == 4  # 2 trajectories x 2 steps, rewards from the steps
    assert out.rollout_metrics["generate/env_close_errors"] == 1
    assert out.rollout_metrics["generate/trajectory_reward_mean"] == 1.0


async def test_a_reward_function_raising_at_the_end_fails_only_its_trajectory_and_all_failing_stops(tokenizer):
    out = await _run(_generator(tokenizer, [RewardRaisesAtTheEnd(2), ScriptedEnv(2)]), 2)
    assert out.failed_trajectory_ids == [TrajectoryID("q0", 0)] and len(out) == 2  # only the good one's 2 steps
    assert out.rollout_metrics["generate/failed_trajectories/env_step"] == 1
    with pytest.raises(RuntimeError, match="every trajectory of the batch failed.*ZeroDivisionError"):
        await _run(_generator(tokenizer, [RewardRaisesAtTheEnd(2), RewardRaisesAtTheEnd(2)]), 2)


async def test_a_hung_env_call_is_bounded_by_env_timeout_s(tokenizer):
    out = await _run(_generator(tokenizer, [StepHangs(2), CloseHangs(2), ScriptedEnv(2)], env_timeout_s=0.5), 3)
    assert out.failed_trajectory_ids == [TrajectoryID("q0", 0)]  # the hung step: failed, not trained
    assert out.rollout_metrics["generate/failed_trajectories/env_step"] == 1
    assert out.rollout_metrics["generate/env_close_errors"] == 1  # the hung close: abandoned, its samples stand
    assert len(out) == 4


def test_env_timeout_s_is_validated():
    from skyrl_stepwise.generator import GeneratorConfig

    with pytest.raises(ValueError, match="generator.env_timeout_s"):
        GeneratorConfig(env_timeout_s=0).validate()
    GeneratorConfig(env_timeout_s=None).validate()


async def test_the_gateway_scorer_checks_the_reward_and_releases_the_env():
    """An agent program's final answer scored by the row's env: a NaN reward is refused (the session fails as
    agent_error, never trained on), and the env's aclose runs however scoring ended."""
    from types import SimpleNamespace

    from skyrl_stepwise.envs.base import EnvRegistry
    from skyrl_stepwise.envs.contract import EnvOutputError
    from skyrl_stepwise.gateway.rollout import AgentProgramGenerator

    closed = []

    class Scorer(ScriptedEnv):
        def __init__(self, reward):
            super().__init__(1)
            self.reward = reward

        async def step(self, action_text):
            return StepResult([], self.reward, True)

        async def aclose(self):
            closed.append(self.reward)

    registry = EnvRegistry()
    registry.register("nan", lambda: Scorer(float("nan")))
    registry.register("ok", lambda: Scorer(0.5))
    rollout = SimpleNamespace(env_registry=registry)
    session = SimpleNamespace(calls=[SimpleNamespace(reply={"content": "5"})])
    assert await AgentProgramGenerator._score(rollout, "ok", PROMPT, {}, session) == 0.5
    with pytest.raises(EnvOutputError, match="reward"):
        await AgentProgramGenerator._score(rollout, "nan", PROMPT, {}, session)
    assert len(closed) == 2
