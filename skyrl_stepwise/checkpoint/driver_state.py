"""What the driver adds to a checkpoint so a resume is bitwise the run that was never stopped.

The policy ranks checkpoint their weights, optimizer, scheduler and RNG; the data position is a function of the
step and sampling is seeded per (trajectory, turn) (generator.sampling.seed). What remains lives in the driver:
its own RNG (envs and samplers that draw from `random`/`numpy`/`torch` there), and, with rollouts ahead
(`trainer.max_staleness > 0`), the rollouts already generated for the next steps by *older* weights than the
checkpoint's: a resumed run could not regenerate them (those weights are gone), so they are saved as they are.
Rollouts generated with the checkpoint's own weights are not saved: the resumed run regenerates them identically.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

DRIVER_STATE = "driver_state.pkl"


@dataclass
class DriverState:
    """The driver's part of a checkpoint."""

    rng: dict[str, Any]
    rollouts_ahead: list = field(default_factory=list)  # rollout_ahead.Rollout, oldest step first


def capture_rng() -> dict[str, Any]:
    """The driver process's python / numpy / torch RNG states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    """Put the driver's RNG back where the checkpoint left it."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def dump(rollouts_ahead: list) -> bytes:
    """The bytes of `driver_state.pkl` for a checkpoint taken now."""
    return pickle.dumps(DriverState(capture_rng(), list(rollouts_ahead)), protocol=pickle.HIGHEST_PROTOCOL)


def load(checkpoint: str | Path) -> DriverState | None:
    """The driver state saved with a checkpoint; None for a checkpoint written before it existed (the resume then
    is exact only without rollouts ahead, as before)."""
    path = Path(checkpoint) / DRIVER_STATE
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        state = pickle.load(f)  # our own file, written by this package next to the weights it belongs to
    if not isinstance(state, DriverState):
        raise ValueError(f"{path} does not hold a DriverState (got {type(state).__name__})")
    return state
