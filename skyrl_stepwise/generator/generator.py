"""The batch generator: every trajectory of a batch runs concurrently, results become samples."""

from __future__ import annotations

import asyncio
from typing import Any

from tqdm.auto import tqdm

from skyrl_stepwise.envs.base import TAMPER_METRIC, EnvRegistry, Message
from skyrl_stepwise.generator.agent_loop import FAILURE_CAUSES, LIMIT_STOPS, AgentLoop, TrajectoryResult
from skyrl_stepwise.generator.config import GeneratorConfig
from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.metrics import sample_metrics
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.inference.base import InferenceEngine


def steps_to_output(results: list[TrajectoryResult]) -> GeneratorOutput:
    """One sample per step, steps of a trajectory contiguous, the step reward on its last token and the turn index
    on every token (so per-step credit survives merging).

    Failed trajectories give no samples (they are listed in failed_trajectory_ids); rollout_logprobs is None
    unless the engine returned logprobs for every step, so nothing downstream mistakes a placeholder for one.
    """
    kept = [r for r in results if r.failure is None]
    out = GeneratorOutput([], [], [], [], stop_reasons=[], rollout_logprobs=[], trajectory_ids=[],
                          is_last_step=[], turn_indices=[],
                          failed_trajectory_ids=[r.trajectory_id for r in results if r.failure],
                          failed_trajectories=[{"trajectory": r.trajectory_id.key(), "cause": r.failure,
                                                "message": r.failure_message,
                                                "samples": [[s.prompt_ids, s.response_ids, s.loss_mask]
                                                            for s in r.partial_steps]}
                                               for r in results if r.failure])
    dropped = 0
    for traj in kept:
        for i, step in enumerate(traj.steps):
            rewards = [0.0] * len(step.response_ids)
            if rewards:
                rewards[-1] = step.reward
            elif step.reward != 0.0:  # an empty turn has no token to carry its reward: counted, never hidden
                dropped += 1
            out.prompt_token_ids.append(step.prompt_ids)
            out.response_ids.append(step.response_ids)
            out.rewards.append(rewards)
            out.loss_masks.append(step.loss_mask)
            out.stop_reasons.append(step.stop_reason)
            out.rollout_logprobs.append(step.logprobs)
            out.trajectory_ids.append(traj.trajectory_id)
            out.is_last_step.append(i == len(traj.steps) - 1)
            out.turn_indices.append([i] * len(step.response_ids))
    out.rollout_metrics["generate/step_rewards_dropped_empty_turn"] = dropped
    out.context_events = [{"trajectory": traj.trajectory_id.key(), **event} for traj in kept
                          for event in traj.stats.context_events]
    out.tamper_suspected = [traj.trajectory_id.key() for traj in kept
                            if traj.stats.env_metrics.get(TAMPER_METRIC, 0.0) > 0]
    if any(step.logprobs is None for traj in kept for step in traj.steps):
        out.rollout_logprobs = None
    return out


def filter_overlong(results: list[TrajectoryResult], reasons: tuple[str, ...] = ("length", *LIMIT_STOPS)) -> int:
    """Zero the loss mask of trajectories that ended by length or a limit (context, token budget), not by the
    model's own choice (SkyRL's apply_overlong_filtering); `reasons=LIMIT_STOPS` alone is SUPO's handling of
    trajectories cut by a limit (generator.context.mask_limit_stops): no gradient rather than a made-up reward.
    A cut-off answer's reward says little about its tokens. Returns how many."""
    filtered = 0
    for traj in results:
        if traj.failure is None and traj.steps and traj.steps[-1].stop_reason in reasons:
            for step in traj.steps:
                step.loss_mask = [0] * len(step.loss_mask)
            filtered += 1
    return filtered


def filter_limit_stops(results: list[TrajectoryResult], cfg: GeneratorConfig) -> int:
    """The batch's trajectories that get no gradient by the run's rules, however they were rolled out (our agent
    loop or agent programs): generator.apply_overlong_filtering (cut by length or a limit) or
    generator.context.mask_limit_stops (cut by a limit). Returns how many (generate/overlong_filtered_trajectories)."""
    if cfg.apply_overlong_filtering:
        return filter_overlong(results)
    return filter_overlong(results, LIMIT_STOPS) if cfg.context.mask_limit_stops else 0


def trajectory_metrics(results: list[TrajectoryResult]) -> dict[str, float]:
    """Turns, template fallbacks, drift and where the time went, summed over the batch."""
    stats = [r.stats for r in results]
    failed = [r for r in results if r.failure is not None]
    results = [r for r in results if r.failure is None]  # rewards and turns: trained trajectories only
    n = max(len(results), 1)
    turns = [len(r.steps) for r in results]
    metrics = {
        "generate/num_trajectories": len(results),
        "generate/failed_trajectories": len(failed),
        "generate/turns_per_trajectory_mean": sum(turns) / n,
        "generate/turns_per_trajectory_max": max(turns, default=0),
        "generate/bridge_fallbacks": sum(s.bridge_fallbacks for s in stats),
        "generate/retokenize_drift_steps": sum(s.retokenize_drift_steps for s in stats),
        "generate/chain_breaks": sum(s.chain_breaks for s in stats),
        "generate/observation_role_fallbacks": sum(s.observation_role_fallbacks for s in stats),
        "generate/env_close_errors": sum(s.env_close_errors for s in stats),
        "generate/prompts_too_long": sum(s.prompt_too_long for s in stats),
        "generate/env_seconds": sum(s.env_seconds for s in stats),
        "generate/engine_seconds": sum(s.engine_seconds for s in stats),
        "generate/trajectory_reward_mean": sum(sum(st.reward for st in r.steps) for r in results) / n,
    }
    metrics.update(context_metrics(results, stats))
    for cause in FAILURE_CAUSES:
        metrics[f"generate/failed_trajectories/{cause}"] = sum(r.failure == cause for r in failed)
    for s in stats:
        for reason, count in s.fallback_reasons.items():
            key = f"generate/bridge_fallbacks/{reason}"
            metrics[key] = metrics.get(key, 0) + count
    divergences = [d for s in stats for d in s.first_divergence]
    if divergences:
        metrics["generate/retokenize_first_divergence_min"] = min(divergences)
    env_keys = {k for s in stats for k in s.env_metrics}
    for key in sorted(env_keys):  # the grading's suspicion is a reward metric of its own: the fraction of episodes
        name = key if key == TAMPER_METRIC else f"environment/{key}"
        metrics[name] = sum(s.env_metrics.get(key, 0.0) for s in stats) / n
    return metrics


def context_metrics(kept: list[TrajectoryResult], stats: list) -> dict[str, float]:
    """`context/*`: what the context policy did (edits are chain breaks of their own, not template fallbacks) and
    how trajectories ended at a limit; `context/fires_per_trajectory` 0 on a run says the policy never fired."""
    n = max(len(kept), 1)
    last = [r.steps[-1].stop_reason for r in kept if r.steps]
    return {
        "context/edits": sum(s.context_edits for s in stats),
        "context/tokens_dropped": sum(s.context_tokens_dropped for s in stats),
        "context/summaries": sum(s.context_summaries for s in stats),
        "context/summaries_skipped": sum(s.context_summaries_skipped for s in stats),
        "context/rerenders": sum(s.context_rerenders for s in stats),
        "context/fires_per_trajectory": sum(r.stats.context_fires for r in kept) / n,
        "context/trajectories_edited": sum(r.stats.context_fires > 0 for r in kept),
        "context/exhausted_trajectories": last.count("context_exhausted"),
        "context/budget_exhausted_trajectories": last.count("budget_exhausted"),
        "context/tokens_per_trajectory_mean": sum(r.stats.sampled_tokens + r.stats.observed_tokens
                                                  for r in kept) / n,
    }


async def cancel_in_flight(tasks: list[asyncio.Future]) -> None:
    """Cancel the batch's unfinished trajectories and wait until each has ended. A run stopped by Ctrl-C or SIGTERM
    cancels the step that awaits them; left pending, they were only cancelled after the engines and Ray had shut
    down, and failed on the way out (`No owner found for object`), logged as failed trajectories. Cancelled here,
    each ends as cancelled while the engines still answer: no failure, no warning. A second cancel (another
    Ctrl-C) stops the wait."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class StepwiseGenerator:
    """Turns prompts into training samples: step-wise, merged, or one per trajectory."""

    def __init__(self, tokenizer, engine: InferenceEngine, env_registry: EnvRegistry,
                 cfg: GeneratorConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.env_registry = env_registry
        self.loop = AgentLoop(tokenizer, engine, cfg)

    async def generate(self, prompts: list[list[Message]], env_classes: list[str],
                       env_extras: list[dict[str, Any]], trajectory_ids: list[TrajectoryID]) -> GeneratorOutput:
        """Run all trajectories concurrently (a long tail never blocks the rest) and build samples."""
        n = len(prompts)
        for name, values in (("env_classes", env_classes), ("env_extras", env_extras),
                             ("trajectory_ids", trajectory_ids)):
            if len(values) != n:
                raise ValueError(f"generate(): {name} has {len(values)} entries but prompts has {n}")
        envs = [self.env_registry.make(name) for name in env_classes]
        tasks = [asyncio.ensure_future(self.loop.run(env, p, x, t))
                 for env, p, x, t in zip(envs, prompts, env_extras, trajectory_ids)]
        try:
            with tqdm(total=n, desc="rollouts", unit="traj", disable=not self.cfg.show_progress) as bar:
                for done in asyncio.as_completed(tasks):
                    await done
                    bar.update(1)
        except BaseException:  # Ctrl-C / SIGTERM (a cancelled step): end them now, while the engines still answer
            await cancel_in_flight(tasks)
            raise
        results = [t.result() for t in tasks]  # input order, not completion order
        if results and all(r.failure is not None for r in results):
            causes = sorted({r.failure for r in results})
            raise RuntimeError(f"every trajectory of the batch failed ({', '.join(causes)}); first: "
                               f"{results[0].failure_message}")

        overlong = filter_limit_stops(results, self.cfg)
        output = steps_to_output(results)
        output.rollout_metrics.update(trajectory_metrics(results))
        output.rollout_metrics["generate/overlong_filtered_trajectories"] = overlong
        if not self.cfg.step_wise_trajectories or self.cfg.merge_stepwise_output:
            # With exact history a trajectory is one token chain, so merging its steps yields exactly
            # the whole-trajectory sample (observations masked); a template fallback starts a new chain.
            output = merge_stepwise_output(output)
        output.rollout_metrics.update(sample_metrics(output))
        output.validate()
        return output
