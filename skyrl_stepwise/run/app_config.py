"""Config loading shared by every command: compose conf/ into a validated RunConfig (a Hydra app's job, or
`load_config` in tests, benchmarks and notebooks) and run a task as a Hydra application.

The entry points (train, sft, ablate) all start here, so none of them imports another.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import time
from pathlib import Path
from typing import Callable

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
logger = logging.getLogger("skyrl_stepwise.app")

# `logging.output_dir=DIR` on the command line (also with + or ++)
_OUTPUT_DIR_OVERRIDE = re.compile(r"^\+{0,2}logging\.output_dir=(.+)$")


def default_output_dir(run_name: str) -> str:
    """The run dir of a config composed outside a Hydra app (load_config): Hydra's layout, so every run still
    gets a directory of its own."""
    return time.strftime(f"outputs/%Y-%m-%d/%H-%M-%S_{run_name}")


def recipe_value(recipe: str, key: str):
    """The value recipe conf/experiment/<recipe>.yaml gives `key` (a dotted path), read from the file: the help
    once said the main recipe ran 3 steps after it had gone to 6, so the help reads the figure rather than repeats
    it. A recipe that does not set the key is an error, not a silent blank."""
    from omegaconf import OmegaConf

    path = f"{CONF_DIR}/experiment/{recipe}.yaml"
    value = OmegaConf.select(OmegaConf.load(path), key)
    if value is None:
        raise KeyError(f"{path} sets no {key}")
    return value


def validated_config(composed, in_hydra_job: bool = True):
    """A composed DictConfig as a RunConfig, checked as every run checks it (unknown keys, values, combinations,
    log levels) and otherwise untouched: what `--cfg job` may print.

    Outside a Hydra job there is no `${hydra:runtime.output_dir}` to resolve, so an unset logging.output_dir
    falls back to `default_output_dir`.
    """
    from omegaconf import OmegaConf

    from skyrl_stepwise.run.config import LoggingConfig, check_known_keys
    from skyrl_stepwise.host.logs import parse_level

    check_known_keys(composed)
    if not in_hydra_job and OmegaConf.to_container(composed.logging)["output_dir"] == LoggingConfig.output_dir:
        composed.logging.output_dir = default_output_dir(composed.logging.run_name)
    cfg = OmegaConf.to_object(composed)
    cfg.validate()
    parse_level(cfg.logging.console_level, "logging.console_level")
    parse_level(cfg.logging.file_level, "logging.file_level")
    return cfg


def to_run_config(composed, in_hydra_job: bool = True, command_line: list[str] | None = None):
    """A composed DictConfig as a validated RunConfig fitted to this host; a bad value or combination fails naming
    its key (see validated_config). `command_line`: the overrides given (a Hydra job's are read from Hydra), whose
    keys keep their values where a recipe's `host_without_bf16` would change them."""
    from skyrl_stepwise.run.config import apply_host_without_bf16, command_line_keys, host_without_bf16

    if command_line is None:
        command_line = _hydra_overrides() if in_hydra_job else []
    recipe_changes = apply_host_without_bf16(composed, command_line_keys(command_line), host_without_bf16())
    cfg = validated_config(composed, in_hydra_job)
    cfg.environment.tool.tools_path = recipe_file(cfg.environment.tool.tools_path)
    changed = cfg.fit_precision_to_host()
    if recipe_changes:
        changed.append(f"and the recipe's host_without_bf16: {', '.join(recipe_changes)} (a key given on the "
                       "command line keeps its value)")
    if changed:
        logger.warning(f"this CPU has no native bf16 (AVX512-BF16/AMX; bf16 matmuls would be emulated, 3-80x "
                       f"slower): {', '.join(changed)}")
    return cfg


def _hydra_overrides() -> list[str]:
    """The command-line overrides of the Hydra job running now ([] outside one)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def recipe_file(path: str | None) -> str | None:
    """A relative file path as the run will read it: from the working dir when it is there, else from the project
    root when it is there (the recipes' own files, `tools_path: conf/tools/repo_fix.yaml`), as an absolute path.

    Why: a recipe names its files relative to the project root, and a user runs `skyrl-stepwise train` from their own
    directory, where `conf/` is not: the run failed at start-up with "No such file" for a file the project ships.
    A path found in neither place is left as given, so the error names what the user wrote."""
    if path is None or Path(path).is_absolute() or Path(path).exists():
        return path
    shipped = Path(CONF_DIR).parent / path
    return str(shipped) if shipped.exists() else path


def load_config(overrides: list[str] | None = None, config_name: str = "config"):
    """Compose conf/ + overrides into a validated RunConfig without running a Hydra app (tests, benchmarks,
    notebooks); a wrong key or combination fails here."""
    from hydra import compose, initialize_config_dir

    from skyrl_stepwise.run.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        composed = compose(config_name=config_name, overrides=list(overrides or []))
    return to_run_config(composed, in_hydra_job=False, command_line=list(overrides or []))


def _with_run_dir(argv: list[str]) -> list[str]:
    """`logging.output_dir=DIR` also makes DIR Hydra's run dir, so .hydra/ (the composed config and overrides)
    lands next to the metrics instead of in a second, otherwise empty outputs/<date>/<time> directory. A run dir
    that already has a .hydra/ (an earlier launch) keeps it: this launch's goes to .hydra/launch-<time>/."""
    from skyrl_stepwise.run.record import hydra_output_subdir

    if any(a in ("-m", "--multirun") for a in argv):
        return argv
    run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")), None)
    extra = []
    if run_dir is None:
        run_dir = next((m.group(1) for m in map(_OUTPUT_DIR_OVERRIDE.match, argv) if m), None)
        if run_dir is not None:
            extra.append(f"hydra.run.dir={run_dir}")
    subdir = hydra_output_subdir(run_dir) if run_dir is not None else None
    if subdir is not None and not any(a.startswith("hydra.output_subdir=") for a in argv):
        extra.append(f"hydra.output_subdir={subdir}")
    return [*extra, *argv]  # before the user's words: argparse takes no override after `--cfg job`


def input_errors() -> tuple[type[Exception], ...]:
    """Errors that name a bad input (an env class, a tool spec, a resume into a different job) or a start-up
    failure's root cause (a plan that cannot fit, a component that did not start): reported as one message, like
    a bad config key, not as a traceback (that is in run.log)."""
    from skyrl_stepwise.envs.builtin import EnvPluginError
    from skyrl_stepwise.inference.vllm_engine import NodeLostError
    from skyrl_stepwise.run.resource_plan import ResourcePlanError
    from skyrl_stepwise.run.record import ConfigMismatchError
    from skyrl_stepwise.run.startup_failures import StartupFailure
    from skyrl_stepwise.tools.config import ToolConfigError

    return EnvPluginError, ConfigMismatchError, ToolConfigError, ResourcePlanError, StartupFailure, NodeLostError


def check_printed_config(argv: list[str]) -> None:
    """`--cfg job|hydra|all` prints the composed config without running the job, so Hydra never validates it: a
    config the run would refuse (`trainer.packing=bogus`, an unknown `+key`) was printed as if fine. Validate it
    first, as the run does, and exit non-zero naming the key; any other command line is left to Hydra."""
    from hydra._internal.utils import get_args_parser  # Hydra's own parser: the same words Hydra reads

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:  # a malformed command line: Hydra reports it itself
        return
    if not args.cfg or args.help or args.hydra_help or args.multirun:  # a sweep prints its overrides unexpanded
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            composed = compose(config_name=args.config_name or "config", overrides=list(args.overrides))
    except ConfigCompositionException:  # a bad override: Hydra's own run reports it, as for any other command
        return
    try:
        validated_config(composed, in_hydra_job=False)
    except ValueError as e:
        print(f"Error: the config would be refused by a run: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def hydra_entry(task: Callable, argv: list[str] | None = None, help_config: str | None = None) -> int:
    """Run `task(cfg: RunConfig)` as a Hydra application over conf/ with `argv` as its command line.

    hydra.main reads sys.argv, so it is set for the call (`skyrl-stepwise train ...` dispatches here with the
    words after the command). Hydra handles --help, --cfg, -m, the run dir, and exits non-zero on a bad
    override; validation errors of RunConfig are reported the same compact way, naming the key.
    `help_config`: the task's own --help (conf/hydra/help/<name>.yaml) instead of train's.
    """
    import hydra
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from skyrl_stepwise.run.config import register_configs

    register_configs()
    # `${skyrl_recipe:search_r1_tiny,total_steps}` in conf/hydra/help: --help quotes a recipe's figures from the recipe
    OmegaConf.register_new_resolver("skyrl_recipe", recipe_value, replace=True)

    @functools.wraps(task)  # Hydra names the job after the task's module: train, ablate
    def job(composed):
        try:
            cfg = to_run_config(composed)
        except ValueError as e:
            raise ConfigCompositionException(str(e)) from e
        try:
            return task(cfg)
        except input_errors() as e:  # a bad input named in one message: no traceback to scroll through
            raise ConfigCompositionException(f"{type(e).__name__}: {e}") from None

    app = hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(job)
    words = _with_run_dir(list(argv or []))
    if help_config is not None:  # first: argparse takes no override after `--cfg job`
        words = [f"hydra/help={help_config}", *words]
    check_printed_config(words)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "skyrl-stepwise", *words]
    try:
        app()
    finally:
        sys.argv = saved
    return 0
