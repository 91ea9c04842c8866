"""Does RL improve on the SFT warm start, and does per-step credit help? Paired evidence on >= 128 fixed prompts.

Arms (default `outcome` and `gigpo`, `trainer.algorithm.step_advantage`) start from the same seed and the same
(cached) SFT model, train the same number of RL steps and evaluate the same fixed held-out prompts greedily after
SFT and after RL. Because the prompts are the same, the comparison is *paired*: RL minus SFT (and each mode minus
outcome) is resampled prompt by prompt (a paired percentile bootstrap of the mean difference), which resolves a
gain that two overlapping per-stage intervals cannot. Also prints, per arm, what usually explains "RL does not
beat SFT": the share of prompt groups with reward variance, the KL to the reference, the entropy, the lr and the
number of steps. Writes `learning.md` and `learning.png` to the output folder.

    python benchmarks/search_r1_learning.py [--steps 8] [--eval-prompts 128] [--modes outcome gigpo]
        [hydra overrides...]

Several hours on a 2-core CPU at the defaults (each eval is 128 greedy multi-turn rollouts); minutes on a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

DIAGNOSTICS = ("advantages/groups_with_signal_frac", "reward/mean", "policy/kl_loss", "policy/ppo_kl",
               "policy/entropy", "policy/clip_frac", "train/grad_norm", "credit/sign_flip_frac")


def paired_bootstrap(after: list[float], before: list[float], level: float = 0.95, resamples: int = 4000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of after - before over the same prompts and its percentile interval, resampling prompts (pairs)."""
    if len(after) != len(before) or not after:
        raise ValueError(f"a paired comparison needs the same prompts in both evals, got {len(after)} and "
                         f"{len(before)} scores (a trajectory whose infrastructure failed is left out of an eval)")
    diffs = [a - b for a, b in zip(after, before)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    return sum(diffs) / n, means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]


def stage_scores(run_dir: Path) -> dict[str, list[float]]:
    """Per-prompt scores of each saved eval stage ("after SFT", "after RL (step N)", ...)."""
    from skyrl_stepwise.trainer.evaluation import load_evals

    return {e.stage: e.scores for e in load_evals(run_dir)}


def diagnostics(run_dir: Path) -> dict[str, float]:
    """Each diagnostic metric averaged over the run's RL steps (absent ones are left out)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {k: statistics.fmean(r[k] for r in records if k in r) for k in DIAGNOSTICS if any(k in r for r in records)}


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(results)
    means = [results[n]["rl_minus_sft"][0] for n in names]
    errors = [[m - results[n]["rl_minus_sft"][1] for n, m in zip(names, means)],
              [results[n]["rl_minus_sft"][2] - m for n, m in zip(names, means)]]
    ax.bar(names, means, yerr=errors, capsize=6, alpha=0.7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("EM after RL - EM after SFT (paired, 95% bootstrap)")
    ax.set_title("Search-R1 tiny, SmolLM2-135M: RL gain over the SFT warm start")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["outcome", "gigpo"])
    parser.add_argument("--out", default=None, help="output folder (default: outputs/search_r1_learning/<time>)")
    args, overrides = parser.parse_known_args()
    if args.eval_prompts < 128:
        print(f"warning: {args.eval_prompts} eval prompts cannot resolve a few-point gain; the issue asks >= 128")
    from skyrl_stepwise.train import load_config, run

    out = Path(args.out or time.strftime("outputs/search_r1_learning/%Y-%m-%d_%H-%M-%S"))
    results: dict[str, dict] = {}
    final_scores: dict[str, list[float]] = {}
    for mode in args.modes:
        run_dir = out / mode
        cfg = load_config(["experiment=search_r1_tiny", f"total_steps={args.steps}", f"eval_interval={args.steps}",
                           f"data.max_eval_prompts={args.eval_prompts}", f"trainer.algorithm.step_advantage={mode}",
                           "trainer.ckpt_interval=0", "logging.wandb_mode=disabled", f"logging.output_dir={run_dir}",
                           *overrides])
        start = time.perf_counter()
        run(cfg)
        stages = stage_scores(run_dir)
        after_rl = next((s for s in stages if s.startswith("after RL")), None)
        if "after SFT" not in stages or after_rl is None:
            raise RuntimeError(f"{run_dir}/evals.json has stages {list(stages)}: need 'after SFT' and 'after RL'")
        sft, rl = stages["after SFT"], stages[after_rl]
        final_scores[mode] = rl
        results[mode] = {"sft": statistics.fmean(sft), "rl": statistics.fmean(rl), "prompts": len(rl),
                         "rl_minus_sft": paired_bootstrap(rl, sft), "minutes": (time.perf_counter() - start) / 60,
                         "diagnostics": diagnostics(run_dir), "lr": cfg.trainer.optim.lr}

    lines = [f"Paired on the same {args.eval_prompts} held-out prompts, {args.steps} RL steps per arm, greedy EM.", "",
             "| step_advantage | EM after SFT | EM after RL | RL - SFT [95% paired bootstrap] | minutes |",
             "|---|---:|---:|---|---:|"]
    for mode, r in results.items():
        d, lo, hi = r["rl_minus_sft"]
        lines.append(f"| {mode} | {r['sft']:.3f} | {r['rl']:.3f} | {d:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                     f"{r['minutes']:.1f} |")
    base = args.modes[0]
    for mode in args.modes[1:]:
        d, lo, hi = paired_bootstrap(final_scores[mode], final_scores[base])
        lines.append(f"\n{mode} - {base} after RL (paired): {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    lines += ["", "Diagnostics (mean over RL steps):", "",
              "| step_advantage | lr | " + " | ".join(DIAGNOSTICS) + " |", "|---|---:|" + "---:|" * len(DIAGNOSTICS)]
    for mode, r in results.items():
        lines.append(f"| {mode} | {r['lr']:g} | " + " | ".join(
            f"{r['diagnostics'][k]:.4g}" if k in r["diagnostics"] else "-" for k in DIAGNOSTICS) + " |")
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.md").write_text(text + "\n")
    plot(results, out / "learning.png")
    print(text)
    print(f"plot: {out / 'learning.png'}; table: {out / 'learning.md'}")


if __name__ == "__main__":
    main()
