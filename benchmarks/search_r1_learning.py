"""Does RL improve on the SFT warm start? Search-R1 tiny, longer: eval EM with 95% intervals along the run.

Two arms from the same seed and the same (cached) SFT model: step-wise samples merged prefix-aware (the
default) and step-wise unmerged. Each arm evaluates the same validation prompts greedily after SFT and every
`--eval-every` RL steps. Prints a table, writes `learning.md` and `learning.png` (EM vs RL step, interval bands).

    python benchmarks/search_r1_learning.py [--steps 8] [--eval-every 4] [--eval-prompts 48] [hydra overrides...]

About 45 minutes on a 2-core CPU at the defaults (each arm: ~1 min start-up, 5 evals, 8 RL steps).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ARMS = {"step-wise merged": ["generator.merge_stepwise_output=true"],
        "step-wise unmerged": ["generator.merge_stepwise_output=false"]}


def curve(run_dir: Path) -> list[tuple[int, float, float, float]]:
    """(RL step, EM, interval low, interval high): step 0 is the eval after SFT, then every logged eval."""
    from skyrl_stepwise.trainer.evaluation import load_evals

    points = [(0, e.mean, e.ci_low, e.ci_high) for e in load_evals(run_dir) if e.stage == "after SFT"]
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "eval/reward/mean" in r:
            points.append((r["step"], r["eval/reward/mean"], r["eval/reward/ci_low"], r["eval/reward/ci_high"]))
    return points


def plot(curves: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, points), marker in zip(curves.items(), "os^D"):
        steps, em, low, high = zip(*points)
        ax.plot(steps, em, marker=marker, label=name)
        ax.fill_between(steps, low, high, alpha=0.2)
    ax.set_xlabel("RL step (0 = after SFT)")
    ax.set_ylabel("eval EM (greedy), 95% bootstrap interval")
    ax.set_title("Search-R1 tiny: SmolLM2-135M, SFT warm start then GRPO")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(curves: dict[str, list], before_sft) -> str:
    lines = ["| arm | RL step | EM | 95% interval |", "|---|---:|---:|---|"]
    if before_sft is not None:
        lines.append(f"| base model (before SFT) | - | {before_sft.mean:.3f} | "
                     f"[{before_sft.ci_low:.3f}, {before_sft.ci_high:.3f}] |")
    for name, points in curves.items():
        lines += [f"| {name} | {s} | {em:.3f} | [{lo:.3f}, {hi:.3f}] |" for s, em, lo, hi in points]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=48)
    parser.add_argument("--out", default=None, help="output folder (default: outputs/search_r1_learning/<time>)")
    args, overrides = parser.parse_known_args()
    from skyrl_stepwise.train import load_config, run
    from skyrl_stepwise.trainer.evaluation import load_evals

    out = Path(args.out or time.strftime("outputs/search_r1_learning/%Y-%m-%d_%H-%M-%S"))
    curves, before_sft, seconds = {}, None, {}
    for name, arm in ARMS.items():
        run_dir = out / name.replace(" ", "_")
        cfg = load_config(["experiment=search_r1_tiny", f"total_steps={args.steps}",
                           f"eval_interval={args.eval_every}", f"data.max_eval_prompts={args.eval_prompts}",
                           "trainer.ckpt_interval=0", "logging.wandb_mode=disabled", f"logging.output_dir={run_dir}",
                           *arm, *overrides])
        start = time.perf_counter()
        run(cfg)
        seconds[name] = time.perf_counter() - start
        curves[name] = curve(run_dir)
        before_sft = before_sft or next((e for e in load_evals(run_dir) if e.stage == "before SFT"), None)
    plot(curves, out / "learning.png")
    text = table(curves, before_sft)
    (out / "learning.md").write_text(f"{text}\n\nwall time per arm: "
                                     + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items()) + "\n")
    print(text)
    for name, points in curves.items():
        (_, sft_em, sft_lo, sft_hi), (step, end_em, end_lo, end_hi) = points[0], points[-1]
        verdict = "above" if end_lo > sft_hi else "below" if end_hi < sft_lo else "not separable from"
        print(f"{name}: EM after SFT {sft_em:.3f} [{sft_lo:.3f}, {sft_hi:.3f}] -> after {step} RL steps "
              f"{end_em:.3f} [{end_lo:.3f}, {end_hi:.3f}]: {verdict} SFT (intervals); {seconds[name] / 60:.1f} min")
    print(f"plot: {out / 'learning.png'}; table: {out / 'learning.md'}")


if __name__ == "__main__":
    main()
