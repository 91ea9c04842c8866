"""Metrics go three places: a console line per step, metrics.jsonl in the run dir, and wandb.

wandb runs offline unless `logging.wandb_mode=online` and WANDB_API_KEY is set, and silently (its banner and
sync hints would bury the step lines; report.md says where its files are); the config logged to wandb never
contains secrets (keys that look like tokens or passwords are dropped).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger("skyrl_stepwise")

# a credential-like word as a whole `_`-separated part of the key: drops `hf_token`, `wandb_api_key`,
# keeps `micro_batch_tokens`
_SECRET = re.compile(r"(^|_)(api_?key|token|secret|password)($|_)", re.IGNORECASE)
# label on the console line -> metric key
CONSOLE_KEYS = {"reward": "reward/mean", "pass@n": "reward/pass_at_n", "eval_reward": "eval/reward/mean",
                "signal_groups": "advantages/groups_with_signal",
                "loss": "policy/loss", "kl": "policy/kl_loss", "clip_frac": "policy/clip_frac",
                "entropy": "policy/entropy", "grad_norm": "train/grad_norm", "samples": "generate/num_samples",
                "padded_len": "generate/batch_padded_seq_len", "staleness": "async/staleness",
                "step_s": "timing/step_s",
                # agent programs (gateway.enabled): calls to the model per trajectory, share with >= 2 calls
                "calls": "gateway/calls_per_trajectory_mean", "multi_call": "gateway/multi_call_share",
                "tool_calls": "gateway/tool_calls_per_trajectory_mean"}


def skipped_updates(metrics: dict) -> str | None:
    """What a step's `train/skipped_step` means in words, or None when every update ran. A skipped update (a
    non-finite gradient norm, or nothing to train on) loses the whole batch's gradient, so it is never left to a
    metric nobody reads: the console line and report.md say it."""
    skipped = metrics.get("train/skipped_step", 0.0)
    if not skipped:
        return None
    ran = metrics.get("train/optimizer_steps", 0.0)
    return f"skipped {skipped:.0f} of {skipped + ran:.0f} optimizer update(s)"


def step_notes(metrics: dict) -> list[str]:
    """What the numbers on a step line do not say: trajectories that failed (not trained, so `samples` alone
    reads like a clean run on fewer of them) and updates whose forward and backward were skipped (no signal)."""
    notes = []
    failed = metrics.get("generate/failed_trajectories", 0.0)
    if failed:
        causes = ", ".join(f"{k.rsplit('/', 1)[1]} {v:.0f}" for k, v in sorted(metrics.items())
                           if k.startswith("generate/failed_trajectories/") and v)
        notes.append(f"{failed:.0f} trajectories failed ({causes}; not trained)")
    skipped = metrics.get("train/forward_skipped", 0.0)
    if skipped:
        updates = metrics.get("train/optimizer_steps", 0.0) + metrics.get("train/skipped_step", 0.0)
        notes.append(f"no signal: forward/backward skipped on {skipped:.0f} of {max(updates, skipped):.0f} "
                     "update(s) (every advantage 0, no KL term; AdamW stepped on a zero gradient)")
    return notes


def adapter_note(metrics: dict) -> str | None:
    """trainer.lora.sync=adapter: the adapter version the engines serve after this step's sync and what the
    probe decided about it (policy/weight_sync.py AdapterVerdict), for the step line."""
    from skyrl_stepwise.policy.weight_sync import MIN_SEPARATION

    if "sync/adapter_version" not in metrics:
        return None
    note = f"engines serve adapter v{metrics['sync/adapter_version']:.0f}"
    if "sync/adapter_decided" not in metrics:
        return note
    if metrics["sync/adapter_decided"]:
        return note + f" (probe: applied, margin {metrics['sync/adapter_margin']:+.1f} standard errors)"
    return note + (f" (probe undecided: the adapter moves the probe {metrics['sync/adapter_separation']:.1f} x the "
                   f"engine's noise, decides at {MIN_SEPARATION:g})")


def _step_of(line: str) -> float:
    """The step a metrics.jsonl line records; a line cut short by a kill mid-write belongs to no kept step."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def load_history(metrics_path: Path, fallback: list[dict] | None = None) -> list[dict]:
    """Every step once, in order: metrics.jsonl when it exists (a line cut short by a kill is skipped, a step
    logged twice keeps its last record), else `fallback`. Read by the run report and the trajectory viewer."""
    records = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    records = [r for r in records or list(fallback or []) if isinstance(r, dict) and "step" in r]
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


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
        self._last_wandb_step = 0  # wandb refuses steps that go back: tables logged later use at least this
        if mode != "disabled":
            import wandb

            online = mode == "online" and bool(os.environ.get("WANDB_API_KEY"))
            if mode == "online" and not online:
                logger.warning("logging.wandb_mode=online but WANDB_API_KEY is not set: logging offline")
            self.wandb = wandb.init(project=project, name=run_name, dir=str(self.dir), config=scrub(config),
                                    mode="online" if online else "offline", reinit="finish_previous",
                                    settings=wandb.Settings(silent=True))

    def rewind(self, step: int) -> None:
        """Drop records after `step` (a run killed between logging a step and checkpointing it), so a resumed
        run's metrics.jsonl has every step exactly once."""
        self.jsonl.close()
        path = self.dir / "metrics.jsonl"
        kept = [line for line in path.read_text().splitlines() if _step_of(line) <= step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        self.jsonl = open(path, "a")
        self.history = [r for r in self.history if r["step"] <= step]

    def log(self, metrics: dict[str, float], step: int, records: dict | None = None) -> None:
        """`records` (e.g. which prompts the step used) go to metrics.jsonl only, not to wandb."""
        self.history.append({"step": step, **metrics})
        self.jsonl.write(json.dumps({"step": step, **metrics, **(records or {})}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
            self._last_wandb_step = max(self._last_wandb_step, step)
        shown = " ".join(f"{label}={metrics[k]:.4g}" for label, k in CONSOLE_KEYS.items() if k in metrics)
        shown += "".join(f" | {note}" for note in step_notes(metrics))
        served = adapter_note(metrics)
        shown += f" | {served}" if served else ""
        skipped = skipped_updates(metrics)
        if skipped is None:
            logger.info(f"step {step}: {shown}")
        else:  # a warning: shown however quiet the console is
            logger.warning(f"step {step}: {shown} | {skipped.upper()} (non-finite gradient norm or nothing to "
                           f"train on: train/skipped_step)")

    def log_image(self, key: str, path: str | Path, step: int | None = None) -> None:
        """A figure (the run report's curves.png) into wandb next to the metrics it plots; a no-op without
        wandb or without the file."""
        if self.wandb is None or not Path(path).is_file():
            return
        import wandb

        self.wandb.log({key: wandb.Image(str(path))}, step=step)

    def log_rollouts(self, samples: list, step: int, stage: str) -> None:
        """Decoded trajectories (loop/rollout_samples.py) as a wandb table `rollouts/<stage>`, one row each, so
        what the model wrote sits next to the reward curve; a no-op without wandb."""
        if self.wandb is None or not samples:
            return
        import wandb

        columns = ["step", "stage", "trajectory", "pick", "reward", "stop_reason", "turns", "prompt", "completion",
                   "tool_calls"]
        table = wandb.Table(columns=columns)
        for s in samples:
            rest = [seg for seg in s.segments[1:]]
            completion = "\n".join(f"[{seg.role}] {seg.text}" for seg in rest)
            calls = json.dumps([c for seg in rest for c in seg.tool_calls])
            reward = float("nan") if s.reward is None else s.reward  # a failed trajectory: one column type
            table.add_data(s.step, s.stage, s.trajectory, s.pick, reward, s.stop_reason, s.turns, s.prompt,
                           completion, calls)
        key = "rollouts/train" if stage == "train" else "rollouts/eval"
        self.wandb.log({key: table}, step=max(step, self._last_wandb_step))

    def finish(self) -> None:
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
