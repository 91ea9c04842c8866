"""reasoning-gym tasks as data and reward: rows from the real package, scored by the task's own scorer."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from skyrl_stepwise.data.dataset import load_prompt_dataset
from skyrl_stepwise.data.reasoning_gym import (NEEDS_CONFIG, TaskSpec, cached_task_file, check_task, decode_entry,
                                               encode_entry, main, parse_spec, task_names, task_rows)
from skyrl_stepwise.envs.builtin import build_env_registry
from skyrl_stepwise.envs.reasoning_gym import ReasoningGymEnv


async def _score(row, text: str):
    env = ReasoningGymEnv()
    await env.reset(row.prompt, row.env_extras())
    return await env.step(text)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_rows_are_scored_by_the_tasks_own_scorer(tmp_path):
    assert main(["--task", "chain_sum", "--size", "4", "--val-size", "2", "--seed", "1", "--out", str(tmp_path)]) == 0
    train = load_prompt_dataset(tmp_path / "train.parquet")
    val = load_prompt_dataset(tmp_path / "validation.parquet")
    assert (len(train), len(val)) == (4, 2) and train[0].env_class == "reasoning_gym"
    assert {r.instance_id for r in train}.isdisjoint(r.instance_id for r in val)
    row = train[0]
    entry = decode_entry(row.reward_spec["entry"])
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
    from skyrl_stepwise.run.config import EnvironmentConfig

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


def _row(r: dict):
    from skyrl_stepwise.data.dataset import PromptRow

    return PromptRow(r["prompt"], r["env_class"], r["reward_spec"], r["data_source"], r["extra_info"], r["instance_id"])


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("task", ["arc_agi", "rearc"])
async def test_grid_tasks_score_the_right_grid_one_through_the_env(task, tmp_path):
    """Grids are tuples of tuples: stored as plain JSON they came back as lists, and the right grid scored 0.05 in
    the env, the same as an all-zero grid, while the task's own scorer gives it 1.0."""
    import reasoning_gym

    original = reasoning_gym.create_dataset(task, size=1, seed=3)[0]
    row = load_prompt_dataset(cached_task_file(TaskSpec(task, 1, 3), tmp_path))[0]  # through parquet, as a run does
    right = await _score(row, f"<answer>{original['answer']}</answer>")
    assert right.reward == 1.0 == reasoning_gym.get_score_answer_fn(task)(original["answer"], original)
    zeros = "\n".join(" ".join("0" for _ in line.split()) for line in original["answer"].splitlines())
    assert (await _score(row, f"<answer>{zeros}</answer>")).reward < 1.0


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_every_registered_task_keeps_its_entry_and_its_score(monkeypatch):
    """Every task reasoning-gym registers (2 entries each): the env restores an entry equal to the one generated for
    the row, and the task's own answer scores there exactly as on it. The only task skipped is one
    `create_dataset(name, size, seed)` cannot build, refused by name with its reason (NEEDS_CONFIG). The entries are
    recorded as task_rows generates them: some tasks (list_functions) do not regenerate the same entry twice."""
    import reasoning_gym

    generated: dict[int, dict] = {}
    create = reasoning_gym.create_dataset

    class Recorded:
        def __init__(self, dataset):
            self.dataset = dataset

        def __getitem__(self, i):
            generated[i] = self.dataset[i]
            return generated[i]

    monkeypatch.setattr(reasoning_gym, "create_dataset", lambda *a, **k: Recorded(create(*a, **k)))
    assert set(NEEDS_CONFIG) <= set(task_names()) and len(task_names()) > 100
    for task in task_names():
        if task in NEEDS_CONFIG:
            with pytest.raises(ValueError, match=f"task {task!r} cannot be built from a name, size and seed"):
                check_task(task)
            continue
        score = reasoning_gym.get_score_answer_fn(task)
        generated.clear()
        for i, r in enumerate(task_rows(TaskSpec(task, 2, 0))):
            original = generated[i]
            env = ReasoningGymEnv()
            await env.reset(r["prompt"], _row(r).env_extras())
            answer = None if original["answer"] is None else str(original["answer"])
            assert env.entry == original, task
            assert score(answer, env.entry) == score(answer, original), task


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_task_whose_entry_is_not_kept_faithfully_is_refused_by_name(monkeypatch, tmp_path, capsys):
    """The build-time check: with the old lossy storage arc_agi's own answer scores 0.05 on the stored entry (1.0 on
    the generated one), so its rows are refused naming the task, and no file is written; a value that cannot be
    stored at all is refused the same way, never stored as its repr."""
    import skyrl_stepwise.data.reasoning_gym as module

    monkeypatch.setattr(module, "encode_entry", lambda entry: json.dumps(entry, default=str))
    with pytest.raises(ValueError, match=r"task 'arc_agi': entry 0 is not kept faithfully \(its own answer scores "
                                         r"1.0 on the generated entry, 0.05 on the stored one"):
        task_rows(TaskSpec("arc_agi", 1, 0))
    assert main(["--task", "arc_agi", "--size", "1", "--val-size", "1", "--out", str(tmp_path / "out")]) == 2
    assert "task 'arc_agi'" in capsys.readouterr().err and not (tmp_path / "out").exists()
    monkeypatch.undo()
    with pytest.raises(TypeError, match=r"entry.metadata.when: a value of type object cannot be stored losslessly"):
        encode_entry({"question": "q", "metadata": {"when": object()}})


def test_the_encoding_round_trips_what_entries_hold():
    entry = {"grid": ((1, 2), (3, 4)), "colors": {0: "red", 1: "blue"}, "seen": {(1, 2), (3, 4)},
             "fixed": frozenset({"a"}), "raw": b"\x00\xff", "__rg_type__": "x", "plain": [1.5, None, True, "s"],
             "nested": [{(1,): [()]}], "share": Fraction(3, 4)}
    restored = decode_entry(encode_entry(entry))
    assert restored == entry and type(restored["grid"][0]) is tuple and type(restored["fixed"]) is frozenset
    assert type(restored["share"]) is Fraction
    task_rows(TaskSpec("gsm_symbolic", 8, 0))  # its entry 7 holds a Fraction: refused before it could be stored


async def test_a_row_stored_by_the_lossy_version_asks_for_a_rebuild():
    r = task_rows(TaskSpec("chain_sum", 1, 0))[0]
    del r["reward_spec"]["entry_encoding"]
    r["reward_spec"]["entry"] = json.dumps(json.loads(r["reward_spec"]["entry"]))
    with pytest.raises(ValueError, match=r"instance 'chain_sum-0-0': .*older, lossy version; rebuild the rows"):
        await _score(_row(r), "<answer>1</answer>")


def test_list_prints_every_registered_task(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == task_names() and "chain_sum" in out
    assert any(line.startswith("composite  (not buildable: ") for line in out)
    with pytest.raises(SystemExit):
        main([])  # neither --task nor --list
    assert "--task is required (--list shows the tasks)" in capsys.readouterr().err
