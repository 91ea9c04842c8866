"""reasoning-gym tasks as data and reward: rows from the real package, scored by the task's own scorer."""

from __future__ import annotations

import json

import pytest

from skyrl_stepwise.data.dataset import load_prompt_dataset
from skyrl_stepwise.data.reasoning_gym import TaskSpec, cached_task_file, main, parse_spec, task_rows
from skyrl_stepwise.envs.builtin import build_env_registry
from skyrl_stepwise.envs.reasoning_gym import ReasoningGymEnv


async def _score(row, text: str):
    env = ReasoningGymEnv()
    await env.reset(row.prompt, row.env_extras())
    return await env.step(text)


async def test_rows_are_scored_by_the_tasks_own_scorer(tmp_path):
    assert main(["--task", "chain_sum", "--size", "4", "--val-size", "2", "--seed", "1", "--out", str(tmp_path)]) == 0
    train = load_prompt_dataset(tmp_path / "train.parquet")
    val = load_prompt_dataset(tmp_path / "validation.parquet")
    assert (len(train), len(val)) == (4, 2) and train[0].env_class == "reasoning_gym"
    assert {r.instance_id for r in train}.isdisjoint(r.instance_id for r in val)
    row = train[0]
    entry = json.loads(row.reward_spec["entry"])
    assert row.prompt[-1]["content"] == entry["question"]
    right = await _score(row, f"Adding up. <answer>{entry['answer']}</answer>")
    assert right.done and right.reward == 1.0 and right.metrics["reasoning_gym_answered"] == 1.0
    wrong = await _score(row, f"<answer>{int(entry['answer']) + 1}</answer>")
    assert wrong.reward == 0.0
    missing = await _score(row, entry["answer"])  # no <answer> tags: no answer, the task's scorer gives 0
    assert missing.reward == 0.0 and missing.metrics["reasoning_gym_answered"] == 0.0


def test_unknown_task_fails_naming_the_key_and_close_names(capsys):
    with pytest.raises(ValueError, match=r"data.train_path: unknown reasoning-gym task 'chain_summ'.*chain_sum"):
        parse_spec("reasoning_gym:chain_summ:10", "data.train_path")
    assert main(["--task", "chain_summ"]) == 2
    assert "--task: unknown reasoning-gym task" in capsys.readouterr().err
    with pytest.raises(ValueError, match="SIZE and SEED must be integers"):
        parse_spec("reasoning_gym:chain_sum:ten", "data.val_path")


def test_run_spec_builds_a_cached_file_and_the_env_is_registered(tmp_path):
    spec = parse_spec("reasoning_gym:basic_arithmetic:3:5", "data.train_path")
    assert spec == TaskSpec("basic_arithmetic", 3, 5)
    path = cached_task_file(spec, tmp_path)
    stamp = path.stat().st_mtime_ns
    assert cached_task_file(spec, tmp_path).stat().st_mtime_ns == stamp  # generated once
    assert [r["instance_id"] for r in task_rows(spec)] == [r.instance_id for r in load_prompt_dataset(path)]
    from skyrl_stepwise.config import EnvironmentConfig

    assert "reasoning_gym" in build_env_registry(EnvironmentConfig()).names()


async def test_a_scorer_that_crashes_is_raised_not_scored_zero(monkeypatch):
    import skyrl_stepwise.envs.reasoning_gym as module

    row = load_prompt_dataset_row()
    monkeypatch.setattr(module, "_scorer", lambda task: (lambda answer, entry: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        await _score(row, "<answer>1</answer>")


def load_prompt_dataset_row():
    from skyrl_stepwise.data.dataset import PromptRow

    r = task_rows(TaskSpec("chain_sum", 1, 0))[0]
    return PromptRow(r["prompt"], r["env_class"], r["reward_spec"], r["data_source"], r["extra_info"], r["instance_id"])
