"""What a run dir says about the job that trains in it: the config it started with (run_config.yaml), checked
against every later launch into the same directory.

A second launch into a run dir (a resume after a crash or an interrupt) must be the same job: otherwise it would
continue the checkpoints with different settings, or append a different job's steps to metrics.jsonl, without a
word. The launch is refused naming every differing key, unless `trainer.resume_allow_changes=true`; then the
differences are logged and appended to run_config.launches.jsonl. The first launch's record (run_config.yaml, and
Hydra's .hydra/: see `hydra_output_subdir`) is never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

RECORD = "run_config.yaml"
LAUNCHES = "run_config.launches.jsonl"
# keys that say how to launch, not what the job is: never a mismatch
LAUNCH_KEYS = ("trainer.resume", "trainer.resume_allow_changes", "trainer.overwrite_ckpt_dir",
               "logging.console_level", "logging.file_level", "logging.wandb_mode")


# keys that shape the LoRA adapter a run's checkpoints hold: a resume cannot change them, allowed or not (the saved
# A and B would load into another policy; policy/lora.py check_adapter_recipe refuses them again at the load)
ADAPTER_KEYS = ("trainer.lora.enabled", "trainer.lora.rank", "trainer.lora.alpha", "trainer.lora.target_modules")


class ConfigMismatchError(ValueError):
    """A launch into a run dir whose saved config differs; the message lists the keys."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}


def config_tree(cfg) -> dict[str, Any]:
    """The RunConfig as plain data (JSON-compatible, as YAML writes it)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def differences(saved: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (saved, new) for every leaf both configs have and that differs, launch keys left out."""
    a, b = flatten(saved), flatten(new)
    keys = sorted((set(a) & set(b)) - set(LAUNCH_KEYS))
    return {k: (a[k], b[k]) for k in keys if a[k] != b[k]}


def schema_changes(saved: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Keys this code added since the run started (with this launch's values) and keys it no longer has.

    Not a different job: an upgrade of the library between a crash and the resume adds settings the saved run could
    not have set (and drops ones it can no longer honour), so they are logged, not refused.
    """
    a, b = flatten(saved), flatten(new)
    return {k: b[k] for k in sorted(set(b) - set(a))}, sorted(set(a) - set(b))


def check_launch(tree: dict[str, Any], run_dir: str | Path, allow_changes: bool, log=print) -> None:
    """Refuse (ConfigMismatchError) a launch whose config (`config_tree` as composed, before the run fills in
    paths and ports) differs from the one the run dir was started with; with trainer.resume_allow_changes=true
    log and record the differences instead. No record: a new run."""
    import yaml

    path = Path(run_dir) / RECORD
    if not path.is_file():
        return
    saved = yaml.safe_load(path.read_text()) or {}
    added, removed = schema_changes(saved, tree)
    if added or removed:
        log(f"{run_dir} was started by an earlier version of skyrl_stepwise: settings added since "
            f"{', '.join(f'{k}={v!r}' for k, v in added.items()) or 'none'}; settings no longer known "
            f"{', '.join(removed) or 'none'}")
    diff = differences(saved, tree)
    if not diff:
        return
    lines = [f"  {k}: {old!r} -> {new!r}" for k, (old, new) in diff.items()]
    if allow_changes:
        _refuse_adapter_changes(diff, tree)
    if not allow_changes:
        raise ConfigMismatchError(
            f"{run_dir} holds a run started with a different config ({path}); this launch differs in "
            f"{len(diff)} key(s):\n" + "\n".join(lines[:40]) + ("\n  ..." if len(lines) > 40 else "") +
            "\nLaunch with the run's own config to resume it (its command line: .hydra/overrides.yaml), pick a new "
            "logging.output_dir for a new run, or set trainer.resume_allow_changes=true to continue with these "
            "changes")
    log(f"resuming with {len(diff)} changed key(s) (trainer.resume_allow_changes=true):\n" + "\n".join(lines))
    with open(Path(run_dir) / LAUNCHES, "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "changes": {k: [old, new] for k, (old, new) in diff.items()}}, default=str) + "\n")


def _refuse_adapter_changes(diff: dict[str, tuple[Any, Any]], tree: dict[str, Any]) -> None:
    """trainer.resume_allow_changes=true still refuses (ConfigMismatchError) a changed adapter recipe when this
    launch resumes checkpoints: said here, before minutes of start-up, instead of at the checkpoint's load."""
    from skyrl_stepwise.checkpoint.store import complete_checkpoints

    changed = {k: v for k, v in diff.items() if k in ADAPTER_KEYS}
    flat = flatten(tree)
    resume, ckpt_dir = flat.get("trainer.resume"), flat.get("trainer.ckpt_dir")
    if not changed or resume in ("none", "", None) or (resume == "auto" and not complete_checkpoints(ckpt_dir)):
        return
    raise ConfigMismatchError(
        f"trainer.resume={resume} continues the checkpoints in {ckpt_dir}, whose LoRA adapter was trained with other "
        "settings; trainer.resume_allow_changes=true cannot change the adapter's recipe (its saved tensors would "
        "load into another policy): " + "; ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in
                                                   changed.items()) +
        ". Resume with the saved values, or start a new run in a new logging.output_dir")


def save_record(tree: dict[str, Any], run_dir: str | Path) -> None:
    """Write run_config.yaml once, when the run first trains: later launches are checked against it."""
    import yaml

    path = Path(run_dir) / RECORD
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# the config this run dir's job started with; later launches are checked against it\n"
                   + yaml.safe_dump(tree, sort_keys=False))
    tmp.replace(path)


def hydra_output_subdir(run_dir: str | Path) -> str | None:
    """Where Hydra should write this launch's .hydra record when the run dir already has one (else None): a
    subfolder per launch, so the first launch's config.yaml and overrides.yaml are never overwritten."""
    if not (Path(run_dir) / ".hydra" / "config.yaml").is_file():
        return None
    return f".hydra/launch-{time.strftime('%Y%m%d-%H%M%S')}"
