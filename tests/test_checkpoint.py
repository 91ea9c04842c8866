"""Atomic checkpoints: exact round trip, crashed saves are never picked, pruning, resume resolution.

A small randomly initialised Llama keeps these single-process tests fast; the 2-rank FSDP round trip on
SmolLM2 is in test_fsdp_worker.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

from skyrl_stepwise.checkpoint import store as checkpoint
from skyrl_stepwise.checkpoint.store import (COMPLETE, find_latest_complete, load_checkpoint, resolve_resume,
                                               save_checkpoint, step_dir)

# single-process DCP warns that it assumes a single process, which is exactly the case here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=10)
    return model, opt, sched


def _step(model, opt, sched, x):
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def test_round_trip_restores_weights_optimizer_scheduler_rng_exactly(tmp_path):
    model, opt, sched = _setup()
    x = torch.randint(0, 128, (1, 16))
    _step(model, opt, sched, x)
    path = save_checkpoint(tmp_path, 1, model, opt, sched, {"epoch": 0, "consumed_prompts": 8})
    with torch.no_grad():
        logits = model(x).logits
    draws = (torch.rand(3), np.random.rand(), random.random())
    lr = sched.get_last_lr()
    _step(model, opt, sched, x)  # the run goes on, then "crashes"

    model2, opt2, sched2 = _setup(seed=1)  # a new process: other weights, empty optimizer state
    state = load_checkpoint(path, model2, opt2, sched2)
    assert state == {"epoch": 0, "consumed_prompts": 8, "step": 1, "world_size": 1}
    with torch.no_grad():
        assert torch.equal(model2(x).logits, logits)
    assert sched2.get_last_lr() == lr
    assert torch.equal(torch.rand(3), draws[0]) and np.random.rand() == draws[1] and random.random() == draws[2]
    # identical next step: AdamW moments and step counts came back too
    model3, opt3, sched3 = _setup(seed=2)
    load_checkpoint(path, model3, opt3, sched3)
    _step(model2, opt2, sched2, x)
    _step(model3, opt3, sched3, x)
    for p2, p3 in zip(model2.parameters(), model3.parameters()):
        assert torch.equal(p2, p3)


def test_crashed_saves_are_never_complete(tmp_path, monkeypatch):
    model, opt, sched = _setup()
    save_checkpoint(tmp_path, 2, model, opt, sched)
    (tmp_path / "step_3.tmp").mkdir()  # killed before the rename
    (tmp_path / "step_3.tmp" / "trainer_state.json").write_text("{}")
    (tmp_path / "step_10").mkdir()  # a folder that never got its marker
    (tmp_path / "step_x").mkdir()
    assert find_latest_complete(tmp_path) == step_dir(tmp_path, 2)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed during the model write")

    monkeypatch.setattr(checkpoint.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, model, opt, sched)
    assert (tmp_path / "step_4.tmp").is_dir() and not (tmp_path / "step_4").exists()
    monkeypatch.undo()

    def killed_before_marker(path):
        raise KeyboardInterrupt("killed after the rename")

    monkeypatch.setattr(checkpoint, "_mark_complete", killed_before_marker)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 5, model, opt, sched)
    assert (tmp_path / "step_5").is_dir() and not (tmp_path / "step_5" / COMPLETE).exists()
    assert find_latest_complete(tmp_path) == step_dir(tmp_path, 2)
    with pytest.raises(FileNotFoundError, match="no COMPLETE marker"):
        load_checkpoint(tmp_path / "step_5", model, opt, sched)
    monkeypatch.undo()

    save_checkpoint(tmp_path, 4, model, opt, sched)  # a retry replaces the crashed attempt
    assert not (tmp_path / "step_4.tmp").exists()
    assert find_latest_complete(tmp_path) == step_dir(tmp_path, 4)


def test_pruning_and_resume_resolution(tmp_path):
    model, _, _ = _setup()
    assert find_latest_complete(tmp_path / "missing") is None
    assert resolve_resume("auto", tmp_path) is None
    lineage = []
    for step in (1, 2, 3):  # weights only (e.g. the reference model)
        save_checkpoint(tmp_path, step, model, trainer_state={"run_id": "r", "lineage": lineage}, max_to_keep=2)
        lineage = checkpoint.prune_lineage(tmp_path, lineage + [checkpoint.lineage_entry(step, "r")], 2)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_2", "step_3"]
    assert lineage == [{"step": 2, "run_id": "r"}, {"step": 3, "run_id": "r"}]
    assert resolve_resume("auto", tmp_path) == step_dir(tmp_path, 3)
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume(str(step_dir(tmp_path, 2)), tmp_path) == step_dir(tmp_path, 2)
    with pytest.raises(FileNotFoundError, match="trainer.resume"):
        resolve_resume(str(step_dir(tmp_path, 1)), tmp_path)
    model2, _, _ = _setup(seed=3)
    assert load_checkpoint(step_dir(tmp_path, 3), model2)["step"] == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


def test_pruning_keeps_what_this_run_wrote_and_fresh_runs_refuse_old_checkpoints(tmp_path):
    model, _, _ = _setup()
    for step in (30, 40):  # a stale earlier run in the same folder
        save_checkpoint(tmp_path, step, model, trainer_state={"run_id": "old", "lineage": []}, max_to_keep=2)
    with pytest.raises(FileExistsError, match=f"trainer.ckpt_dir='{tmp_path.resolve()}'.*step_30, step_40"):
        checkpoint.check_fresh_start(tmp_path, "none", overwrite=False)
    checkpoint.check_fresh_start(tmp_path, "auto", overwrite=False)  # continuing is allowed

    # a new run that saves step_10 with keep=2 keeps it: pruning never looks outside its own lineage
    save_checkpoint(tmp_path, 10, model, trainer_state={"run_id": "new", "lineage": []}, max_to_keep=2)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_10", "step_30", "step_40"]
    # a lineage entry whose folder was since rewritten by another run is not deleted
    lineage = [checkpoint.lineage_entry(30, "someone-else"), checkpoint.lineage_entry(10, "new")]
    save_checkpoint(tmp_path, 11, model, trainer_state={"run_id": "new", "lineage": lineage}, max_to_keep=1)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_11", "step_30", "step_40"]

    checkpoint.check_fresh_start(tmp_path, "none", overwrite=True)
    assert checkpoint.complete_checkpoints(tmp_path) == []
