"""The key-door game of the credit benchmark: decided at turn 1, paid at turn 2 only."""

from __future__ import annotations

import pytest

from skyrl_stepwise.envs.key_door import KeyDoorEnv, key_door_prompt, picked_key

EXTRAS = {"extra_info": {"door_key": "green", "other_key": "red", "first_key": "red"}}


@pytest.mark.parametrize("pick, reward", [("Green", 1.0), ("the red key", 0.0), ("green, not red", 1.0), ("red or green", 0.0), ("?", 0.0)])
async def test_the_key_picked_at_turn_one_decides_the_reward_paid_at_turn_two(pick, reward):
    env = KeyDoorEnv()
    prompt = key_door_prompt("green")
    assert await env.reset(prompt, EXTRAS) == prompt and "green key" in prompt[0]["content"]
    greet = await env.step("Hello")
    assert not greet.done and greet.reward == 0.0
    assert "red and green" in greet.observations[0]["content"]  # first_key is shown first
    chosen = await env.step(pick)
    assert not chosen.done and chosen.reward == 0.0
    assert chosen.metrics["picked_door_key"] == reward
    door = await env.step("open")
    assert door.done and door.reward == reward and door.observations == []


async def test_bad_keys_are_rejected_with_the_row():
    with pytest.raises(ValueError, match="two different keys"):
        await KeyDoorEnv().reset([], {"extra_info": {"door_key": "red", "other_key": "red"}})
    assert picked_key("BLUE!", ("red", "blue")) == "blue" and picked_key("blueish", ("red", "blue")) is None
