"""Faults around checkpoints: a COMPLETE checkpoint that does not read back, and a save that fails.

Corrupt newest checkpoint + resume=auto: set aside (step_N.corrupt) with a warning naming the folder and the file,
and the previous complete checkpoint is loaded whole (checkpoint_verify.py says why that is bitwise safe); no
readable checkpoint at all, or an explicitly named corrupt one: a CorruptCheckpoint naming folder, file and what to
do, never DCP's stack trace. A failed save: a CheckpointSaveError naming the folder and the cause, its .tmp gone,
nothing pruned, and resume=auto still picks the previous complete checkpoint.
"""

from __future__ import annotations

import errno

import pytest
import torch

from skyrl_stepwise.trainer import checkpoint
from skyrl_stepwise.trainer.checkpoint import (CheckpointSaveError, CorruptCheckpoint, complete_checkpoints,
                                               lineage_entry, load_checkpoint, save_checkpoint, step_dir)
from skyrl_stepwise.trainer.checkpoint_verify import corrupt_cause, resume_checkpoint, verify_checkpoint
from skyrl_stepwise.trainer.driver_state import DRIVER_STATE, dump

from test_bitwise_resume import tiny_chat_model  # noqa: F401 (a fixture)
from test_checkpoint import _setup, _step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _two_checkpoints(root):
    """step_1 and step_2 of one lineage (keep 2), each with driver state; returns step_1's weights."""
    model, opt, sched = _setup()
    x = torch.randint(0, 128, (1, 8))
    lineage, weights = [], {}
    for step in (1, 2):
        _step(model, opt, sched, x)
        save_checkpoint(root, step, model, opt, sched, {"run_id": "r", "lineage": lineage}, max_to_keep=2,
                        files={DRIVER_STATE: dump([])})
        lineage.append(lineage_entry(step, "r"))
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


CORRUPTIONS = {  # name -> (damage done to step_2, the file the error must name)
    "truncated shard": (lambda d: _truncate(next((d / "dcp").glob("*.distcp"))), ".distcp"),
    "zero-byte shard": (lambda d: _truncate(next((d / "dcp").glob("*.distcp")), 0), ".distcp"),
    "zero-byte dcp metadata": (lambda d: _truncate(d / "dcp" / ".metadata", 0), "dcp/.metadata"),
    "garbled trainer_state.json": (lambda d: (d / "trainer_state.json").write_text('{"step": 2, "ru'),
                                   "trainer_state.json"),
    "garbled driver_state.pkl": (lambda d: (d / DRIVER_STATE).write_bytes(b"\x80\x05garbage" * 4), DRIVER_STATE),
    "missing rng file": (lambda d: (d / "rng_rank0.pt").unlink(), "rng_rank0.pt"),
}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_auto_resume_sets_a_corrupt_newest_checkpoint_aside_and_loads_the_previous_one_whole(tmp_path, damage):
    weights = _two_checkpoints(tmp_path)
    corrupt, names = CORRUPTIONS[damage]
    corrupt(step_dir(tmp_path, 2))
    with pytest.raises(CorruptCheckpoint, match=f"{step_dir(tmp_path, 2)}.*{names}"):
        verify_checkpoint(step_dir(tmp_path, 2))

    model, opt, sched = _setup(seed=7)
    warnings = []
    path, state = resume_checkpoint("auto", tmp_path, lambda p: load_checkpoint(p, model, opt, sched),
                                    warnings.append)
    assert path == step_dir(tmp_path, 1) and state["step"] == 1 and state["lineage"] == []
    assert all(torch.equal(v, weights[1][k]) for k, v in model.state_dict().items())
    assert "CORRUPT CHECKPOINT" in warnings[0] and str(step_dir(tmp_path, 2)) in warnings[0] and names in warnings[0]
    assert "step_2.corrupt" in warnings[0] and "resuming from" in warnings[1]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_1"]  # never picked again
    assert (tmp_path / "step_2.corrupt").is_dir()  # kept for inspection
    with pytest.raises(FileExistsError, match="step_2.corrupt"):  # a fresh run still refuses the folder
        checkpoint.check_fresh_start(tmp_path, "none", overwrite=False)


def test_a_load_that_fails_on_the_ranks_falls_back_too_and_all_corrupt_stops_loudly(tmp_path):
    _two_checkpoints(tmp_path)
    model, opt, sched = _setup(seed=7)
    # damage only the load can find (verification passed): raised on a Ray actor, it arrives as a RayTaskError
    from ray.exceptions import RayTaskError

    def load(path):
        if path.name == "step_2":
            cause = CorruptCheckpoint(f"checkpoint {path} ... dcp/")
            raise RayTaskError("call", "traceback", cause).as_instanceof_cause()
        return load_checkpoint(path, model, opt, sched)

    assert resume_checkpoint("auto", tmp_path, load, lambda msg: None)[1]["step"] == 1
    assert corrupt_cause(ValueError("x")) is None

    (step_dir(tmp_path, 1) / "trainer_state.json").write_text("")
    with pytest.raises(CorruptCheckpoint, match="no complete checkpoint in .* reads back.*step_1.*trainer_state.json"
                                                ".*trainer.resume=none trainer.overwrite_ckpt_dir=true"):
        resume_checkpoint("auto", tmp_path, load, lambda msg: None)  # never a silent fresh start


def test_an_explicitly_named_corrupt_checkpoint_is_refused_naming_the_previous_one(tmp_path):
    _two_checkpoints(tmp_path)
    _truncate(step_dir(tmp_path, 2) / "rng_rank0.pt")
    model, opt, sched = _setup(seed=7)
    with pytest.raises(CorruptCheckpoint, match=f"rng_rank0.pt.*point trainer.resume at {step_dir(tmp_path, 1)}"):
        resume_checkpoint(str(step_dir(tmp_path, 2)), tmp_path, lambda p: load_checkpoint(p, model, opt, sched))
    assert step_dir(tmp_path, 2).is_dir()  # what the user named is left where it is
    # and the ranks' own load, reached without the driver's check, names the file too (not a DCP traceback)
    with pytest.raises(CorruptCheckpoint, match="step_2/rng_rank0.pt cannot be read"):
        load_checkpoint(step_dir(tmp_path, 2), model, opt, sched)


@pytest.mark.parametrize("where", ["mkdir", "dcp", "small files", "rename"])
def test_a_failed_save_names_folder_and_cause_and_costs_no_older_checkpoint(tmp_path, monkeypatch, where):
    _two_checkpoints(tmp_path)
    model, opt, sched = _setup()

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = {"mkdir": (type(tmp_path), "mkdir"), "dcp": (checkpoint.dcp, "save"),
              "small files": (checkpoint.json, "dumps"), "rename": (checkpoint, "_mark_complete")}[where]
    monkeypatch.setattr(*target, enospc)
    lineage = [lineage_entry(1, "r"), lineage_entry(2, "r")]
    with pytest.raises(CheckpointSaveError, match=f"saving checkpoint {step_dir(tmp_path, 3)} failed.*No space left"
                                                  f".*latest complete checkpoint is {step_dir(tmp_path, 2)}"):
        save_checkpoint(tmp_path, 3, model, opt, sched, {"run_id": "r", "lineage": lineage}, max_to_keep=1)
    monkeypatch.undo()
    assert not (tmp_path / "step_3.tmp").exists() and not step_dir(tmp_path, 3).exists()  # gone: ENOSPC wants space
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_1", "step_2"]  # nothing pruned
    model2, opt2, sched2 = _setup(seed=7)
    assert resume_checkpoint("auto", tmp_path, lambda p: load_checkpoint(p, model2, opt2, sched2))[1]["step"] == 2


def test_a_resave_of_an_existing_step_keeps_the_old_one_until_the_new_one_is_written(tmp_path, monkeypatch):
    _two_checkpoints(tmp_path)  # e.g. resumed explicitly from step_1: step_2 is written again
    model, opt, sched = _setup()
    monkeypatch.setattr(checkpoint.dcp, "save", lambda *a, **k: (_ for _ in ()).throw(PermissionError("denied")))
    with pytest.raises(CheckpointSaveError, match="PermissionError: denied"):
        save_checkpoint(tmp_path, 2, model, opt, sched)
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_1", "step_2"]
    verify_checkpoint(step_dir(tmp_path, 2))


@pytest.mark.integration  # three launches of a tiny model (~60 s on 2 cores)
def test_a_run_whose_newest_checkpoint_is_corrupt_resumes_bitwise_from_the_previous_one(tmp_path, tiny_chat_model):
    """SIGKILL in step 4, step_3's shard truncated on disk: the relaunch (resume=auto) says so, continues from step_2
    and ends bit for bit where the uninterrupted run does (metrics, trained batches, final weights)."""
    from test_bitwise_resume import _run, _steps

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for d in (straight, killed):
        d.mkdir()
    assert _run(straight, tiny_chat_model, 4).returncode == 0
    assert _run(killed, tiny_chat_model, 4, kill_in_step=4).returncode == -9
    _truncate(next((killed / "ckpts" / "step_3" / "dcp").glob("*.distcp")))
    resumed = _run(killed, tiny_chat_model, 4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "CORRUPT CHECKPOINT" in resumed.stderr and "step_3/dcp/__0_0.distcp" in resumed.stderr
    assert "resumed from" in resumed.stdout and "step_2 at step 2" in resumed.stdout
    assert (killed / "ckpts" / "step_3.corrupt").is_dir()
    assert _steps(straight / "metrics.jsonl") == _steps(killed / "metrics.jsonl")
    assert _steps(straight / "batches.jsonl") == _steps(killed / "batches.jsonl")
    w1, w2 = torch.load(straight / "final_weights.pt"), torch.load(killed / "final_weights.pt")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
