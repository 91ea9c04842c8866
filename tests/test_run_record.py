"""A second launch into a run dir must be the same job: a changed config is refused naming the keys (or accepted
with trainer.resume_allow_changes=true, recorded), and the first launch's records are never overwritten."""

from __future__ import annotations

import json

import pytest
import yaml

from skyrl_stepwise.cli import train
from skyrl_stepwise.run.record import (LAUNCHES, RECORD, ConfigMismatchError, check_launch, config_tree,
                                       differences, save_record)


def _tree(*overrides):
    return config_tree(train.load_config(["experiment=search_r1_tiny", "logging.output_dir=/tmp/r", *overrides]))


def test_differences_name_each_changed_key_and_ignore_launch_keys():
    saved = _tree()
    new = _tree("generator.n_samples_per_prompt=2", "trainer.optim.lr=3e-5", "trainer.resume=none",
                "logging.console_level=DEBUG")
    assert differences(saved, new) == {"generator.n_samples_per_prompt": (4, 2), "trainer.optim.lr": (1e-5, 3e-5)}


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_launch_with_a_changed_config_is_refused_unless_allowed(tmp_path):
    save_record(_tree(), tmp_path)
    first = (tmp_path / RECORD).read_text()
    check_launch(_tree("trainer.resume=auto"), tmp_path, allow_changes=False)  # the same job: fine
    with pytest.raises(ConfigMismatchError, match=r"total_steps: 6 -> 5") as info:
        check_launch(_tree("total_steps=5"), tmp_path, allow_changes=False)
    assert "trainer.resume_allow_changes=true" in str(info.value)
    logged = []
    check_launch(_tree("total_steps=5"), tmp_path, allow_changes=True, log=logged.append)
    assert "total_steps: 6 -> 5" in logged[0]
    # (the recipe checkpoints at the end: its ckpt_interval follows total_steps)
    assert json.loads((tmp_path / LAUNCHES).read_text())["changes"] == {"total_steps": [6, 5],
                                                                        "trainer.ckpt_interval": [6, 5]}
    save_record(_tree("total_steps=5"), tmp_path)
    assert (tmp_path / RECORD).read_text() == first  # the run's own record stays


def test_settings_added_or_dropped_by_a_newer_version_are_logged_not_refused(tmp_path):
    """A library upgrade between a crash and the resume adds keys the saved run could not have set: the same job,
    so the resume goes on and says which; a changed value of a key both have is still refused."""
    saved = _tree()
    del saved["generator"]["env_timeout_s"]
    saved["trainer"]["a_setting_since_removed"] = 3
    save_record(saved, tmp_path)
    logged = []
    check_launch(_tree(), tmp_path, allow_changes=False, log=logged.append)
    assert "generator.env_timeout_s=600" in logged[0] and "trainer.a_setting_since_removed" in logged[0]
    with pytest.raises(ConfigMismatchError, match=r"total_steps: 6 -> 5"):
        check_launch(_tree("total_steps=5"), tmp_path, allow_changes=False, log=logged.append)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_resume_through_the_cli_refuses_a_changed_config_and_keeps_hydras_record(tmp_path, monkeypatch, capsys):
    """The real entry point: the first launch's .hydra/ stays, the refused launch's goes to .hydra/launch-*/."""
    def stop(cfg):
        raise RuntimeError("stopped before any model, retriever or engine")

    monkeypatch.setattr(train, "prepared", stop)
    out = tmp_path / "run"
    args = ["experiment=search_r1_tiny", f"logging.output_dir={out}"]
    with pytest.raises(SystemExit):  # the first launch stops at prepared(): its .hydra/ is written by then
        train.main(args)
    assert "stopped before" in capsys.readouterr().err
    first = (out / ".hydra" / "overrides.yaml").read_text()
    save_record(_tree(f"logging.output_dir={out}"), out)
    with pytest.raises(SystemExit):
        train.main([*args, "generator.max_turns=2"])
    refused = capsys.readouterr().err
    assert "ConfigMismatchError" in refused and "generator.max_turns: 3 -> 2" in refused
    assert (out / ".hydra" / "overrides.yaml").read_text() == first
    launches = sorted((out / ".hydra").glob("launch-*/overrides.yaml"))
    assert launches and "generator.max_turns=2" in yaml.safe_load(launches[-1].read_text())
