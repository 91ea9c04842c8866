"""`skyrl-stepwise train [overrides] [hydra flags]` / `python -m skyrl_stepwise.cli.train`: the main job.

A Hydra application over conf/ (schema: skyrl_stepwise.run.config.RunConfig), so Hydra's conventions hold: `--help`,
`--cfg job`, `-m` sweeps, one output directory per run. Builds every component from the config (model, data,
local retriever, engines, generator, FSDP2 policy workers on Ray, tracker), hands them to RLTrainer, and writes
the run report (report.md, curves.png) into the run directory at the end, also when the run fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from skyrl_stepwise.run.app_config import (CONF_DIR, default_output_dir, hydra_entry, input_errors,  # noqa: F401
                                       load_config, to_run_config)
from skyrl_stepwise.run.setup import _since, check_envs_and_tools, plan_resources, prepared  # noqa: F401
from skyrl_stepwise.run.startup_failures import StartupFailure, starting

logger = logging.getLogger("skyrl_stepwise.cli.train")  # not __name__: `python -m` would make it "__main__"


async def _run(cfg, train_rows, val_rows, record: dict | None = None) -> dict:
    import ray
    from transformers import AutoConfig, AutoTokenizer

    from skyrl_stepwise.envs.builtin import build_env_registry
    from skyrl_stepwise.envs.openenv_local import stop_local_servers
    from skyrl_stepwise.generator import StepwiseGenerator
    from skyrl_stepwise.inference import create_engine
    from skyrl_stepwise.inference.vllm_engine import ensure_ray
    from skyrl_stepwise.inference.recovery import engines_of
    from skyrl_stepwise.run.placement import (cluster_gpus, create_placement_group, describe_nodes, plan_run_layout,
                                          role_options)
    from skyrl_stepwise.run.node_memory import check_cluster_memory
    from skyrl_stepwise.run.record import save_record
    from skyrl_stepwise.run.report import describe_lora, fsdp_backend
    from skyrl_stepwise.loop.warm_start import sft_history, sft_left_no_signal, sft_model
    from skyrl_stepwise.chat.adaptation import describe_chat_adaptation
    from skyrl_stepwise.loop.evaluation import eval_subset
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.tools.config import configured_tool_schemas
    from skyrl_stepwise.loop.rollout_samples import RolloutLog
    from skyrl_stepwise.loop.tracking import Tracker
    from skyrl_stepwise.policy.packing.layout import max_sliding_window
    from skyrl_stepwise.policy.weight_sync import WeightSync, weight_sync_probe_ids
    from skyrl_stepwise.policy.worker_group import PolicyGroup, ReferenceOnPolicyRanks

    owns_ray = not ray.is_initialized()  # a caller's Ray (e.g. a test session) is left running
    engine = policy = reference = tracker = placement_group = agents = weight_sync = None
    try:
        start = time.perf_counter()
        ensure_ray()
        hold_sigterm()  # Ray's core worker installs its own (abort on SIGTERM, children left running)
        tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.model_path)
        registry = build_env_registry(cfg.environment)
        layout = plan_run_layout(cfg, gpus_requested=sum(cluster_gpus().values()) > 0)
        placement_group = create_placement_group(layout, cfg.placement.ready_timeout_s)  # fails fast if it cannot fit
        logger.info(layout.describe())
        if layout.mode == "none":  # a CPU cluster: each node the engines or policy ranks may land on, its own view
            for line in check_cluster_memory(cfg):
                logger.info(f"resource plan, {line}")
        with starting(f"the {cfg.engine.backend} engine"):
            engine = create_engine(cfg.engine, role_options(placement_group, layout.engines,
                                                                cfg.placement.engine_resources))
        hold_sigterm()
        logger.info(f"engines up: {cfg.engine.num_engines} x {cfg.engine.backend} ({cfg.engine.dtype}, "
                    f"max_model_len {cfg.engine.max_model_len}) in {_since(start)}")
        eval_generator = StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator))
        logger.info(describe_chat_adaptation(eval_generator.loop.renderer))
        rollout_log = RolloutLog(cfg.logging.output_dir, eval_generator.loop.renderer, cfg.logging.num_rollout_samples,
                                 tools=configured_tool_schemas(cfg.environment.tool.tools_path),
                                 view_samples=cfg.logging.view_samples)
        if cfg.gateway.enabled:  # rows name agent programs: training and every eval run them through the endpoint
            from skyrl_stepwise.gateway.programs import AgentPrograms

            agents = AgentPrograms(tokenizer, engine, cfg.generator, eval_generator.cfg, cfg.gateway, registry,
                                   renderer=eval_generator.loop.renderer)
            with starting("the agent endpoint (gateway)"):
                eval_generator = (await agents.start()).eval
        evals = EvalStages(cfg, eval_generator, eval_subset(val_rows, cfg.data.max_eval_prompts, cfg.data.seed),
                           rollout_log)
        if cfg.sft.enabled:  # the warm start: base model -> eval -> SFT (cached) -> the policy starts from it
            if cfg.data.max_base_eval_prompts == 0:
                logger.info("eval before SFT: skipped (data.max_base_eval_prompts=0; a number evaluates the base "
                            "model on that many of the same prompts first)")
            await evals.run("before SFT", limit=cfg.data.max_base_eval_prompts)
            if cfg.engine.release_kv_during_update and hasattr(engine, "release_memory"):
                await engine.release_memory()  # the engine idles through SFT: its KV pages serve the trainer
            with starting("the SFT warm start", "failed"):
                cfg.trainer.model_path = str(await asyncio.to_thread(
                    sft_model, cfg, logger.info,
                    role_options(placement_group, layout.policy, cfg.placement.policy_resources),
                    Path(cfg.logging.output_dir) / "sft_metrics.jsonl"))
        start = time.perf_counter()
        use_kl = cfg.trainer.algorithm.use_kl_loss  # the reference lives in the policy's ranks
        with starting(f"the policy ranks ({cfg.trainer.fsdp.world_size} FSDP2)"):
            policy = PolicyGroup(cfg.trainer, with_reference=use_kl, actor_options=role_options(
                placement_group, layout.policy, cfg.placement.policy_resources))
        reference = ReferenceOnPolicyRanks(policy) if use_kl else None
        hold_sigterm()
        logger.info(f"workers up: policy{' + reference' if reference else ''} on {cfg.trainer.fsdp.world_size} "
                    f"FSDP2 rank(s) ({fsdp_backend(cfg.trainer.fsdp)}) in {_since(start)}")
        engine_nodes = [getattr(e, "node_id", None) for e in engines_of(engine)]
        if None not in engine_nodes:  # Ray actors (vLLM): say where each role landed
            logger.info(describe_nodes({"policy rank": policy.node_ids, "engine": engine_nodes}))
        weight_sync = WeightSync(cfg.weight_sync, policy, engine, engines_share_policy_gpus=layout.mode == "colocated",
                                 lora_sync=cfg.trainer.lora.sync)
        logger.info(f"weight sync: {weight_sync.method}; trains {describe_lora(cfg)}")
        packing = policy.call("packing_summary")
        for note in packing["notes"]:  # what the trainer changed to compute what the engines do
            logger.info(note)
        logger.info(f"packing: {packing['packing']} (trainer.packing={cfg.trainer.packing}) on {packing['layout']}; "
                    f"{packing['check']}")
        if cfg.sft.enabled:
            # the engines still hold the base model: the SFT model goes in once, in full (with
            # trainer.lora.sync=adapter it is the base every adapter version after it applies to)
            await weight_sync.sync_base()
            await evals.run("after SFT")
            zero = sft_left_no_signal(cfg, evals.results, sft_history(cfg.trainer.model_path))
            if zero:
                logger.warning(zero)
        tracker = Tracker(cfg.logging.output_dir, cfg.logging.project, cfg.logging.run_name, cfg.logging.wandb_mode,
                          dataclasses.asdict(cfg))
        rollout_log.tracker = tracker
        if record is not None:  # the job trains in this dir from now on: later launches are checked against it
            save_record(record, cfg.logging.output_dir)
        probe = weight_sync_probe_ids(tokenizer, max_sliding_window(AutoConfig.from_pretrained(cfg.trainer.model_path)),
                                      cfg.engine.max_model_len)
        generator = StepwiseGenerator(tokenizer, engine, registry, cfg.generator)
        if agents is not None:
            generator = agents.train
        trainer = RLTrainer(cfg, generator, eval_generator,
                            engine, policy, reference, tracker, train_rows, val_rows,
                            probe, weight_sync, rollout_log)
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
        if agents is not None:
            await agents.stop()
        if weight_sync is not None:
            weight_sync.close()
        if policy is not None:
            policy.shutdown()
        if engine is not None:
            getattr(engine, "shutdown", lambda: None)()
        if placement_group is not None:
            ray.util.remove_placement_group(placement_group)
        stop_local_servers()  # OpenEnv servers the run started (openenv:local://...)
        if owns_ray:
            ray.shutdown()


class EvalStages:
    """The main job's evals of one fixed validation subset at each stage, each printed with its 95% interval and
    saved to <run dir>/evals.json at once (the report reads it; a later crash keeps the earlier stages)."""

    def __init__(self, cfg, eval_generator, rows, rollout_log=None) -> None:
        self.cfg, self.eval_generator, self.rows, self.rollout_log = cfg, eval_generator, rows, rollout_log
        self.results = []

    async def run(self, stage: str, limit: int | None = None) -> None:
        """Evaluate the subset (its first `limit` prompts when given) and record the stage."""
        from skyrl_stepwise.loop.loop import evaluate_prompts

        rows = self.rows[:limit] if limit is not None else self.rows
        if rows:
            self.add(await evaluate_prompts(self.eval_generator, rows, stage, self.rollout_log))

    def add(self, result) -> None:
        from skyrl_stepwise.loop.evaluation import save_evals

        self.results.append(result)
        save_evals(self.cfg.logging.output_dir, self.results)
        logger.info(f"eval {result.stage}: reward {result.describe()} ({result.seconds:.0f} s)")


def _report(cfg, tracker, failure: BaseException | None) -> None:
    """report.md + curves.png from what was logged, the plots into wandb, then close the tracker; a report that
    cannot be written is logged and never hides the run's own error."""
    from skyrl_stepwise.run.report import write_run_report

    try:
        report = write_run_report(cfg, Path(cfg.logging.output_dir), tracker.history, failure=failure)
        steps = [r["step"] for r in tracker.history]
        tracker.log_image("report/curves", report.parent / "curves.png", max(steps) if steps else None)
    except Exception:
        logger.exception("the run report could not be written")
    finally:
        tracker.finish()


# the last step's metrics printed at the end (the report has every step)
SUMMARY_KEYS = ("reward/mean", "reward/pass_at_n", "environment/em", "eval/reward/mean", "eval/reward/ci_low",
                "eval/reward/ci_high", "policy/loss", "policy/kl_loss", "train/grad_norm", "generate/batch_padded_seq_len",
                "generate/merge_rate")


def run(cfg) -> dict:
    """Train with the console quiet and library output in run.log, then say where everything is.

    SIGTERM stops the run like Ctrl-C: every child (engines, Ray, the retriever) is shut down on the way out, the
    report says where it stopped, and the same command resumes from the last checkpoint. A start that fails before
    the first step still leaves a report.md that says why."""
    from skyrl_stepwise.host.logs import run_logging
    from skyrl_stepwise.run.record import check_launch, config_tree
    from skyrl_stepwise.run.report import learning_summary, load_history
    from skyrl_stepwise.loop.evaluation import load_evals, rl_minus_sft, score_label

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
        evals = load_evals(out)
        for result in evals:
            logger.info(f"  eval {result.stage:34s} {result.describe()}")
        history = load_history(out / "metrics.jsonl")
        paired = rl_minus_sft(evals, score_label(history))
        if paired:
            logger.info(f"  {paired}")
        learning = learning_summary(history)
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


_sigterm_held = False


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (a scheduler's stop, `kill`) raises KeyboardInterrupt like Ctrl-C, so the same `finally` blocks
    shut every child down and the report is written; Python's default would end the process on the spot and
    leave the engines, Ray and the retriever running. Main thread only (where signal handlers live)."""
    global _sigterm_held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    _sigterm_held = True
    try:
        yield
    finally:
        _sigterm_held = False
        signal.signal(signal.SIGTERM, previous)


def hold_sigterm() -> None:
    """Take SIGTERM back after a library installed its own handler (Ray's core worker aborts the process on it):
    within `sigterm_as_interrupt`, the run's handler must be the one that runs."""
    if _sigterm_held and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


def is_interrupt(error: BaseException) -> bool:
    """Ctrl-C or SIGTERM, however it surfaced (inside asyncio it arrives as a cancelled task)."""
    return isinstance(error, (KeyboardInterrupt, asyncio.CancelledError))


def _explain_stop(cfg, out: Path, error: BaseException, launched: float) -> None:
    """One line on the console for a run that did not finish, and a report.md for a start that failed before the
    training loop wrote one (so the run dir says why)."""
    from skyrl_stepwise.run.report import load_history, write_run_report
    from skyrl_stepwise.checkpoint.store import complete_checkpoints

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
        _traceback_to_run_log(error)
        what = str(error) if isinstance(error, StartupFailure) else \
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        when = f"after step {max(steps)} of {cfg.total_steps}" if steps else "before step 1"
        logger.error(f"failed {when}: {what} (report: {report.resolve()}; "
                     f"details in run.log)")


def _traceback_to_run_log(error: BaseException) -> None:
    """The whole traceback (with its causes) into run.log only: the console keeps its one line."""
    import traceback

    from skyrl_stepwise.host.logs import active_run_log

    path = active_run_log()
    if path is not None:
        with open(path, "a", encoding="utf-8") as f:
            f.write("the run stopped on this error:\n")
            traceback.print_exception(error, file=f)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: Hydra overrides (`experiment=search_r1_tiny total_steps=10`) and flags (`--help`, `--cfg job`,
    `-m`). An interrupted run exits 130 with its one-line explanation, not a traceback."""
    try:
        return hydra_entry(run, list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
