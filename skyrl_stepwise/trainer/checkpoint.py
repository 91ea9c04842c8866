"""Atomic, resumable checkpoints: DCP for model + optimizer, small files for everything else.

Layout of `<ckpt_dir>/step_<N>/`:
  dcp/                 model and optimizer state (torch.distributed.checkpoint, sharded, any world size)
  scheduler.pt         LR scheduler state (rank 0)
  trainer_state.json   step, world size and the caller's state (data loader position, epoch, ...)
  rng_rank<r>.pt       python / numpy / torch (/ cuda) RNG states of rank r
  driver_state.pkl     the driver's own state (its RNG, rollouts generated ahead): what a bitwise resume needs
  COMPLETE             written last

Everything is written into `step_<N>.tmp`, renamed to `step_<N>` and only then marked COMPLETE, so a save
killed at any point leaves either a `.tmp` folder or a folder without the marker: neither is ever picked by
`find_latest_complete`, and a resume never reads half a checkpoint.

Pruning follows the run's *lineage* (the checkpoints this run saved or resumed through, each tagged with the
run_id of the launch that wrote it), never "the highest step numbers in the folder": a stale `step_40` of
another run must not push out the `step_10` just written. A fresh run refuses a folder that already holds
checkpoints unless told to overwrite it, so `resume=auto` can never continue someone else's run.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"step_(\d+)")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    """Where step N's checkpoint lives once complete."""
    return Path(ckpt_dir) / f"step_{step}"


def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """All complete checkpoints, oldest step first; `.tmp` folders and unmarked folders are skipped."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and (p / COMPLETE).is_file()]
    return [p for _, p in sorted(found)]


def find_latest_complete(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or None: what `resume=auto` continues from."""
    done = complete_checkpoints(ckpt_dir)
    return done[-1] if done else None


def resolve_resume(resume: str, ckpt_dir: str | os.PathLike) -> Path | None:
    """Map `trainer.resume` (auto | none | a step folder) to the checkpoint to load, failing on a bad path."""
    if resume in ("none", "", None):
        return None
    if resume == "auto":
        return find_latest_complete(ckpt_dir)
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"trainer.resume: {resume!r} is not a complete checkpoint (no {COMPLETE} marker)")
    return path


def check_fresh_start(ckpt_dir: str | os.PathLike, resume: str, overwrite: bool) -> None:
    """A run that starts from scratch (resume=none) must not share ckpt_dir with an older run's checkpoints:
    a later resume=auto would pick whichever has the higher step. Refuse, or delete them when told to."""
    if resume not in ("none", "", None):
        return
    root = Path(ckpt_dir)
    existing = sorted(p.name for p in root.iterdir() if _STEP_DIR.fullmatch(p.name.removesuffix(".tmp"))) \
        if root.is_dir() else []
    if not existing:
        return
    if not overwrite:
        raise FileExistsError(f"trainer.resume=none but trainer.ckpt_dir={str(root.resolve())!r} already holds "
                              f"checkpoints ({', '.join(existing[:5])}{', ...' if len(existing) > 5 else ''}); "
                              "use trainer.resume=auto to continue that run, another trainer.ckpt_dir, or "
                              "trainer.overwrite_ckpt_dir=true to delete them")
    for name in existing:
        shutil.rmtree(root / name)


def lineage_entry(step: int, run_id: str) -> dict:
    """How a checkpoint is named in a lineage: its step folder and the launch that wrote it."""
    return {"step": step, "run_id": run_id}


def prune_lineage(ckpt_dir: str | os.PathLike, lineage: list[dict], max_to_keep: int) -> list[dict]:
    """Delete this lineage's checkpoints beyond the newest `max_to_keep` and return the kept entries.

    A folder is deleted only if it still holds the checkpoint the entry names (same run_id): another run may
    have written the same step since.
    """
    if max_to_keep <= 0 or len(lineage) <= max_to_keep:
        return list(lineage)
    for entry in lineage[:-max_to_keep]:
        path = step_dir(ckpt_dir, entry["step"])
        state = path / "trainer_state.json"
        if state.is_file() and json.loads(state.read_text()).get("run_id") == entry["run_id"]:
            shutil.rmtree(path, ignore_errors=True)
    return list(lineage[-max_to_keep:])


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler=None,
                    trainer_state: dict | None = None, max_to_keep: int = -1,
                    files: dict[str, bytes] | None = None) -> Path:
    """Save on every rank (collective) and return the complete step folder.

    trainer_state must be JSON-serialisable (e.g. {"epoch": 1, "consumed_prompts": 512}); `step` and
    `world_size` are added. With max_to_keep > 0 and trainer_state carrying `run_id` and `lineage` (the
    entries of this run's earlier checkpoints, oldest first), the lineage's checkpoints beyond the newest
    max_to_keep are deleted; nothing outside the lineage ever is. `files`: more files for the step folder (name ->
    bytes, written by rank 0 before the COMPLETE marker), e.g. the driver's state.
    """
    final = step_dir(ckpt_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    if rank == 0:
        for stale in (tmp, final):  # a crashed save of this step, or a re-run of it
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()

    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / "dcp")
    else:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tmp / "dcp")
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        state = dict(trainer_state or {}, step=step,
                     world_size=dist.get_world_size() if dist.is_initialized() else 1)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        for name, data in (files or {}).items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"checkpoint file name {name!r} must be a plain file name")
            (tmp / name).write_bytes(data)
    _barrier()

    if rank == 0:
        tmp.rename(final)
        _fsync_dir(final.parent)
        _mark_complete(final)
        state = trainer_state or {}
        if max_to_keep > 0 and "run_id" in state:
            prune_lineage(ckpt_dir, list(state.get("lineage", [])) + [lineage_entry(step, state["run_id"])],
                          max_to_keep)
    _barrier()
    return final


def _mark_complete(path: Path) -> None:
    """The marker is the commit point: written and synced after everything else is on disk."""
    with open(path / COMPLETE, "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(path)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler=None) -> dict:
    """Restore in place on every rank (collective) and return the saved trainer_state (with `step`).

    DCP reshards on load, so the world size may differ from the save; then the per-rank RNG states of
    ranks that did not exist are simply not restored.
    """
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"checkpoint {path} is incomplete or missing (no {COMPLETE} marker)")
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path / "dcp")
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path / "dcp")
        set_model_state_dict(model, state["model"])
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))  # our own file: numpy state is not a tensor
    return json.loads((path / "trainer_state.json").read_text())
