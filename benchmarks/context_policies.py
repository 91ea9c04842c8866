"""Context policies side by side on the same prompts: none / truncate / sliding_window / summarize (generator.context).

A long-horizon guessing task whose full history overflows a small context within a few turns: the env hides a
number in 1..N, each turn the model guesses (any integer in its reply) and the env answers "higher"/"lower" plus
~`--obs-tokens` tokens of log noise (a stand-in for long tool results). Reward 1 for the right number. With
`max_input_length` small, `none` runs out of context (stop reason `context_exhausted`), the others keep going.

Per arm, on the embedded SmolLM2-135M-Instruct (`prepare_model()`, transformers engine, CPU): fraction of
trajectories that ended by an answer (not a limit), reward mean with a 95% interval, turns, tokens forwarded per
step (prompt + response of the step samples), context edits and summaries, rollout seconds. Rollouts only; the
RL comparison after a few steps from the same warm start is a training run of conf/experiment/
long_context_tiny.yaml per policy (`generator.context.policy=...`).

    PYTHONPATH=. .venv/bin/python benchmarks/context_policies.py --prompts 2 --samples 2 --max-turns 4   # tiny
    PYTHONPATH=. .venv/bin/python benchmarks/context_policies.py                                        # default
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import time

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.generator.config import ContextConfig

POLICIES = ("none", "truncate", "sliding_window", "summarize")


class GuessEnv:
    """Guess the hidden number; each answer carries log noise, so the history grows fast."""

    def __init__(self, obs_tokens: int) -> None:
        self.obs_tokens, self.target, self.turns = obs_tokens, 0, 0

    async def reset(self, prompt, extras):
        self.target = int(extras["target"])
        return list(prompt)

    async def step(self, action_text):
        self.turns += 1
        numbers = [int(n) for n in re.findall(r"-?\d+", action_text)]
        if not numbers:
            hint = "No number found: reply with one integer."
        elif numbers[-1] == self.target:
            return StepResult([], 1.0, True, {"solved": 1.0})
        else:
            hint = "higher" if numbers[-1] < self.target else "lower"
        noise = " ".join(f"log{i}=ok" for i in range(self.obs_tokens // 4))
        return StepResult([{"role": "user", "content": f"{hint}. [server log: {noise}]"}], 0.0, False,
                          {"solved": 0.0})


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and a normal-approximation 95% interval (Wilson-free: the table reports it as +-)."""
    n = len(values)
    mean = sum(values) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    half = 1.96 * math.sqrt(var / n) if n else 0.0
    return mean, mean - half, mean + half


async def run_arm(policy: str, args, tokenizer, engine) -> dict:
    """One policy over the same prompts and seeds; the metrics of the table."""
    context = ContextConfig(policy=policy, max_observation_tokens=args.obs_tokens // 4, window=2,
                            summarize_threshold=(3 * args.max_input_length) // 4)
    cfg = GeneratorConfig(max_turns=args.max_turns, max_input_length=args.max_input_length, show_progress=False,
                          n_samples_per_prompt=args.samples, context=context,
                          sampling=GeneratorSamplingConfig(max_generate_length=args.max_generate, temperature=1.0,
                                                           seed=args.seed))
    registry = EnvRegistry()
    registry.register("guess", lambda: GuessEnv(args.obs_tokens))
    gen = StepwiseGenerator(tokenizer, engine, registry, cfg)
    rng = random.Random(args.seed)
    targets = [rng.randint(1, 100) for _ in range(args.prompts)]
    prompt = [{"role": "system", "content": "You are playing a guessing game. Reply with one integer."},
              {"role": "user", "content": "I am thinking of a number between 1 and 100. Guess it."}]
    ids = [TrajectoryID(f"p{i}", r) for i in range(args.prompts) for r in range(args.samples)]
    t0 = time.perf_counter()
    out = await gen.generate([prompt] * len(ids), ["guess"] * len(ids),
                             [{"target": targets[int(t.instance_id[1:])]} for t in ids], ids)
    seconds = time.perf_counter() - t0
    m = out.rollout_metrics
    last = [r for r, is_last in zip(out.stop_reasons, out.is_last_step) if is_last]
    rewards = {}
    for tid, r in zip(out.trajectory_ids, out.trajectory_rewards()):
        rewards[tid] = rewards.get(tid, 0.0) + r
    mean, low, high = interval(list(rewards.values()))
    return {"policy": policy, "answered": sum(r not in ("context_exhausted", "budget_exhausted") for r in last)
            / max(len(last), 1), "reward": mean, "low": low, "high": high,
            "turns": m["generate/turns_per_trajectory_mean"],
            "tokens_per_step": m["generate/real_tokens"] / max(len(out), 1),
            "edits": m["context/edits"], "summaries": m["context/summaries"],
            "exhausted": m["context/exhausted_trajectories"], "seconds": seconds}


def main() -> None:
    """Run every arm on the same prompts and print one markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=12)
    parser.add_argument("--max-input-length", type=int, default=640)
    parser.add_argument("--max-generate", type=int, default=24)
    parser.add_argument("--obs-tokens", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from skyrl_stepwise.inference import EngineConfig, HFEngine
    from skyrl_stepwise.models.prepare import prepare_model

    model_path = prepare_model()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = HFEngine(EngineConfig(backend="transformers", model_path=str(model_path), dtype="float32",
                                   max_model_len=args.max_input_length + args.max_generate + 8, seed=args.seed))
    rows = [asyncio.run(run_arm(p, args, tokenizer, engine)) for p in args.policies.split(",")]
    print("| policy | answered | reward [95% CI] | turns | tokens/step | edits | summaries | exhausted | rollout s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['answered']:.2f} | {r['reward']:.2f} [{r['low']:.2f}, {r['high']:.2f}] | "
              f"{r['turns']:.1f} | {r['tokens_per_step']:.0f} | {r['edits']} | {r['summaries']} | "
              f"{r['exhausted']} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
