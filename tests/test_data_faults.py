"""The dataset between a crash and its relaunch: rows that changed stop the resume naming data.train_path (the data
position would silently draw other prompts); a file gone or unreadable stops the launch naming it. Within a launch the
rows are read once, so a file that disappears between epochs changes nothing (the loader's later epochs use them)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from skyrl_stepwise.data.dataset import PromptRow, load_prompt_dataset, write_parquet
from skyrl_stepwise.checkpoint.data_fingerprint import check_same_data, data_fingerprint
from skyrl_stepwise.loop.loop import PromptLoader
from test_rollout_ahead import _trainer


def _rows(n=4, tweak=""):
    return [PromptRow(prompt=[{"role": "user", "content": f"Question {i}?{tweak if i == 2 else ''}"}],
                      env_class="one", reward_spec={}, data_source="toy", instance_id=f"q{i}") for i in range(n)]


def test_the_fingerprint_sees_any_change_of_the_rows_and_only_that():
    base = data_fingerprint(_rows())
    assert base == data_fingerprint(_rows()) and base["rows"] == 4
    assert data_fingerprint(_rows(tweak=" ")) != base  # one prompt edited
    assert data_fingerprint(_rows(5)) != base and data_fingerprint(_rows()[::-1]) != base  # grown, re-ordered
    warnings = []
    check_same_data(None, base, "ck/step_2", "t.parquet", False, warnings.append)  # an older checkpoint: unchecked
    with pytest.raises(ValueError, match=r"checkpoint ck/step_2.*data.train_path='t.parquet' now has 5 rows.*had 4"
                                         r".*trainer.resume_allow_changes=true"):
        check_same_data(base, data_fingerprint(_rows(5)), "ck/step_2", "t.parquet", False, warnings.append)
    check_same_data(base, data_fingerprint(_rows(5)), "ck/step_2", "t.parquet", True, warnings.append)
    assert len(warnings) == 1 and "continuing" in warnings[0]


async def test_a_resume_on_other_rows_stops_before_training_and_checkpoints_carry_the_fingerprint(
        tokenizer, tmp_path, monkeypatch, caplog):
    from skyrl_stepwise.loop import loop

    trainer, _, policy = _trainer(tokenizer, tmp_path, max_staleness=0)
    trainer.cfg.data.train_path = "train.parquet"
    other = data_fingerprint(_rows(5))
    monkeypatch.setattr(loop, "resume_checkpoint", lambda *a: (Path("ckpts/step_2"), {"step": 2, "data": other}))
    with pytest.raises(ValueError, match="training rows differ from those checkpoint ckpts/step_2.*train.parquet"):
        await trainer.fit()
    assert policy.trained_steps == []

    trainer.cfg.trainer.resume_allow_changes = True
    trainer.cfg.trainer.ckpt_interval = 2
    saved = []
    original = policy.call
    policy.call = lambda method, *args: \
        saved.append(args[1]) if method == "save_checkpoint" else original(method, *args)
    with caplog.at_level(logging.WARNING):
        await trainer.fit()
    assert "continuing: trainer.resume_allow_changes=true" in caplog.text
    assert policy.trained_steps == ["train2", "train3"]
    assert saved[-1]["data"] == data_fingerprint(trainer.loader.rows)  # what the next resume checks against


def test_a_dataset_file_gone_after_loading_changes_no_epoch_and_gone_at_relaunch_is_named(tmp_path):
    path = tmp_path / "train.parquet"
    write_parquet([{"prompt": r.prompt, "env_class": r.env_class, "reward_spec": {"ground_truth": "x"},
                    "data_source": r.data_source, "extra_info": {"k": 1}, "instance_id": r.instance_id}
                   for r in _rows()], path)
    loader = PromptLoader(load_prompt_dataset(path), 2, seed=3)
    first = [[r.instance_id for r in loader.batch(i)] for i in range(6)]  # three epochs
    path.unlink()
    assert [[r.instance_id for r in loader.batch(i)] for i in range(6)] == first
    with pytest.raises(FileNotFoundError, match=f"dataset file '{path}' does not exist"):
        load_prompt_dataset(path)
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="train.parquet: not a readable parquet file"):
        load_prompt_dataset(path)
