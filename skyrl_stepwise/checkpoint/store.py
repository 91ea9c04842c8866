"""Atomic, resumable checkpoints: DCP for model + optimizer, small files for everything else.

Layout of `<ckpt_dir>/step_<N>/`:
  dcp/                 model and optimizer state (torch.distributed.checkpoint, sharded, any world size)
  scheduler.pt         LR scheduler state (rank 0)
  trainer_state.json   step, world size and the caller's state (data loader position, epoch, ...)
  rng_rank<r>.pt       python / numpy / torch (/ cuda) RNG states of rank r
  driver_state.pkl     the driver's own state (its RNG, rollouts generated ahead): what a bitwise resume needs
  MANIFEST.json        every other file's size and sha256, so a truncated, emptied or damaged file (one flipped
                       byte inside a shard) is found before anything loads (checkpoint/verify.py)
  COMPLETE             written last; it records the manifest's own sha256, so a checkpoint written with a manifest
                       must keep it: one deleted or replaced afterwards is damage (CorruptCheckpoint), not an
                       old checkpoint (the markers of saves before manifests say `ok`)

Everything is written into `step_<N>.tmp`, renamed to `step_<N>` and only then marked COMPLETE, so a save
killed at any point leaves either a `.tmp` folder or a folder without the marker: neither is ever picked by
`find_latest_complete`, and a resume never reads half a checkpoint.

Pruning follows the run's *lineage* (the checkpoints this run saved or resumed through, each tagged with the
run_id of the launch that wrote it), never "the highest step numbers in the folder": a stale `step_40` of
another run must not push out the `step_10` just written. A fresh run refuses a folder that already holds
checkpoints unless told to overwrite it, so `resume=auto` can never continue someone else's run.

Failures are collective and named. A save that fails on any rank (a full disk, a permission, an exception while
writing) fails on every rank (no rank is left waiting in a barrier) with a CheckpointSaveError naming the step
folder and the cause; its `.tmp` folder is removed (after ENOSPC the space is wanted back), and since pruning runs
only after the COMPLETE marker of the new checkpoint, the older complete checkpoints are all still there. A
checkpoint folder that is marked COMPLETE but cannot be read back (a truncated shard, a garbled JSON or pickle, a
missing RNG file) raises CorruptCheckpoint naming the folder and the file; what resume does then is
checkpoint/verify.py's business.

Content hashes cost one extra read of each file, hashed where it was written: every rank hashes its own DCP shards
and RNG file right after writing them (from the page cache, in parallel with the other ranks), rank 0 the rest
before it writes the manifest. The README's checkpoint section gives the measured cost.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 2  # 1 (no "format" key): {file: size}; 2: {"files": {file: {"size": n, "sha256": hex}}}
CONTENT_HASH = "sha256"  # hashlib's sha256 uses the CPU's SHA extensions: ~1.4 GB/s here, 2x blake2b
_STEP_DIR = re.compile(r"step_(\d+)")
# what a failed read of a checkpoint raises: DCP's CheckpointException is a BaseException, not an Exception
_READ_ERRORS = (Exception, dcp.api.CheckpointException)


class CorruptCheckpoint(RuntimeError):
    """A complete checkpoint (COMPLETE marker present) that cannot be read back: the message names the file."""


class CheckpointMismatch(ValueError):
    """A checkpoint that reads back but holds tensors of another model or adapter than the one here (a changed
    trainer.model_path or trainer.lora): a configuration error naming the tensor, never CorruptCheckpoint, so
    resume=auto never sets a good checkpoint aside for it."""


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank: the message names the step folder and the cause."""


def describe_error(e: BaseException) -> str:
    """One line for an error; DCP's CheckpointException is unwrapped to the first rank's own exception."""
    failures = getattr(e, "failures", None)
    if isinstance(e, dcp.api.CheckpointException) and failures:
        rank, wrapped = sorted(failures.items())[0]
        cause = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)  # (exc, traceback)
        return f"rank {rank}: {describe_error(cause)}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]


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
    existing = sorted(p.name for p in root.iterdir() if _STEP_DIR.fullmatch(p.name.split(".")[0])) \
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
                    files: dict[str, bytes] | None = None,
                    model_keys: Callable[[str], bool] | None = None) -> Path:
    """Save on every rank (collective) and return the complete step folder.

    trainer_state must be JSON-serialisable (e.g. {"epoch": 1, "consumed_prompts": 512}); `step` and
    `world_size` are added. With max_to_keep > 0 and trainer_state carrying `run_id` and `lineage` (the
    entries of this run's earlier checkpoints, oldest first), the lineage's checkpoints beyond the newest
    max_to_keep are deleted; nothing outside the lineage ever is. `files`: more files for the step folder (name ->
    bytes, written by rank 0 before the COMPLETE marker), e.g. the driver's state. `model_keys`: which model
    state-dict entries to keep (a LoRA run keeps the adapter's alone; the frozen base is re-read at resume).
    """
    final = step_dir(ckpt_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    failed = None
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of this step
            tmp.mkdir(parents=True)
    except Exception as e:
        failed = e
    _agree(failed, final, tmp)

    own_hashes: dict[str, str] = {}
    try:
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": _kept(model_sd, model_keys), "optim": optim_sd}, checkpoint_id=tmp / "dcp")
        else:
            dcp.save({"model": _kept(get_model_state_dict(model), model_keys)}, checkpoint_id=tmp / "dcp")
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
        else:  # rank 0 hashes its own files with the rest when it writes the manifest
            own_hashes = {str(f.relative_to(tmp)): file_digest(f) for f in _files_written_by(tmp, rank)}
    except _READ_ERRORS as e:
        failed = e
    gathered = _agree(failed, final, tmp, own_hashes)  # every rank's files are written (or every rank raises)

    try:
        if rank == 0:
            _write_manifest(tmp, {name: digest for hashes in gathered for name, digest in hashes.items()})
            # a complete checkpoint of this step from an abandoned lineage (an explicit older resume) goes only
            # now that its replacement is fully written: a failed save never costs an existing checkpoint
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            _fsync_dir(final.parent)
            _mark_complete(final)
    except Exception as e:
        failed = e
    _agree(failed, final, tmp)
    if rank == 0:
        state = trainer_state or {}
        if max_to_keep > 0 and "run_id" in state:
            prune_lineage(ckpt_dir, list(state.get("lineage", [])) + [lineage_entry(step, state["run_id"])],
                          max_to_keep)
    _barrier()
    return final


def _kept(state: dict, model_keys: Callable[[str], bool] | None) -> dict:
    """The model state-dict entries a checkpoint holds: all, or those `model_keys` keeps."""
    return state if model_keys is None else {k: v for k, v in state.items() if model_keys(k)}


def _agree(failed: BaseException | None, final: Path, tmp: Path, payload: dict | None = None) -> list[dict]:
    """Every rank learns whether any rank failed (instead of a barrier some rank never reaches) and, if one did,
    raises CheckpointSaveError naming the folder and the cause; rank 0 removes the half-written `.tmp`. Returns
    every rank's `payload` (what each rank hands rank 0 with the same collective: its files' hashes)."""
    errors = [describe_error(failed)] if failed is not None else []
    payloads = [payload or {}]
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (_rank(), errors, payload or {}))
        errors = [f"rank {r}: {e}" for r, errs, _ in gathered for e in errs]
        payloads = [p for _, _, p in gathered]
    if not errors:
        return payloads
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if final.is_dir() and not (final / COMPLETE).exists():  # renamed, never marked: ours, and never resumable
            shutil.rmtree(final, ignore_errors=True)
    latest = find_latest_complete(final.parent)
    raise CheckpointSaveError(
        f"saving checkpoint {final} failed ({'; '.join(errors)}). Nothing was pruned: the latest complete "
        f"checkpoint is {latest or 'none (no earlier save)'}. Fix the cause (free disk space, permissions on "
        f"{final.parent}), then relaunch with trainer.resume=auto to continue from it") from failed


def file_digest(path: Path) -> str:
    """The hex content hash of one file, read in chunks (hashlib.file_digest): what the manifest records."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, CONTENT_HASH).hexdigest()


def _files_written_by(folder: Path, rank: int) -> list[Path]:
    """The files rank `rank` wrote itself: its DCP shards (FileSystemWriter names them `__<rank>_<n>.distcp`) and
    its RNG state. Hashed by that rank while they are in its page cache; anything no rank claims, rank 0 hashes."""
    return sorted((folder / "dcp").glob(f"__{rank}_*.distcp")) + [folder / f"rng_rank{rank}.pt"]


def _write_manifest(folder: Path, hashes: dict[str, str] | None = None) -> None:
    """Every file's size and content hash (relative path -> {size, sha256}), read back by checkpoint/verify.py before a
    resume loads anything. `hashes` are those the other ranks computed of their own files; rank 0 hashes the rest."""
    hashes = hashes or {}
    files = {}
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            name = str(f.relative_to(folder))
            files[name] = {"size": f.stat().st_size, CONTENT_HASH: hashes.get(name) or file_digest(f)}
    (folder / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1))


def read_manifest(folder: Path) -> tuple[dict[str, tuple[int, str | None]], bool] | None:
    """A checkpoint's manifest as {file: (size, sha256 or None)} and whether it records content hashes; None when
    the folder has none. Manifests written before content hashes ({file: size}) read with no hashes."""
    if not (folder / MANIFEST).is_file():
        return None
    data = json.loads((folder / MANIFEST).read_text())
    if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT:
        return {name: (int(e["size"]), e.get(CONTENT_HASH)) for name, e in data["files"].items()}, True
    return {name: (int(size), None) for name, size in data.items()}, False


def recorded_manifest(folder: Path) -> str | None:
    """The sha256 of the manifest the checkpoint's COMPLETE marker records, or None for a marker of a save before
    markers recorded one (`ok`). Raises ValueError when the marker is garbled."""
    text = (folder / COMPLETE).read_text().strip()
    if not text.startswith("{"):
        return None
    record = json.loads(text)
    digest = record.get(CONTENT_HASH) if isinstance(record, dict) else None
    if not isinstance(digest, str) or record.get("manifest") != MANIFEST:
        raise ValueError(f"the marker records no {MANIFEST} hash: {text[:80]!r}")
    return digest


def check_manifest_kept(folder: Path) -> None:
    """Refuse (ValueError) a checkpoint whose marker records a manifest that is gone or replaced: its files could
    then be damaged or swapped without a trace. Reads two small files; checkpoint/verify.py checks the rest."""
    digest = recorded_manifest(folder)
    if digest is None:
        return
    if not (folder / MANIFEST).is_file():
        raise FileNotFoundError(f"{MANIFEST} is missing, but this checkpoint was written with one (its {COMPLETE} "
                                "marker records its hash): it was deleted after the save")
    if (found := file_digest(folder / MANIFEST)) != digest:
        raise ValueError(f"{MANIFEST} is not the one the save wrote ({CONTENT_HASH} {found[:16]}..., "
                         f"{digest[:16]}... in its {COMPLETE} marker)")


def _mark_complete(path: Path) -> None:
    """The marker is the commit point: written and synced after everything else is on disk. It records the
    manifest's own hash (`recorded_manifest`): the proof that this checkpoint was written with one."""
    record = {"manifest": MANIFEST, "format": MANIFEST_FORMAT, CONTENT_HASH: file_digest(path / MANIFEST)}
    with open(path / COMPLETE, "w") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(path)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler=None,
                    model_keys: Callable[[str], bool] | None = None) -> dict:
    """Restore in place on every rank (collective) and return the saved trainer_state (with `step`).
    `model_keys`: the model entries the checkpoint holds (as saved); the others keep their current values.

    Before any tensor loads, the checkpoint's model entries (names and shapes, from DCP's metadata) are compared
    with the model's: one saved from another model or adapter raises CheckpointMismatch naming the tensor, a
    configuration error, never CorruptCheckpoint. DCP reshards on load, so the world size may differ from the
    save; then the per-rank RNG states of ranks that did not exist are simply not restored.
    """
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"checkpoint {path} is incomplete or missing (no {COMPLETE} marker)")
    trainer_state, rng, scheduler_state, saved_shapes = _read_small_files(path, scheduler is not None)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": _kept(model_sd, model_keys), "optim": optim_sd}
    else:
        state = {"model": _kept(get_model_state_dict(model), model_keys)}
    check_fits(path, saved_shapes, {name: tuple(t.shape) for name, t in state["model"].items()})
    try:
        dcp.load(state, checkpoint_id=path / "dcp")
        options = StateDictOptions(strict=model_keys is None)
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=options)
        else:
            set_model_state_dict(model, state["model"], options=options)
    except _READ_ERRORS as e:
        raise CorruptCheckpoint(f"checkpoint {path} is marked {COMPLETE} but {path / 'dcp/'} cannot be read "
                                f"({describe_error(e)})") from e
    if scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
    if rng is not None:  # ranks beyond the saved world size had no RNG state to restore
        _set_rng_state(rng)
    return trainer_state


def _read_small_files(path: Path, with_scheduler: bool) -> tuple[dict, dict | None, dict | None, dict]:
    """(trainer_state, this rank's RNG state, the scheduler's state, the saved model entries' shapes): the small
    files first, so a garbled one is found (CorruptCheckpoint naming it) before anything in place has changed."""
    part = MANIFEST
    try:
        check_manifest_kept(path)
        part = "trainer_state.json"
        trainer_state = json.loads((path / part).read_text())
        saved_world = int(trainer_state["world_size"])
        part = f"rng_rank{_rank()}.pt"
        rng = torch.load(path / part, weights_only=False) if _rank() < saved_world else None  # our own file
        part = "scheduler.pt"
        scheduler_state = torch.load(path / part, weights_only=True) if with_scheduler else None
        part = "dcp/.metadata"
        shapes = saved_model_shapes(path)
    except _READ_ERRORS as e:
        raise CorruptCheckpoint(f"checkpoint {path} is marked {COMPLETE} but {path / part} cannot be read "
                                f"({describe_error(e)})") from e
    return trainer_state, rng, scheduler_state, shapes


def saved_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every model tensor a checkpoint holds (DCP's metadata, no tensor read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path / "dcp")).read_metadata()
    return {key.removeprefix("model."): tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}


def check_fits(path: Path, saved: dict[str, tuple[int, ...]], here: dict[str, tuple[int, ...]]) -> None:
    """Refuse (CheckpointMismatch) loading a checkpoint whose model tensors are not the ones to load here: a
    tensor missing from it, one it holds that the model lacks, or one of another shape. The checkpoint is
    intact (its files read back); the config that built the model differs from the one that saved it."""
    missing = [n for n in here if n not in saved]
    extra = [n for n in saved if n not in here]
    shapes = [f"{n}: {list(saved[n])} saved, {list(here[n])} here" for n in here
              if n in saved and tuple(saved[n]) != tuple(here[n])]
    if not (missing or extra or shapes):
        return
    found = "; ".join(part for part in (
        f"tensors of another shape ({len(shapes)}): {', '.join(shapes[:3])}" if shapes else "",
        f"tensors the model here has and the checkpoint lacks ({len(missing)}): {missing[:3]}" if missing else "",
        f"tensors the checkpoint holds and the model here lacks ({len(extra)}): {extra[:3]}" if extra else "") if part)
    raise CheckpointMismatch(f"checkpoint {path} was saved from another model than the one built here ({found}): "
                             "resume with the trainer.model_path and trainer.lora settings it was saved with")
