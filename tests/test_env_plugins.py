"""Envs as plugins: the run's own env classes from config (and installed entry points) join the built-ins, and every
row's env_class is checked at start-up, failing with what is registered and how to add one."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from skyrl_stepwise.run.config import EnvironmentConfig
from skyrl_stepwise.envs import builtin
from skyrl_stepwise.envs.base import StepResult
from skyrl_stepwise.envs.builtin import EnvPluginError, build_env_registry, check_env_classes, known_env_classes


class GuessEnv:
    """Guess a number: 'higher'/'lower' until right."""

    async def reset(self, prompt_messages, extras):
        self.target = int(extras.get("target", 7))
        return list(prompt_messages)

    async def step(self, action_text):
        guess = int("".join(c for c in action_text if c.isdigit()) or -1)
        done = guess == self.target
        hint = [] if done else [{"role": "user", "content": "higher" if guess < self.target else "lower"}]
        return StepResult(hint, float(done), done)


async def test_an_env_class_from_config_is_registered_next_to_the_builtins():
    env_cfg = EnvironmentConfig(env_classes={"guess": "test_env_plugins:GuessEnv",
                                             "guess2": "test_env_plugins.GuessEnv"})
    registry = build_env_registry(env_cfg)
    assert {"search", "tool", "keyword", "guess", "guess2"} <= set(registry.names())
    env = registry.make("guess")
    assert isinstance(env, GuessEnv) and env is not registry.make("guess")  # one instance per trajectory
    await env.reset([], {"target": 3})
    assert (await env.step("5")).observations == [{"role": "user", "content": "lower"}]


def test_an_unknown_env_class_fails_naming_the_registry_and_how_to_add_one():
    with pytest.raises(EnvPluginError) as info:
        check_env_classes(["keyword", "gues"], EnvironmentConfig(env_classes={"guess": "test_env_plugins:GuessEnv"}),
                          "data (train.parquet)")
    message = str(info.value)
    assert "data (train.parquet): unknown env_class 'gues'" in message
    assert "['guess', 'key_door', 'keyword', 'reasoning_gym', 'search', 'tool']" in message and "environment.env_classes" in message


@pytest.mark.parametrize("path, expected", [("no_such_pkg.envs:GuessEnv", "cannot import module 'no_such_pkg.envs'"),
                                            ("test_env_plugins:NoSuchEnv", "has no attribute 'NoSuchEnv'"),
                                            ("GuessEnv", "is not 'pkg.module:Class'")])
def test_a_broken_plugin_fails_at_start_up_naming_its_key(path, expected):
    with pytest.raises(EnvPluginError, match=expected) as info:
        known_env_classes(EnvironmentConfig(env_classes={"guess": path}))
    assert "environment.env_classes.guess" in str(info.value)


def test_a_plugin_cannot_replace_a_builtin():
    with pytest.raises(EnvPluginError, match="'tool' is a built-in env class"):
        known_env_classes(EnvironmentConfig(env_classes={"tool": "test_env_plugins:GuessEnv"}))


def test_installed_packages_add_envs_through_entry_points(monkeypatch):
    installed = [EntryPoint("guess", "test_env_plugins:GuessEnv", builtin.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(builtin, "entry_points", lambda group: installed if group == builtin.ENTRY_POINT_GROUP else [])
    assert "guess" in known_env_classes(EnvironmentConfig())
    assert isinstance(build_env_registry(EnvironmentConfig()).make("guess"), GuessEnv)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_train_fails_in_seconds_on_an_unknown_env_class_and_says_why_in_the_run_dir(tmp_path, capsys, monkeypatch):
    """Before the model, retriever or engines: the command fails naming the registry, report.md says why."""
    import time

    from skyrl_stepwise.cli import train
    from skyrl_stepwise.data.dataset import write_parquet

    from skyrl_stepwise.run import setup as run_setup

    monkeypatch.setattr(run_setup, "plan_resources", lambda *a: pytest.fail("got past the start-up checks"))
    write_parquet([{"prompt": [{"role": "user", "content": "Guess."}], "env_class": "gues", "data_source": "t",
                    "extra_info": {}, "reward_spec": {"ground_truth": {"target": ["3"]}}, "instance_id": "a"}],
                  tmp_path / "train.parquet")
    start = time.perf_counter()
    with pytest.raises(SystemExit):
        train.main(["experiment=tool_task_tiny", f"data.train_path={tmp_path / 'train.parquet'}",
                    "+environment.env_classes.guess=test_env_plugins:GuessEnv", f"logging.output_dir={tmp_path / 'run'}",
                    "logging.wandb_mode=disabled"])
    assert time.perf_counter() - start < 30
    err = capsys.readouterr().err
    assert "unknown env_class 'gues'; registered: ['guess', 'key_door', 'keyword', 'reasoning_gym', 'search', 'tool']" in err
    assert "Traceback" not in err
    report = (tmp_path / "run" / "report.md").read_text()
    assert "before step 1" in report and "unknown env_class 'gues'" in report
