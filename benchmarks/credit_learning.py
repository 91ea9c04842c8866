"""Which step credit learns a delayed reward? outcome vs discounted vs gigpo on the key-door game, SmolLM2-135M, CPU.

The game (envs/key_door.py) has three turns: greet the guard, pick one of two keys (the decision), try the door
(reward 1 if the key was right). Each mode trains from the same SmolLM2 weights for the same number of steps with
the same seeds; the learning curve is the mean reward of each step's own rollouts, reported as the mean over
seeds with a 95% t-interval, as a table and a plot.

It runs in one process without Ray or vLLM, so it fits a small CPU box: the transformers engine (HFEngine)
samples with the policy's own weights (one model object: no weight sync), the generator merges each trajectory
into one sample, and an on-policy PPO update (one mini-batch per step) uses the library's loss and packing.

    python benchmarks/credit_learning.py [--steps 6] [--seeds 0 1 2] [--modes outcome discounted gigpo]
        [--prompts 2] [--n 4] [--temperature 0.7] [--lr 2e-5] [--gamma 0.9] [--out benchmarks/results/credit_learning]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from pathlib import Path

T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def rows_for_step(step: int, seed: int, prompts: int) -> list[dict]:
    """The step's prompts: a door key and a decoy drawn from six colours, shown in random order. Depends on the
    seed and step only, so every mode sees the same prompts."""
    from skyrl_stepwise.envs.key_door import COLOURS, key_door_prompt

    rng = random.Random(f"{seed}:{step}")
    rows = []
    for i in range(prompts):
        door, other = rng.sample(COLOURS, 2)
        first = rng.choice((door, other))
        rows.append({"prompt": key_door_prompt(door), "instance_id": f"s{step}p{i}",
                     "extra_info": {"door_key": door, "other_key": other, "first_key": first}})
    return rows


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval over seeds."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = T_95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


async def train_run(mode: str, seed: int, args) -> list[dict]:
    """One learning curve: `args.steps` RL steps of `mode` from the embedded SmolLM2 with seed `seed`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skyrl_stepwise.envs.base import EnvRegistry
    from skyrl_stepwise.envs.key_door import TURNS, KeyDoorEnv
    from skyrl_stepwise.generator import StepwiseGenerator, TrajectoryID
    from skyrl_stepwise.generator.config import GeneratorConfig, GeneratorSamplingConfig
    from skyrl_stepwise.inference.config import EngineConfig
    from skyrl_stepwise.inference.hf_engine import HFEngine
    from skyrl_stepwise.models.prepare import resolve_model_path
    from skyrl_stepwise.algorithms.advantages import loss_weights
    from skyrl_stepwise.policy.batching import TrainBatch, pack_indices, pack_micro_batch
    from skyrl_stepwise.policy.config import AlgorithmConfig
    from skyrl_stepwise.algorithms.credit import compute_credit
    from skyrl_stepwise.policy.fsdp_worker import micro_batch_loss

    torch.manual_seed(seed)
    path = resolve_model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = HFEngine(EngineConfig(model_path=path, backend="transformers", dtype="float32", seed=seed,
                                   max_batch_size=args.prompts * args.n))
    engine.model = model  # the engine samples from the weights being trained: no sync, exactly on-policy
    registry = EnvRegistry()
    registry.register("key_door", KeyDoorEnv)
    generator = StepwiseGenerator(tokenizer, engine, registry, GeneratorConfig(
        max_turns=TURNS, n_samples_per_prompt=args.n, merge_stepwise_output=True, show_progress=False,
        sampling=GeneratorSamplingConfig(max_generate_length=args.max_tokens, temperature=args.temperature,
                                         seed=seed)))
    algo = AlgorithmConfig(step_advantage=mode, gamma=args.gamma, step_advantage_weight=args.omega,
                           use_kl_loss=False, tis_ratio_clip_high=None)
    algo.validate()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    curve = []
    for step in range(args.steps):
        start = time.perf_counter()
        rows = rows_for_step(step, seed, args.prompts)
        expanded = [(r, k) for r in rows for k in range(args.n)]
        output = await generator.generate(
            [r["prompt"] for r, _ in expanded], ["key_door"] * len(expanded),
            [{"extra_info": r["extra_info"]} for r, _ in expanded],
            [TrajectoryID(r["instance_id"], k) for r, k in expanded])
        credit = compute_credit(output, algo)
        batch = TrainBatch.from_output(output, credit.advantages, loss_weights=loss_weights(output, algo))
        model.train()
        optimizer.zero_grad(set_to_none=True)
        denominator = batch.loss_denominator()
        for idx in pack_indices(batch.seq_lens(), args.micro_batch_tokens):
            loss, _ = micro_batch_loss(model, pack_micro_batch(batch, idx), algo, denominator, args.temperature)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.eval()
        m = output.rollout_metrics
        record = {"mode": mode, "seed": seed, "step": step, "reward": m["generate/trajectory_reward_mean"],
                  "picked_door_key": m.get("environment/picked_door_key", 0.0),
                  "picked_no_key": m.get("environment/picked_no_key", 0.0),
                  "seconds": time.perf_counter() - start,
                  **{k: v for k, v in credit.metrics.items() if not k.startswith("credit/reward_turn")}}
        curve.append(record)
        print(json.dumps(record), flush=True)
    return curve


def report(records: list[dict], out: Path) -> str:
    """Markdown table (mean [95% CI] over seeds per step and mode) and a plot next to it."""
    modes = list(dict.fromkeys(r["mode"] for r in records))
    steps = sorted({r["step"] for r in records})
    seeds = sorted({r["seed"] for r in records})
    cell = {}
    for mode in modes:
        for step in steps:
            values = [r["reward"] for r in records if r["mode"] == mode and r["step"] == step]
            cell[(mode, step)] = interval(values) if values else None
    lines = [f"Mean trajectory reward of each step's rollouts, mean [95% t-interval] over the seeds each mode "
             f"completed (of {seeds}; see `seeds` below).", "",
             "| step | " + " | ".join(modes) + " |", "|---:|" + "---|" * len(modes)]
    for step in steps:
        lines.append(f"| {step} | " + " | ".join(
            f"{c[0]:.3f} [{c[1]:.3f}, {c[2]:.3f}]" if c else "-" for c in (cell[(m, step)] for m in modes)) + " |")
    k = max(1, len(steps) // 3)
    lines += ["", f"| mode | seeds | last {k} steps, mean over seeds [95% CI of the seed means] | seconds / step |",
              "|---|---:|---|---:|"]
    for mode in modes:
        per_seed = [statistics.fmean(r["reward"] for r in records if r["mode"] == mode and r["seed"] == s
                                     and r["step"] >= steps[-1] - k + 1) for s in seeds
                    if any(r["mode"] == mode and r["seed"] == s for r in records)]
        mean, lo, hi = interval(per_seed)
        secs = statistics.fmean(r["seconds"] for r in records if r["mode"] == mode)
        lines.append(f"| {mode} | {len(per_seed)} | {mean:.3f} [{lo:.3f}, {hi:.3f}] | {secs:.1f} |")
    base = modes[0]
    for mode in modes[1:]:  # same seeds, same prompts, same step-0 samples: compare seed by seed
        both = [s for s in seeds if all(any(r["mode"] == m and r["seed"] == s for r in records) for m in (mode, base))]
        diffs = [statistics.fmean(r["reward"] for r in records if r["mode"] == mode and r["seed"] == s
                                  and r["step"] >= steps[-1] - k + 1)
                 - statistics.fmean(r["reward"] for r in records if r["mode"] == base and r["seed"] == s
                                    and r["step"] >= steps[-1] - k + 1) for s in both]
        if diffs:
            mean, lo, hi = interval(diffs)
            lines.append(f"\n{mode} - {base}, last {k} steps, paired over {len(diffs)} seeds: "
                         f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in modes:
            xs = [s for s in steps if cell[(mode, s)]]
            mean, lo, hi = zip(*(cell[(mode, s)] for s in xs))
            ax.plot(xs, mean, marker="o", label=mode)
            ax.fill_between(xs, lo, hi, alpha=0.2)
        ax.set(xlabel="RL step", ylabel="mean reward (door opened), 95% t-interval over seeds",
               title="key-door game, SmolLM2-135M, CPU", ylim=(-0.05, 1.05))
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "credit_learning.png", dpi=120)
    except ImportError:
        lines.append("\n(matplotlib not installed: no plot)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=["outcome", "discounted", "gigpo"])
    parser.add_argument("--prompts", type=int, default=2, help="prompt groups per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per turn")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--gamma", type=float, default=0.9)
    parser.add_argument("--omega", type=float, default=1.0, help="gigpo's step_advantage_weight")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/credit_learning"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "records.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    finished = {(r["mode"], r["seed"]) for r in done if r["step"] == args.steps - 1}
    records = [r for r in done if (r["mode"], r["seed"]) in finished]  # resume: keep complete curves only
    start = time.perf_counter()
    for seed in args.seeds:  # seeds outermost: an interrupted run still has every mode for the first seeds
        for mode in args.modes:
            if (mode, seed) in finished:
                continue
            curve = asyncio.run(train_run(mode, seed, args))
            records += curve
            with log.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in curve)
    table = report(records, args.out)
    (args.out / "table.md").write_text(table + "\n")
    print(f"\n{table}\n\n(total {time.perf_counter() - start:.0f} s; records in {log})")


if __name__ == "__main__":
    main()
