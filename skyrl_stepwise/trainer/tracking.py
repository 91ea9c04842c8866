"""Metrics go three places: a console line per step, metrics.jsonl in the run dir, and wandb.

wandb runs offline unless `logging.wandb_mode=online` and WANDB_API_KEY is set; the config logged
to wandb never contains secrets (keys that look like tokens or passwords are dropped).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger("skyrl_stepwise")

_SECRET = re.compile(r"(api_?key|token|secret|password)", re.IGNORECASE)
CONSOLE_KEYS = ("reward/mean", "reward/pass_at_n", "train/loss", "train/kl", "train/clip_frac", "train/grad_norm",
                "generate/num_samples", "generate/batch_padded_seq_len", "timing/step_s")


def scrub(config: dict) -> dict:
    """Drop anything named like a credential before it is written anywhere."""
    return {k: scrub(v) if isinstance(v, dict) else v for k, v in config.items() if not _SECRET.search(str(k))}


class Tracker:
    """One object the loop calls `log(metrics, step)` on; `finish()` flushes everything."""

    def __init__(self, output_dir: str | Path, project: str, run_name: str, mode: str, config: dict) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a")
        self.history: list[dict] = []  # every logged step, for plots drawn at the end
        self.wandb = None
        if mode != "disabled":
            import wandb

            online = mode == "online" and bool(os.environ.get("WANDB_API_KEY"))
            if mode == "online" and not online:
                logger.warning("logging.wandb_mode=online but WANDB_API_KEY is not set: logging offline")
            self.wandb = wandb.init(project=project, name=run_name, dir=str(self.dir), config=scrub(config),
                                    mode="online" if online else "offline", reinit="finish_previous")

    def log(self, metrics: dict[str, float], step: int, records: dict | None = None) -> None:
        """`records` (e.g. which prompts the step used) go to metrics.jsonl only, not to wandb."""
        self.history.append({"step": step, **metrics})
        self.jsonl.write(json.dumps({"step": step, **metrics, **(records or {})}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        shown = " ".join(f"{k.split('/', 1)[-1]}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
        print(f"step {step}: {shown}", flush=True)

    def finish(self) -> None:
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
