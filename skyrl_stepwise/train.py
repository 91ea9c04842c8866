"""`skyrl-stepwise train [overrides] [hydra flags]` / `python -m skyrl_stepwise.train`: the main job.

A Hydra application over conf/ (schema: skyrl_stepwise.config.RunConfig), so Hydra's conventions hold: `--help`,
`--cfg job`, `-m` sweeps, one output directory per run. Builds every component from the config (model, data,
local retriever, engines, generator, FSDP2 policy workers on Ray, tracker), hands them to RLTrainer, and writes
the run report (report.md, curves.png) into the run directory at the end, also when the run fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
logger = logging.getLogger("skyrl_stepwise.train")  # not __name__: `python -m` would make it "__main__"

# `logging.output_dir=DIR` on the command line (also with + or ++)
_OUTPUT_DIR_OVERRIDE = re.compile(r"^\+{0,2}logging\.output_dir=(.+)$")


def default_output_dir(run_name: str) -> str:
    """The run dir of a config composed outside a Hydra app (load_config): Hydra's layout, so every run still
    gets a directory of its own."""
    return time.strftime(f"outputs/%Y-%m-%d/%H-%M-%S_{run_name}")


def to_run_config(composed, in_hydra_job: bool = True):
    """A composed DictConfig as a validated RunConfig; a bad value or combination fails naming its key.

    Outside a Hydra job there is no `${hydra:runtime.output_dir}` to resolve, so an unset logging.output_dir
    falls back to `default_output_dir`.
    """
    from omegaconf import OmegaConf

    from skyrl_stepwise.config import LoggingConfig, check_known_keys
    from skyrl_stepwise.logging_setup import parse_level

    check_known_keys(composed)
    if not in_hydra_job and OmegaConf.to_container(composed.logging)["output_dir"] == LoggingConfig.output_dir:
        composed.logging.output_dir = default_output_dir(composed.logging.run_name)
    cfg = OmegaConf.to_object(composed)
    cfg.validate()
    changed = cfg.fit_precision_to_host()
    if changed:
        logger.warning(f"this CPU has no native bf16 (AVX512-BF16/AMX; bf16 matmuls would be emulated, 3-80x "
                       f"slower): {', '.join(changed)}")
    parse_level(cfg.logging.console_level, "logging.console_level")
    parse_level(cfg.logging.file_level, "logging.file_level")
    return cfg


def load_config(overrides: list[str] | None = None, config_name: str = "config"):
    """Compose conf/ + overrides into a validated RunConfig without running a Hydra app (tests, benchmarks,
    notebooks); a wrong key or combination fails here."""
    from hydra import compose, initialize_config_dir

    from skyrl_stepwise.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        composed = compose(config_name=config_name, overrides=list(overrides or []))
    return to_run_config(composed, in_hydra_job=False)


def _with_run_dir(argv: list[str]) -> list[str]:
    """`logging.output_dir=DIR` also makes DIR Hydra's run dir, so .hydra/ (the composed config and overrides)
    lands next to the metrics instead of in a second, otherwise empty outputs/<date>/<time> directory. A run dir
    that already has a .hydra/ (an earlier launch) keeps it: this launch's goes to .hydra/launch-<time>/."""
    from skyrl_stepwise.run_record import hydra_output_subdir

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
    return [*argv, *extra]


def input_errors() -> tuple[type[Exception], ...]:
    """Errors that name a bad input (an env class, a tool spec, a resume into a different job): reported as one
    message, like a bad config key, not as a traceback."""
    from skyrl_stepwise.envs.builtin import EnvPluginError
    from skyrl_stepwise.run_record import ConfigMismatchError
    from skyrl_stepwise.tools.config import ToolConfigError

    return EnvPluginError, ConfigMismatchError, ToolConfigError


def hydra_entry(task: Callable, argv: list[str] | None = None) -> int:
    """Run `task(cfg: RunConfig)` as a Hydra application over conf/ with `argv` as its command line.

    hydra.main reads sys.argv, so it is set for the call (`skyrl-stepwise train ...` dispatches here with the
    words after the command). Hydra handles --help, --cfg, -m, the run dir, and exits non-zero on a bad
    override; validation errors of RunConfig are reported the same compact way, naming the key.
    """
    import hydra
    from hydra.errors import ConfigCompositionException

    from skyrl_stepwise.config import register_configs

    register_configs()

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
    saved = sys.argv
    sys.argv = [saved[0] if saved else "skyrl-stepwise", *_with_run_dir(list(argv or []))]
    try:
        app()
    finally:
        sys.argv = saved
    return 0


def _datasets(cfg):
    from skyrl_stepwise.data.dataset import load_prompt_dataset

    train, val = cfg.data.train_path, cfg.data.val_path
    if "embedded" in (train, val):
        from skyrl_stepwise.data.embedded import build_embedded_search_r1

        built = build_embedded_search_r1()
        train = built.train if train == "embedded" else train
        val = built.validation if val == "embedded" else val
    rows = load_prompt_dataset(train), (load_prompt_dataset(val) if val else [])
    if cfg.data.env_class:
        rows = tuple([dataclasses.replace(r, env_class=cfg.data.env_class) for r in part] for part in rows)
    return rows


def _since(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


async def _run(cfg, train_rows, val_rows, record: dict | None = None) -> dict:
    import ray
    from transformers import AutoTokenizer

    from skyrl_stepwise.envs.builtin import build_env_registry
    from skyrl_stepwise.generator import StepwiseGenerator
    from skyrl_stepwise.inference import create_engine
    from skyrl_stepwise.inference.vllm_engine import ensure_ray
    from skyrl_stepwise.placement import cluster_gpus, create_placement_group, plan_run_layout, role_options
    from skyrl_stepwise.run_record import save_record
    from skyrl_stepwise.run_report import fsdp_backend
    from skyrl_stepwise.sft import sft_model
    from skyrl_stepwise.trainer.evaluation import eval_subset
    from skyrl_stepwise.trainer.loop import RLTrainer, eval_config
    from skyrl_stepwise.tools.base import configured_tool_schemas
    from skyrl_stepwise.trainer.rollout_samples import RolloutLog
    from skyrl_stepwise.trainer.tracking import Tracker
    from skyrl_stepwise.trainer.weight_sync import WeightSync
    from skyrl_stepwise.trainer.worker_group import PolicyGroup, ReferenceOnPolicyRanks

    owns_ray = not ray.is_initialized()  # a caller's Ray (e.g. a test session) is left running
    engine = policy = reference = tracker = placement_group = None
    try:
        start = time.perf_counter()
        ensure_ray()
        tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.model_path)
        registry = build_env_registry(cfg.environment)
        layout = plan_run_layout(cfg, gpus_requested=sum(cluster_gpus().values()) > 0)
        placement_group = create_placement_group(layout, cfg.placement.ready_timeout_s)  # fails fast if it cannot fit
        logger.info(layout.describe())
        engine = create_engine(cfg.engine, role_options(placement_group, layout.engines))
        logger.info(f"engines up: {cfg.engine.num_engines} x {cfg.engine.backend} ({cfg.engine.dtype}, "
                    f"max_model_len {cfg.engine.max_model_len}) in {_since(start)}")
        eval_generator = StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator))
        rollout_log = RolloutLog(cfg.logging.output_dir, eval_generator.loop.renderer, cfg.logging.num_rollout_samples,
                                 tools=configured_tool_schemas(cfg.environment.tool.tools_path))
        evals = EvalStages(cfg, eval_generator, eval_subset(val_rows, cfg.data.max_eval_prompts, cfg.data.seed),
                           rollout_log)
        if cfg.sft.enabled:  # the warm start: base model -> eval -> SFT (cached) -> the policy starts from it
            await evals.run("before SFT")
            if cfg.engine.release_kv_during_update and hasattr(engine, "release_memory"):
                await engine.release_memory()  # the engine idles through SFT: its KV pages serve the trainer
            cfg.trainer.model_path = str(await asyncio.to_thread(sft_model, cfg, logger.info,
                                                                 role_options(placement_group, layout.policy)))
        start = time.perf_counter()
        use_kl = cfg.trainer.algorithm.use_kl_loss  # the reference lives in the policy's ranks
        policy = PolicyGroup(cfg.trainer, actor_options=role_options(placement_group, layout.policy),
                             with_reference=use_kl)
        reference = ReferenceOnPolicyRanks(policy) if use_kl else None
        logger.info(f"workers up: policy{' + reference' if reference else ''} on {cfg.trainer.fsdp.world_size} "
                    f"FSDP2 rank(s) ({fsdp_backend(cfg.trainer.fsdp)}) in {_since(start)}")
        weight_sync = WeightSync(cfg.weight_sync, policy, engine, engines_share_policy_gpus=layout.mode == "colocated")
        logger.info(f"weight sync: {weight_sync.method}")
        if cfg.sft.enabled:
            await weight_sync.sync()  # the engines still hold the base model
            await evals.run("after SFT")
        tracker = Tracker(cfg.logging.output_dir, cfg.logging.project, cfg.logging.run_name, cfg.logging.wandb_mode,
                          dataclasses.asdict(cfg))
        rollout_log.tracker = tracker
        if record is not None:  # the job trains in this dir from now on: later launches are checked against it
            save_record(record, cfg.logging.output_dir)
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              tokenize=False, add_generation_prompt=True)
        trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator), eval_generator,
                            engine, policy, reference, tracker, train_rows, val_rows,
                            tokenizer(probe, add_special_tokens=False)["input_ids"], weight_sync, rollout_log)
        g = cfg.generator
        mode = ("step-wise, merged" if g.merge_stepwise_output else "step-wise") if g.step_wise_trajectories \
            else "whole trajectories"
        logger.info(f"training {cfg.total_steps} steps: {cfg.data.train_batch_size} prompts x "
                    f"{g.n_samples_per_prompt} samples, {mode}, {g.history} history")
        metrics = await trainer.fit()
        if trainer.last_eval is not None:
            evals.add(dataclasses.replace(trainer.last_eval, stage=f"after RL (step {trainer.step})"))
        return metrics
    except BaseException as e:
        if tracker is not None:
            _report(cfg, tracker, e)
            tracker = None
        raise
    finally:
        if tracker is not None:
            _report(cfg, tracker, None)
        if policy is not None:
            policy.shutdown()
        if engine is not None:
            getattr(engine, "shutdown", lambda: None)()
        if placement_group is not None:
            ray.util.remove_placement_group(placement_group)
        if owns_ray:
            ray.shutdown()


class EvalStages:
    """The main job's evals of one fixed validation subset at each stage, each printed with its 95% interval and
    saved to <run dir>/evals.json at once (the report reads it; a later crash keeps the earlier stages)."""

    def __init__(self, cfg, eval_generator, rows, rollout_log=None) -> None:
        self.cfg, self.eval_generator, self.rows, self.rollout_log = cfg, eval_generator, rows, rollout_log
        self.results = []

    async def run(self, stage: str) -> None:
        from skyrl_stepwise.trainer.loop import evaluate_prompts

        if self.rows:
            self.add(await evaluate_prompts(self.eval_generator, self.rows, stage, self.rollout_log))

    def add(self, result) -> None:
        from skyrl_stepwise.trainer.evaluation import save_evals

        self.results.append(result)
        save_evals(self.cfg.logging.output_dir, self.results)
        logger.info(f"eval {result.stage}: reward {result.describe()} ({result.seconds:.0f} s)")


def _report(cfg, tracker, failure: BaseException | None) -> None:
    """report.md + curves.png from what was logged, the plots into wandb, then close the tracker; a report that
    cannot be written is logged and never hides the run's own error."""
    from skyrl_stepwise.run_report import write_run_report

    try:
        report = write_run_report(cfg, Path(cfg.logging.output_dir), tracker.history, failure=failure)
        steps = [r["step"] for r in tracker.history]
        tracker.log_image("report/curves", report.parent / "curves.png", max(steps) if steps else None)
    except Exception:
        logger.exception("the run report could not be written")
    finally:
        tracker.finish()


def size_kv_cache(cfg) -> None:
    """CPU engines get the KV cache the run keeps in flight (engine.cpu_kvcache_gib=null), not a fixed guess:
    the issue's run held 46k tokens of cache for at most 16k in use."""
    import math

    import torch
    from transformers import AutoConfig

    from skyrl_stepwise.inference.config import kv_cache_gib

    if cfg.engine.cpu_kvcache_gib is not None or cfg.engine.backend != "vllm" or torch.cuda.is_available():
        return
    tokens = math.ceil(cfg.kv_cache_tokens() / cfg.engine.num_engines)
    cfg.engine.cpu_kvcache_gib = kv_cache_gib(tokens, AutoConfig.from_pretrained(cfg.engine.model_path),
                                              cfg.engine.dtype)
    logger.info(f"KV cache sized to the run: {tokens} tokens per engine ({cfg.engine.cpu_kvcache_gib:g} GiB)")


def check_envs_and_tools(cfg, rows) -> bool:
    """Every row's env_class registered and every tool of the `tool` env importable with known config keys,
    checked before anything slow starts (model, retriever, engines), so a typo fails in seconds naming what is
    registered. Returns whether the data needs the retriever (search rows, or tool rows with a search tool)."""
    from skyrl_stepwise.envs.builtin import check_env_classes
    from skyrl_stepwise.tools.base import check_tool_spec
    from skyrl_stepwise.tools.config import load_tools_yaml

    used = {r.env_class for r in rows}
    where = f"data ({cfg.data.train_path}" + (f", {cfg.data.val_path})" if cfg.data.val_path else ")")
    check_env_classes(sorted(used), cfg.environment, where)
    searches = "search" in used
    if "tool" in used:
        tools_path = cfg.environment.tool.tools_path
        if tools_path is None:
            searches = True  # the built-in search + calculator
        else:
            specs = load_tools_yaml(tools_path)
            for i, spec in enumerate(specs):
                check_tool_spec(spec, i)
            searches = searches or any(spec.class_name == "search" for spec in specs)
    return searches


@contextlib.contextmanager
def prepared(cfg):
    """Model and data on disk, the local retriever up for as long as the block runs; yields the rows."""
    from skyrl_stepwise.logging_setup import active_run_log, children_output_to
    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.retrieval.launch import local_retriever

    train_rows, val_rows = _datasets(cfg)
    logger.info(f"data: {len(train_rows)} train prompts, {len(val_rows)} eval prompts")
    needs_search = check_envs_and_tools(cfg, train_rows + val_rows)
    start = time.perf_counter()
    model = str(resolve_model_path(cfg.model_path))
    cfg.engine.model_path = cfg.trainer.model_path = model
    logger.info(f"model ready: {model} ({_since(start)})")
    size_kv_cache(cfg)
    retriever = cfg.environment.retriever
    with contextlib.ExitStack() as stack:
        url = None
        if needs_search and retriever.start_local:
            start = time.perf_counter()
            with children_output_to(active_run_log()):  # the server's start-up lines and index bars: run.log
                url = stack.enter_context(local_retriever(retriever.corpus, retriever.kind, retriever.port))
            cfg.environment.search.search_url = url
            logger.info(f"retriever up at {url} ({retriever.kind} over the {retriever.corpus} corpus, "
                        f"{_since(start)})")
        yield train_rows, val_rows


# the last step's metrics printed at the end (the report has every step)
SUMMARY_KEYS = ("reward/mean", "reward/pass_at_n", "environment/em", "eval/reward/mean", "eval/reward/ci_low",
                "eval/reward/ci_high", "policy/loss", "policy/kl_loss", "train/grad_norm", "generate/batch_padded_seq_len",
                "generate/merge_rate")


def run(cfg) -> dict:
    """Train with the console quiet and library output in run.log, then say where everything is.

    SIGTERM stops the run like Ctrl-C: every child (engines, Ray, the retriever) is shut down on the way out, the
    report says where it stopped, and the same command resumes from the last checkpoint. A start that fails before
    the first step still leaves a report.md that says why."""
    from skyrl_stepwise.logging_setup import run_logging
    from skyrl_stepwise.run_record import check_launch, config_tree
    from skyrl_stepwise.run_report import learning_summary, load_history
    from skyrl_stepwise.trainer.evaluation import load_evals

    out = Path(cfg.logging.output_dir)
    record = config_tree(cfg)  # as composed: before the run fills in model paths, ports and cache sizes
    check_launch(record, out, cfg.trainer.resume_allow_changes, logger.warning)
    launched = time.time()
    with run_logging(out, cfg.logging.console_level, cfg.logging.file_level) as run_log, sigterm_as_interrupt():
        logger.info(f"run dir: {out.resolve()} (vLLM, Ray and library output: {run_log.name})")
        start = time.perf_counter()
        try:
            with prepared(cfg) as (train_rows, val_rows):
                metrics = asyncio.run(_run(cfg, train_rows, val_rows, record))
        except BaseException as e:
            _explain_stop(cfg, out, e, launched)
            raise
        logger.info(f"done: {cfg.total_steps} steps in {time.perf_counter() - start:.0f} s; "
                    f"report in {(out / 'report.md').resolve()} (plots: curves.png), "
                    f"checkpoints in {Path(cfg.trainer.ckpt_dir).resolve()}")
        for key in (k for k in SUMMARY_KEYS if k in metrics):
            logger.info(f"  {key:40s} {metrics[key]:.4g}")
        for result in load_evals(out):
            logger.info(f"  eval {result.stage:34s} {result.describe()}")
        learning = learning_summary(load_history(out / "metrics.jsonl"))
        if learning:
            logger.info(f"  {learning}")
        if metrics.get("train/grad_norm") == 0.0:
            hint = "" if cfg.sft.enabled else (" Without a warm start a small model rarely gets any reward on a new "
                                               "task; SFT on a few demonstrations first (`sft.enabled=true "
                                               "sft.data=...`, README \"Your own task\") gives RL rewards to compare.")
            logger.info("note: in the last step every prompt group's trajectories scored the same, so every GRPO "
                        "advantage was 0 and the step had no policy gradient (only AdamW's weight decay and momentum "
                        "moved the weights)." + hint)
    return metrics


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (a scheduler's stop, `kill`) raises KeyboardInterrupt like Ctrl-C, so the same `finally` blocks
    shut every child down and the report is written; Python's default would end the process on the spot and
    leave the engines, Ray and the retriever running. Main thread only (where signal handlers live)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def is_interrupt(error: BaseException) -> bool:
    """Ctrl-C or SIGTERM, however it surfaced (inside asyncio it arrives as a cancelled task)."""
    return isinstance(error, (KeyboardInterrupt, asyncio.CancelledError))


def _explain_stop(cfg, out: Path, error: BaseException, launched: float) -> None:
    """One line on the console for a run that did not finish, and a report.md for a start that failed before the
    training loop wrote one (so the run dir says why)."""
    from skyrl_stepwise.run_report import load_history, write_run_report
    from skyrl_stepwise.trainer.checkpoint import complete_checkpoints

    report = out / "report.md"
    if not report.is_file() or report.stat().st_mtime < launched:
        try:
            write_run_report(cfg, out, [], failure=error)
        except Exception:
            logger.exception("the run report could not be written")
    steps = [r["step"] for r in load_history(out / "metrics.jsonl")]
    ckpt_dir = Path(cfg.trainer.ckpt_dir)
    ckpts = complete_checkpoints(ckpt_dir) if ckpt_dir.is_dir() else []
    resume = (f"the same command resumes from {ckpts[-1].name}" if ckpts else
              "no checkpoint to resume from (trainer.ckpt_interval)")
    if is_interrupt(error):
        logger.warning(f"interrupted at step {max(steps, default=0)} of {cfg.total_steps}; {resume}; "
                       f"report in {report.resolve()}")
    else:
        logger.error(f"failed{' before step 1' if not steps else ''}: {type(error).__name__}: "
                     f"{str(error).splitlines()[0] if str(error) else ''} (report: {report.resolve()}; "
                     f"details in run.log)")


def main(argv: list[str] | None = None) -> int:
    """CLI entry: Hydra overrides (`experiment=search_r1_tiny total_steps=10`) and flags (`--help`, `--cfg job`,
    `-m`). An interrupted run exits 130 with its one-line explanation, not a traceback."""
    try:
        return hydra_entry(run, list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
