"""Faults around checkpoints: a COMPLETE checkpoint that does not read back, and a save that fails.

Corrupt newest checkpoint + resume=auto: set aside (step_N.corrupt) with a warning naming the folder and the file,
and the previous complete checkpoint is loaded whole (skyrl_stepwise/checkpoint/verify.py says why that is bitwise safe); no
readable checkpoint at all, or an explicitly named corrupt one: a CorruptCheckpoint naming folder, file and what to
do, never DCP's stack trace. A failed save: a CheckpointSaveError naming the folder and the cause, its .tmp gone,
nothing pruned, and resume=auto still picks the previous complete checkpoint.
"""

from __future__ import annotations

import errno

import pytest
import torch

from skyrl_stepwise.checkpoint import store as checkpoint
from skyrl_stepwise.checkpoint.store import (CheckpointSaveError, CorruptCheckpoint, complete_checkpoints,
                                               lineage_entry, load_checkpoint, save_checkpoint, step_dir)
from skyrl_stepwise.checkpoint.verify import corrupt_cause, resume_checkpoint, verify_checkpoint
from skyrl_stepwise.checkpoint.driver_state import DRIVER_STATE, dump

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


def _flip_byte(path, at=0.5):
    """One byte changed in place, the size unchanged: what a failing disk or a bad copy leaves."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x40
    path.write_bytes(bytes(data))


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
    "one byte flipped inside a shard": (lambda d: _flip_byte(next((d / "dcp").glob("*.distcp"))), ".distcp"),
    "one byte flipped inside the scheduler state": (lambda d: _flip_byte(d / "scheduler.pt", 0.9), "scheduler.pt"),
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


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
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


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
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


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_resave_of_an_existing_step_keeps_the_old_one_until_the_new_one_is_written(tmp_path, monkeypatch):
    _two_checkpoints(tmp_path)  # e.g. resumed explicitly from step_1: step_2 is written again
    model, opt, sched = _setup()
    monkeypatch.setattr(checkpoint.dcp, "save", lambda *a, **k: (_ for _ in ()).throw(PermissionError("denied")))
    with pytest.raises(CheckpointSaveError, match="PermissionError: denied"):
        save_checkpoint(tmp_path, 2, model, opt, sched)
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_1", "step_2"]
    verify_checkpoint(step_dir(tmp_path, 2))


@pytest.mark.integration  # two launches of a tiny model, and the session's straight run (~40 s on 2 cores)
def test_a_run_whose_newest_checkpoint_is_corrupt_resumes_bitwise_from_the_previous_one(tmp_path, tiny_chat_model,
                                                                                         straight_resume_run):
    """SIGKILL in step 4, step_3's shard truncated on disk: the relaunch (resume=auto) says so, continues from step_2
    and ends bit for bit where the uninterrupted run does (metrics, trained batches, final weights)."""
    from test_bitwise_resume import _run, _steps

    killed = tmp_path / "killed"
    killed.mkdir()
    assert _run(killed, tiny_chat_model, 4, kill_in_step=4).returncode == -9
    straight = straight_resume_run.out  # the same 4 uninterrupted steps the bitwise-resume test compares with
    assert straight_resume_run.result().returncode == 0
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


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_flipped_exponent_byte_in_a_weight_is_found_before_the_load_and_resume_falls_back(tmp_path):
    """A weight saved as 4.5 whose exponent byte flips on disk reads back as ~1e-38: same size, a shard DCP loads
    without a word. The manifest's content hash finds it before anything loads; resume=auto sets the checkpoint
    aside and continues from the previous one, whole."""
    import struct

    weights = _two_checkpoints(tmp_path)
    shard = next((step_dir(tmp_path, 2) / "dcp").glob("*.distcp"))
    value = weights[2]["model.norm.weight"][0].item()
    data = bytearray(shard.read_bytes())
    at = data.find(struct.pack("<f", value) + struct.pack("<f", weights[2]["model.norm.weight"][1].item()))
    assert at > 0
    data[at + 3] = 0x00  # the sign/exponent byte: 4.5 -> ~1e-38
    shard.write_bytes(bytes(data))
    model, opt, sched = _setup(seed=7)
    load_checkpoint(step_dir(tmp_path, 2), model, opt, sched)  # DCP itself reads the damaged weight happily
    assert model.state_dict()["model.norm.weight"][0].item() != value

    with pytest.raises(CorruptCheckpoint, match=r"step_2/dcp/__0_0.distcp cannot be read .*content differs"):
        verify_checkpoint(step_dir(tmp_path, 2))
    warnings = []
    path, state = resume_checkpoint("auto", tmp_path, lambda p: load_checkpoint(p, model, opt, sched),
                                    warnings.append)
    assert path == step_dir(tmp_path, 1) and state["step"] == 1
    assert all(torch.equal(v, weights[1][k]) for k, v in model.state_dict().items())
    assert "CORRUPT CHECKPOINT" in warnings[0] and ".distcp" in warnings[0]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_checkpoint_saved_before_content_hashes_still_loads_and_says_so(tmp_path, caplog):
    """A MANIFEST of sizes only (what saves wrote before content hashes) is still checked for sizes and loads, with a
    log line saying its bytes were not checked; a folder without any MANIFEST too."""
    import json
    import logging

    from skyrl_stepwise.checkpoint.store import COMPLETE, MANIFEST, read_manifest

    weights = _two_checkpoints(tmp_path)
    folder = step_dir(tmp_path, 2)
    files, hashed = read_manifest(folder)
    assert hashed and all(len(digest) == 64 for _, digest in files.values())
    (folder / MANIFEST).write_text(json.dumps({name: size for name, (size, _) in files.items()}))
    (folder / COMPLETE).write_text("ok\n")  # the marker those saves wrote: it recorded no manifest
    with caplog.at_level(logging.WARNING, logger="skyrl_stepwise.checkpoint.verify"):
        assert verify_checkpoint(folder)["step"] == 2
    assert f"{MANIFEST} of sizes only" in caplog.text and "without checking its bytes" in caplog.text
    model, opt, sched = _setup(seed=7)
    assert resume_checkpoint("auto", tmp_path, lambda p: load_checkpoint(p, model, opt, sched))[1]["step"] == 2
    assert all(torch.equal(v, weights[2][k]) for k, v in model.state_dict().items())
    _truncate(folder / "scheduler.pt")  # the sizes of an old manifest are still checked
    with pytest.raises(CorruptCheckpoint, match="scheduler.pt cannot be read"):
        verify_checkpoint(folder)
    (folder / MANIFEST).unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skyrl_stepwise.checkpoint.verify"):
        with pytest.raises(CorruptCheckpoint):
            verify_checkpoint(folder)
    assert f"no {MANIFEST}" in caplog.text


def _one_checkpoint(root):
    """step_1 of a tiny model (no optimizer: the fastest save that has a manifest)."""
    model, _, _ = _setup()
    return save_checkpoint(root, 1, model), model


@pytest.mark.parametrize("damage, cause", [
    ("deleted", "MANIFEST.json is missing, but this checkpoint was written with one"),
    ("emptied", "MANIFEST.json is not the one the save wrote"),
    ("one entry dropped", "MANIFEST.json is not the one the save wrote"),
])
def test_a_checkpoint_written_with_a_manifest_must_keep_it(tmp_path, damage, cause):
    """Deleting (or rewriting) the manifest must not turn a checkpoint into one 'saved before content hashes' that
    loads unchecked: the COMPLETE marker records the manifest's hash, so its loss is damage, found by the driver's
    check and by the ranks' own load alike."""
    import json

    from skyrl_stepwise.checkpoint.store import MANIFEST

    path, model = _one_checkpoint(tmp_path)
    manifest = path / MANIFEST
    if damage == "deleted":
        manifest.unlink()
    elif damage == "emptied":
        manifest.write_text("")
    else:
        data = json.loads(manifest.read_text())
        data["files"].pop(next(name for name in data["files"] if name.endswith(".distcp")))
        manifest.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpoint, match=f"{path}/{MANIFEST} cannot be read.*{cause}"):
        verify_checkpoint(path)
    with pytest.raises(CorruptCheckpoint, match=cause):
        load_checkpoint(path, model)


def test_a_checkpoint_of_another_model_shape_is_a_config_error_and_never_set_aside(tmp_path):
    """A checkpoint that reads back but holds tensors of another shape (a changed model or LoRA rank) is
    CheckpointMismatch naming the tensor, before any tensor loads; resume=auto stops on it and leaves step_N where it
    is (it used to be CorruptCheckpoint, and every good checkpoint was renamed .corrupt)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from skyrl_stepwise.checkpoint.store import CheckpointMismatch

    path, _ = _one_checkpoint(tmp_path)
    torch.manual_seed(3)
    wider = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointMismatch, match=r"model.layers.0.mlp.gate_proj.weight: \[64, 32\] saved, "
                                                 r"\[48, 32\] here"):
        resume_checkpoint("auto", tmp_path, lambda p: load_checkpoint(p, wider), lambda msg: None)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_1"]  # not renamed step_1.corrupt
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())  # nothing loaded
    deeper = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    with pytest.raises(CheckpointMismatch, match=r"the model here has and the checkpoint lacks \(9\)"):
        load_checkpoint(path, deeper)
