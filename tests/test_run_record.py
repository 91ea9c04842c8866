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


def test_allowed_changes_never_include_the_adapter_recipe_of_the_checkpoints_resumed(tmp_path):
    """trainer.resume_allow_changes=true lets a resume change the lr, not trainer.lora.alpha / rank / target_modules /
    enabled of the adapter its checkpoints hold: refused at launch naming the key and both values, before the
    start-up; with no checkpoint to resume (or resume=none) the change is the user's to make."""
    import copy

    ckpts = tmp_path / "ckpts"
    saved = _tree(f"trainer.ckpt_dir={ckpts}", "trainer.lora.enabled=true")
    save_record(saved, tmp_path)

    def launch(resume="auto", **lora):
        tree = copy.deepcopy(saved)
        tree["trainer"]["optim"]["lr"] = 1e-4
        tree["trainer"]["resume"] = resume
        tree["trainer"]["lora"].update(lora)
        return tree

    changed = launch(alpha=32.0, target_modules=["q_proj"])
    logged = []
    check_launch(changed, tmp_path, allow_changes=True, log=logged.append)  # nothing to resume yet
    assert "trainer.lora.alpha: 16.0 -> 32.0" in logged[-1]
    (ckpts / "step_2").mkdir(parents=True)
    (ckpts / "step_2" / "COMPLETE").write_text("ok\n")
    with pytest.raises(ConfigMismatchError, match=r"trainer.lora.alpha: saved 16.0, now 32.0; "
                                                  r"trainer.lora.target_modules: saved \['all-linear'\], now "
                                                  r"\['q_proj'\]") as info:
        check_launch(changed, tmp_path, allow_changes=True, log=logged.append)
    assert "trainer.optim.lr" not in str(info.value)
    check_launch(launch(), tmp_path, allow_changes=True, log=logged.append)  # the lr alone: allowed
    check_launch(launch("none", alpha=32.0), tmp_path, allow_changes=True, log=logged.append)
