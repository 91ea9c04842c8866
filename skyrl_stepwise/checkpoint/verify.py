"""Resume only from a checkpoint that reads back; with `trainer.resume=auto`, fall back past one that does not.

A folder marked COMPLETE can still be unreadable: a shard truncated or emptied by a failing disk or a bad copy, a
garbled trainer_state.json or driver_state.pkl, a missing rng_rank<r>.pt. Before anything is loaded the driver
checks the folder (`verify_checkpoint`: every file of its MANIFEST present with the size and the sha256 it was saved
with, so one damaged byte inside a shard is found too; the DCP metadata readable and every shard it names long enough
to hold its data, the small files parse, the step matches the folder); what only the load itself can find raises
CorruptCheckpoint on the ranks. Either way the error names the folder, the file and the cause; never a stack trace
from inside DCP. A checkpoint saved before content hashes (a MANIFEST of sizes only, or none) still loads, with a
log line saying that its bytes were not checked; one written with a MANIFEST must keep it (its COMPLETE marker records
the manifest's hash): a manifest deleted or replaced after the save is damage, refused like a damaged shard. A
checkpoint that reads back but was saved from another model or adapter (a changed trainer.model_path or trainer.lora)
is a configuration error (CheckpointMismatch, or the LoRA recipe's own check), never CorruptCheckpoint: it stops
the resume and is never set aside.

Why `resume=auto` then falls back to the previous complete checkpoint instead of stopping: resume is bitwise
(tests/test_bitwise_resume.py). Everything a step depends on (weights, AdamW, schedule, the RNG of every rank and
of the driver, the rollouts generated ahead, and the data position, a function of the step) comes from one step
folder, so continuing from step_M trains steps M+1..N again into exactly the state a readable step_N held: compute
is lost, nothing of the run is. That holds only all-or-nothing: step, lineage, driver state and RNG are taken from
step_M's own files, never mixed with the corrupt one's, and a partial in-place load of the corrupt folder is
overwritten entirely by step_M's load (every parameter, optimizer state, the schedule and the RNG). The corrupt
folder is renamed `step_N.corrupt` (kept for inspection; never picked again; not deleted when the run saves step N
anew) and a warning names it. If no complete checkpoint reads back the run stops: starting from scratch would
silently throw the run away. An explicit `trainer.resume=<folder>` is loaded or refused, never substituted: the
error names the previous complete checkpoint to point it at instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemReader

from skyrl_stepwise.checkpoint import driver_state
from skyrl_stepwise.checkpoint.store import (_READ_ERRORS, COMPLETE, CONTENT_HASH, MANIFEST, CorruptCheckpoint,
                                               check_manifest_kept, complete_checkpoints, describe_error, file_digest,
                                               read_manifest, resolve_resume)

logger = logging.getLogger(__name__)


def verify_checkpoint(path: str | Path) -> dict:
    """Check a complete checkpoint folder without loading it into a model; returns its trainer_state.
    Raises CorruptCheckpoint naming the first file that does not read back."""
    path = Path(path)
    verify_files(path)
    part = "trainer_state.json"
    try:
        state = json.loads((path / part).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) \
                or not isinstance(state.get("world_size"), int):
            raise ValueError("no integer step and world_size")
        if path.name != f"step_{state['step']}":
            raise ValueError(f"it says step {state['step']}")
        for rank in range(state["world_size"]):
            part = f"rng_rank{rank}.pt"
            torch.load(path / part, weights_only=False)  # our own file: numpy state is not a tensor
        if (path / "scheduler.pt").exists():
            part = "scheduler.pt"
            torch.load(path / part, weights_only=True)
        part = "dcp/.metadata"
        metadata = FileSystemReader(str(path / "dcp")).read_metadata()
        for info in metadata.storage_data.values():
            part = f"dcp/{info.relative_path}"
            size = (path / "dcp" / info.relative_path).stat().st_size
            if size < info.offset + info.length:
                raise ValueError(f"{size} bytes, but its data runs to byte {info.offset + info.length}")
        if (path / driver_state.DRIVER_STATE).exists():
            part = driver_state.DRIVER_STATE
            driver_state.load(path)
    except _READ_ERRORS as e:
        raise CorruptCheckpoint(f"checkpoint {path} is marked {COMPLETE} but {path / part} cannot be read "
                                f"({describe_error(e)})") from e
    return state


def verify_files(path: Path, warn: Callable[[str], None] = logger.warning) -> bool:
    """Every file of the checkpoint's MANIFEST present with the size and sha256 it was saved with, and the
    manifest itself the one its COMPLETE marker records (a checkpoint written with a manifest must keep it).
    Returns whether the bytes were checked: False, with a warning, for a checkpoint saved before content hashes.
    Raises CorruptCheckpoint naming the first file that differs. What `model export` checks too."""
    part = MANIFEST
    try:
        check_manifest_kept(path)
        manifest = read_manifest(path)
        if manifest is None or not manifest[1]:
            warn(f"checkpoint {path} was saved before content hashes ("
                 f"{'no ' + MANIFEST if manifest is None else MANIFEST + ' of sizes only'}): loading it "
                 "without checking its bytes, so a damaged byte inside a file would go unnoticed")
        for name, (size, digest) in (manifest[0] if manifest else {}).items():
            part = name
            actual = (path / name).stat().st_size
            if actual != size:
                raise ValueError(f"{actual} bytes, {size} when it was saved")
            if digest is not None and (found := file_digest(path / name)) != digest:
                raise ValueError(f"its content differs from what was saved ({CONTENT_HASH} {found[:16]}..., "
                                 f"{digest[:16]}... when it was saved): a damaged byte")
    except _READ_ERRORS as e:
        raise CorruptCheckpoint(f"checkpoint {path} is marked {COMPLETE} but {path / part} cannot be read "
                                f"({describe_error(e)})") from e
    return bool(manifest and manifest[1])


def corrupt_cause(error: BaseException) -> CorruptCheckpoint | None:
    """The CorruptCheckpoint behind an error, also when a Ray actor raised it (RayTaskError.cause)."""
    cause = getattr(error, "cause", None)
    for e in (error, cause):
        if isinstance(e, CorruptCheckpoint):
            return e
    return None


def quarantine(path: Path) -> Path:
    """Rename a corrupt checkpoint out of resume's sight (`step_N.corrupt`, `.corrupt1`, ...); returns where."""
    for k in range(1000):
        target = path.with_name(f"{path.name}.corrupt{k or ''}")
        if not target.exists():
            path.rename(target)
            return target
    raise FileExistsError(f"too many quarantined copies of {path}")


def resume_checkpoint(resume: str, ckpt_dir: str | Path, load: Callable[[Path], dict],
                      warn: Callable[[str], None] = logger.warning) -> tuple[Path, dict] | None:
    """Load the checkpoint `trainer.resume` names (auto | none | a step folder) with `load(path) -> trainer_state`
    (e.g. the policy ranks' load_checkpoint); returns (folder, trainer_state), or None to start from scratch.

    auto: the newest complete checkpoint that verifies and loads; each corrupt one on the way is quarantined with a
    warning. Raises CorruptCheckpoint when checkpoints exist but none reads back, or when an explicitly named one
    does not."""
    if resume in ("none", "", None):
        return None
    if resume != "auto":
        path = resolve_resume(resume, ckpt_dir)
        try:
            verify_checkpoint(path)
            return path, load(path)
        except Exception as e:
            cause = corrupt_cause(e)
            if cause is None:
                raise
            older = [p for p in complete_checkpoints(path.parent) if p.name != path.name
                     and int(p.name.split("_")[1]) < int(path.name.split("_")[1])]
            hint = f"point trainer.resume at {older[-1]} (the previous complete checkpoint)" if older else \
                "no earlier complete checkpoint exists next to it"
            raise CorruptCheckpoint(f"{cause}. trainer.resume names this folder: {hint}, or restore the file") from e
    skipped: list[str] = []
    for path in reversed(complete_checkpoints(ckpt_dir)):
        try:
            verify_checkpoint(path)
            state = load(path)
        except Exception as e:
            cause = corrupt_cause(e)
            if cause is None:
                raise
            moved = quarantine(path)
            skipped.append(f"{cause} (moved to {moved.name})")
            warn(f"CORRUPT CHECKPOINT, not resumed from: {cause}. Moved aside to {moved}; trying the previous "
                 "complete checkpoint")
            continue
        if skipped:
            warn(f"resuming from {path} (step {state['step']}) instead of the newer checkpoint(s) that did not read "
                 f"back; the steps after {state['step']} are trained again, bitwise what they were")
        return path, state
    if skipped:
        raise CorruptCheckpoint(f"trainer.resume=auto: no complete checkpoint in {ckpt_dir} reads back: "
                                f"{'; '.join(skipped)}. Restore the files (rename the folder back to step_N), or "
                                "start over with trainer.resume=none trainer.overwrite_ckpt_dir=true")
    return None
