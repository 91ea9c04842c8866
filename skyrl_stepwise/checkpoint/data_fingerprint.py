"""The training rows a checkpoint was trained on, so a resume can tell whether it still has them.

Resume is bitwise because the data position is a pure function of (rows, data.seed, step) (loop.PromptLoader): the
file is read once per launch, so a dataset that disappears or changes between epochs of one launch changes nothing,
but one rewritten, re-shuffled, grown or cut between a crash and the relaunch would make step N+1 draw different
prompts, silently, and the run would no longer be the one its checkpoints continue. Each checkpoint records the row
count and a SHA-256 of the rows (prompt, env, reward spec, extras, id); a resume whose rows differ stops, naming
data.train_path and both fingerprints, unless trainer.resume_allow_changes=true (then it says so and goes on). A file
that is gone or unreadable at the relaunch already stops the launch naming it (data/dataset.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Callable


def data_fingerprint(rows: list) -> dict:
    """{"rows": n, "sha256": ...} over the rows in file order (PromptRow dataclasses)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(dataclasses.asdict(row), sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return {"rows": len(rows), "sha256": digest.hexdigest()}


def check_same_data(saved: dict | None, current: dict, checkpoint: str, train_path: str, allow_changes: bool,
                    warn: Callable[[str], None]) -> None:
    """Refuse (ValueError) resuming `checkpoint` on rows other than those it was trained on; a checkpoint from
    before fingerprints (saved None) is not checked."""
    if not saved or saved == current:
        return
    message = (f"the training rows differ from those checkpoint {checkpoint} was trained on: data.train_path="
               f"{train_path!r} now has {current['rows']} rows (sha256 {current['sha256'][:12]}), the checkpoint's "
               f"had {saved.get('rows')} (sha256 {str(saved.get('sha256'))[:12]}); from here on the steps would draw "
               "other prompts than the run being resumed")
    if not allow_changes:
        raise ValueError(message + ". Restore the dataset file, or set trainer.resume_allow_changes=true to continue "
                                   "on the new rows")
    warn(message + " (continuing: trainer.resume_allow_changes=true)")
