"""The batch generator: every trajectory of a batch runs concurrently, results become samples."""

from __future__ import annotations

import asyncio
from typing import Any

from tqdm.auto import tqdm

from skyrl_stepwise.envs.base import EnvRegistry, Message
from skyrl_stepwise.generator.agent_loop import AgentLoop, TrajectoryResult
from skyrl_stepwise.generator.config import GeneratorConfig
from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.metrics import sample_metrics
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.inference.base import InferenceEngine


def steps_to_output(results: list[TrajectoryResult]) -> GeneratorOutput:
    """One sample per step, steps of a trajectory contiguous, the step reward on its last token."""
    out = GeneratorOutput([], [], [], [], stop_reasons=[], rollout_logprobs=[], trajectory_ids=[],
                          is_last_step=[])
    for traj in results:
        for i, step in enumerate(traj.steps):
            rewards = [0.0] * len(step.response_ids)
            if rewards:
                rewards[-1] = step.reward
            out.prompt_token_ids.append(step.prompt_ids)
            out.response_ids.append(step.response_ids)
            out.rewards.append(rewards)
            out.loss_masks.append(step.loss_mask)
            out.stop_reasons.append(step.stop_reason)
            out.rollout_logprobs.append(step.logprobs)
            out.trajectory_ids.append(traj.trajectory_id)
            out.is_last_step.append(i == len(traj.steps) - 1)
    return out


def trajectory_metrics(results: list[TrajectoryResult]) -> dict[str, float]:
    """Turns, template fallbacks, drift and where the time went, summed over the batch."""
    stats = [r.stats for r in results]
    n = max(len(results), 1)
    turns = [len(r.steps) for r in results]
    metrics = {
        "generate/num_trajectories": len(results),
        "generate/turns_per_trajectory_mean": sum(turns) / n,
        "generate/turns_per_trajectory_max": max(turns, default=0),
        "generate/bridge_fallbacks": sum(s.bridge_fallbacks for s in stats),
        "generate/retokenize_drift_steps": sum(s.retokenize_drift_steps for s in stats),
        "generate/env_errors": sum(s.env_errors for s in stats),
        "generate/prompts_too_long": sum(s.prompt_too_long for s in stats),
        "generate/env_seconds": sum(s.env_seconds for s in stats),
        "generate/engine_seconds": sum(s.engine_seconds for s in stats),
        "generate/trajectory_reward_mean": sum(sum(st.reward for st in r.steps) for r in results) / n,
    }
    divergences = [d for s in stats for d in s.first_divergence]
    if divergences:
        metrics["generate/retokenize_first_divergence_min"] = min(divergences)
    env_keys = {k for s in stats for k in s.env_metrics}
    for key in sorted(env_keys):
        metrics[f"environment/{key}"] = sum(s.env_metrics.get(key, 0.0) for s in stats) / n
    return metrics


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
        with tqdm(total=n, desc="rollouts", unit="traj", disable=not self.cfg.show_progress) as bar:
            for done in asyncio.as_completed(tasks):
                await done
                bar.update(1)
        results = [t.result() for t in tasks]  # input order, not completion order

        output = steps_to_output(results)
        output.rollout_metrics.update(trajectory_metrics(results))
        if not self.cfg.step_wise_trajectories or self.cfg.merge_stepwise_output:
            # With exact history a trajectory is one token chain, so merging its steps yields exactly
            # the whole-trajectory sample (observations masked); a template fallback starts a new chain.
            output = merge_stepwise_output(output)
        output.rollout_metrics.update(sample_metrics(output))
        output.validate()
        return output
