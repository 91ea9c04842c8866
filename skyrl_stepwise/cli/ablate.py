"""`skyrl-stepwise ablate [hydra overrides]`: step-wise vs merged vs whole-trajectory, exact vs retokenize.

1. Replay: generate rollouts once per history mode (same seed, same prompts), build every mode's
   samples from the *identical* rollouts, and time one policy update on each: differences are due to
   the mode alone. Every update starts from the same snapshot (weights, optimizer and scheduler state, RNG),
   after one untimed warm-up update, with reference logprobs (KL loss) computed before the clock starts.
2. Curves (ablation.train_steps > 0): a short RL run per mode from that same snapshot.
Each mode's starting weight checksum goes into the report, so "same start" is shown, not assumed.
Writes report.md, costs.json, curves.json, costs.png, curves.png into ablation.output_dir and logs them to wandb.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path


def release_freed_memory() -> None:
    """Give freed heap pages back to the OS, so the RSS a measurement starts from is live memory and not what
    glibc kept from the previous mode's update (without it the first mode measured pays for all the rest)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then includes memory kept from earlier updates
        pass


def measure(fn) -> tuple[object, float, float]:
    """(result, seconds, peak memory MiB above the start): CUDA allocator peak, else sampled process RSS."""
    import psutil
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start, (torch.cuda.max_memory_allocated() - base) / 2**20
    release_freed_memory()
    proc, peak, stop = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        result = fn()
    finally:
        stop.set()
        sampler.join()
    return result, time.perf_counter() - start, max(peak[0] - base, 0) / 2**20


class LocalPolicy:
    """A single-process PolicyWorker behind the same `.call(method, *args)` as the Ray group;
    `trainable=False` is the reference model of the KL loss."""

    def __init__(self, trainer_cfg, trainable: bool = True) -> None:
        from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

        self.worker = PolicyWorker(replace(trainer_cfg, fsdp=replace(trainer_cfg.fsdp, world_size=1)), trainable)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


def save_rollouts(output, path: Path) -> None:
    """The replayed rollouts themselves, so every figure in the report can be recomputed from them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = dataclasses.asdict(output)
    record["trajectory_ids"] = [dataclasses.asdict(t) for t in output.trajectory_ids]
    path.write_text(json.dumps(record))


def replay_costs(stepwise, history: str, modes: list[str], policy, algorithm, reference=None,
                 warm_up: bool = False, repeats: int = 1) -> list[dict]:
    """Every mode's samples from the same rollouts, their token costs and one timed update each.

    The policy must hold a snapshot (PolicyWorker.snapshot): each mode's update starts from it, so no mode
    inherits another's weights or AdamW moments, and each row records the checksum of the weights it started
    from. Reference logprobs (algorithm.use_kl_loss) are computed before any clock starts. `warm_up` runs one
    untimed update first (on the largest batch): the first update of a process pays one-off set-up (allocator
    growth, thread pools, kernels) that would otherwise be charged to whichever mode happens to run first.
    `repeats`: timed updates per mode, each from the snapshot (the same update again); the row's train_step_s is
    their median, train_step_s_spread their max - min, train_step_s_runs all of them, peak_mem_mib the largest.
    A batch in which no trained token has an advantage is marked `zero_advantages` (the report flags it).
    """
    from skyrl_stepwise.ablation.modes import SampleCost, advantages_all_zero, build_samples, packing_of
    from skyrl_stepwise.ablation.report import timing_summary
    from skyrl_stepwise.algorithms.advantages import loss_weights
    from skyrl_stepwise.algorithms.credit import compute_advantages
    from skyrl_stepwise.policy.batching import TrainBatch

    if algorithm.use_kl_loss and reference is None:
        raise ValueError("trainer.algorithm.use_kl_loss=true needs a reference policy for the replay's updates")
    built = []
    for mode in modes:
        samples = build_samples(stepwise, mode)
        batch = TrainBatch.from_output(samples, compute_advantages(samples, algorithm),
                                       loss_weights=loss_weights(samples, algorithm))
        if algorithm.use_kl_loss:
            batch.ref_logprobs = reference.call("compute_logprobs", batch)
        built.append((mode, samples, batch))
    configured = policy.call("set_packing", "rows")  # every mode but `tree` trains plain rows
    if warm_up and built:
        policy.call("train_step", max((b for _, _, b in built), key=lambda b: sum(b.seq_lens())))
        if any(packing_of(mode) == "tree" for mode in modes):  # the tree path's first update pays its own set-up
            policy.call("set_packing", "tree")
            policy.call("train_step", built[0][2])
    rows = []
    for mode, samples, batch in built:
        policy.call("set_packing", packing_of(mode))
        runs, peak, metrics, start_weights = [], 0.0, {}, None
        for k in range(repeats):
            policy.call("restore_snapshot")
            if k == 0:
                start_weights = policy.call("weights_checksum")
            result, seconds, mem = measure(lambda: policy.call("train_step", batch))
            runs.append(seconds)
            peak = max(peak, mem)
            metrics = metrics or result  # every repeat is the same update from the same start
        seconds, spread = timing_summary(runs)
        m = samples.rollout_metrics
        cost = dataclasses.asdict(SampleCost.of(samples, packing_of(mode)))
        cost["forward_tokens"] = metrics.get("train/forward_tokens", cost["forward_tokens"])  # what actually ran
        rows.append({"history": history, "mode": mode, **cost,
                     "train_step_s": seconds, "train_step_s_spread": spread, "train_step_s_runs": runs,
                     "peak_mem_mib": peak, "start_weights": start_weights,
                     "zero_advantages": advantages_all_zero(batch.advantages, batch.loss_masks),
                     "grad_norm": metrics["train/grad_norm"],
                     **({"kl_loss": metrics["policy/kl_loss"]} if "policy/kl_loss" in metrics else {}),
                     "merge_rate": m.get("generate/merge_rate", 0.0),
                     "bridge_fallbacks": m.get("generate/bridge_fallbacks", 0),
                     "retokenize_drift_steps": m.get("generate/retokenize_drift_steps", 0),
                     "reward_mean": sum(samples.trajectory_rewards()) / max(len(set(samples.trajectory_ids)), 1)})
    policy.call("restore_snapshot")  # leave the policy as found
    policy.call("set_packing", configured)
    return rows


async def _ablate(cfg, rows) -> Path:
    import ray
    from transformers import AutoTokenizer

    from skyrl_stepwise.ablation.modes import packing_of
    from skyrl_stepwise.ablation.report import write_report
    from skyrl_stepwise.envs.builtin import build_env_registry
    from skyrl_stepwise.generator import StepwiseGenerator
    from skyrl_stepwise.inference import create_engine
    from skyrl_stepwise.inference.vllm_engine import ensure_ray
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config, expand
    from skyrl_stepwise.loop.tracking import Tracker
    from skyrl_stepwise.policy.weight_sync import WeightSync

    owns_ray = not ray.is_initialized()  # a caller's Ray (e.g. a test session) is left running
    ensure_ray()
    out_dir = Path(cfg.ablation.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.model_path)
    registry = build_env_registry(cfg.environment)
    from skyrl_stepwise.run.startup_failures import starting

    with starting(f"the {cfg.engine.backend} engine"):
        engine = create_engine(cfg.engine)
    n = cfg.generator.n_samples_per_prompt
    try:
        policy = LocalPolicy(cfg.trainer)
        policy.call("snapshot")  # the one starting point of every timed update and every mode's training run
        initial_weights = policy.call("weights_checksum")
        # the KL loss scores against the initial weights: one frozen copy serves the replay and every mode's run
        reference = LocalPolicy(cfg.trainer, trainable=False) if cfg.trainer.algorithm.use_kl_loss else None
        weight_sync = WeightSync(cfg.weight_sync, policy, engine)
        cost_rows = []
        for k, history in enumerate(cfg.ablation.histories):
            gen_cfg = replace(cfg.generator, history=history, step_wise_trajectories=True, merge_stepwise_output=False)
            stepwise = await StepwiseGenerator(tokenizer, engine, registry, gen_cfg).generate(*expand(rows, n, "ablate"))
            save_rollouts(stepwise, out_dir / f"rollouts_{history}.json")
            cost_rows += replay_costs(stepwise, history, cfg.ablation.modes, policy, cfg.trainer.algorithm,
                                      reference, warm_up=k == 0, repeats=cfg.ablation.timing_repeats)

        curves: dict[str, list[dict]] = {}
        curve_starts: dict[str, str] = {}
        for mode in cfg.ablation.modes if cfg.ablation.train_steps > 0 else []:
            policy.call("restore_snapshot")  # same weights, a fresh optimizer and schedule, same RNG
            await weight_sync.sync()  # the engine still holds the previous mode's trained weights
            curve_starts[mode] = policy.call("weights_checksum")
            # never reads or writes checkpoints: a ckpt_dir of its own keeps any real run's checkpoints out of it
            # and no dynamic sampling: each mode must train on the prompts the loader gives every mode, not on
            # whichever groups its own rollouts happened to find informative
            run_cfg = replace(cfg, total_steps=cfg.ablation.train_steps, eval_interval=0,
                              trainer=replace(cfg.trainer, ckpt_interval=0, resume="none",
                                              ckpt_dir=str(out_dir / mode / "ckpts"),
                                              algorithm=replace(cfg.trainer.algorithm, dynamic_sampling=False)))
            gen_cfg = replace(cfg.generator, step_wise_trajectories=mode != "trajectory",
                              merge_stepwise_output=mode == "step_wise_merged")
            configured = policy.call("set_packing", packing_of(mode))
            tracker = Tracker(out_dir / mode, cfg.logging.project, f"{cfg.logging.run_name}-{mode}", "disabled", {})
            trainer = RLTrainer(run_cfg, StepwiseGenerator(tokenizer, engine, registry, gen_cfg),
                                StepwiseGenerator(tokenizer, engine, registry, eval_config(gen_cfg)), engine, policy,
                                reference, tracker, rows, [], tokenizer("probe", add_special_tokens=False)["input_ids"],
                                weight_sync)
            await trainer.fit()
            policy.call("set_packing", configured)
            tracker.finish()
            curves[mode] = tracker.history
    finally:
        getattr(engine, "shutdown", lambda: None)()
        if owns_ray:
            ray.shutdown()

    kl = cfg.trainer.algorithm.use_kl_loss
    header = (f"model `{cfg.model_path}`, {len(rows)} prompts x {n} samples, max_turns {cfg.generator.max_turns}, "
              f"engine {cfg.engine.backend} ({cfg.engine.dtype}); replay: identical rollouts per history mode.\n\n"
              f"Every update and every training run starts from the initial weights (checksum `{initial_weights}`), "
              f"a fresh optimizer and LR schedule. Train step times are the median of {cfg.ablation.timing_repeats} "
              f"updates from that start (spread: max - min) and exclude one untimed warm-up update"
              + (" and the reference logprobs of the KL loss (computed once per batch, before the clock starts)"
                 if kl else "") + ".")
    report = write_report(out_dir, cost_rows, curves, header, curve_starts)
    (out_dir / "costs.json").write_text(json.dumps(cost_rows, indent=1))
    (out_dir / "curves.json").write_text(json.dumps(
        {"initial_weights": initial_weights,
         "modes": {m: {"start_weights": curve_starts[m], "steps": curves[m]} for m in curves}}, indent=1))
    _log_to_wandb(cfg, out_dir, cost_rows)
    return report


def _log_to_wandb(cfg, out_dir: Path, cost_rows: list[dict]) -> None:
    """The table and plots as one wandb run (offline unless configured online with a key)."""
    if cfg.logging.wandb_mode == "disabled":
        return
    import wandb

    from skyrl_stepwise.loop.tracking import Tracker

    tracker = Tracker(out_dir, cfg.logging.project, f"{cfg.logging.run_name}-ablation", cfg.logging.wandb_mode, {})
    columns = [c for c in cost_rows[0] if not isinstance(cost_rows[0][c], list)]  # per-repeat times: costs.json
    images = {f"ablation/{p.stem}": wandb.Image(str(p)) for p in sorted(out_dir.glob("*.png"))}
    tracker.wandb.log({"ablation/costs": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in cost_rows]),
                       **images})
    tracker.finish()


def run(cfg) -> Path:
    """The ablation with the run's console quiet and library output in <logging.output_dir>/run.log."""
    from skyrl_stepwise.host.logs import run_logging
    from skyrl_stepwise.run.setup import prepared

    if cfg.gateway.enabled:  # its modes are our own agent loop's: agent rows would be refused, plain rows mislabelled
        raise ValueError("skyrl-stepwise ablate compares our own agent loop's modes and does not run agent programs: "
                         "gateway.enabled=true is for `skyrl-stepwise train`")
    with run_logging(cfg.logging.output_dir, cfg.logging.console_level, cfg.logging.file_level):
        with prepared(cfg) as (train_rows, _):
            report = asyncio.run(_ablate(cfg, train_rows[: cfg.ablation.num_prompts]))
        print(f"\n{report.read_text()}\nreport: {report.resolve()}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI entry, a Hydra application like `train` (--help, --cfg job, -m):
    `skyrl-stepwise ablate experiment=search_r1_tiny ablation.num_prompts=8`."""
    from skyrl_stepwise.run.app_config import hydra_entry

    return hydra_entry(run, list(sys.argv[1:] if argv is None else argv), help_config="ablate")


if __name__ == "__main__":
    sys.exit(main())
