"""Does RL improve on the SFT warm start, and does per-step credit help? Paired evidence on >= 128 fixed prompts.

Arms (default `outcome` and `gigpo`, `trainer.algorithm.step_advantage`) start from the same seed and the same
(cached) SFT model, train the same number of RL steps and evaluate the same fixed held-out prompts greedily after
SFT and after RL. Because the prompts are the same, the comparison is *paired*: RL minus SFT (and each mode minus
outcome) is resampled prompt by prompt (a paired percentile bootstrap of the mean difference), which resolves a
gain that two overlapping per-stage intervals cannot. Also prints, per arm, what usually explains "RL does not
beat SFT": the share of prompt groups with reward variance, the KL to the reference, the entropy, the lr and the
number of steps. Writes `learning.md` and `learning.png` to the output folder.

    python benchmarks/search_r1_learning.py [--steps 8] [--eval-prompts 128] [--modes outcome gigpo]
        [--measure-kl] [hydra overrides, e.g. trainer.optim.lr=5e-5, before --modes]

About 20 minutes per arm on a 2-core CPU at the defaults (three evals of 128 greedy multi-turn rollouts, ~75 s
each, and 8 RL steps of 60-90 s; the SFT warm start, ~3 min, is cached after the first arm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from skyrl_stepwise.loop.evaluation import paired_bootstrap, transitions

# what usually explains "RL does not beat SFT": how many groups carry signal, how far the policy moved, what limits
# the reward (the gold answer retrieved vs answered), and how the per-step credit departs from the outcome
DIAGNOSTICS = ("dynamic_sampling/generated_signal_frac", "advantages/groups_with_signal_frac", "reward/mean",
               "environment/answer_retrieved", "environment/invalid_actions", "policy/kl_loss", "policy/ppo_kl",
               "policy/entropy", "policy/clip_frac", "train/grad_norm", "credit/sign_flip_frac")
# use_kl_loss with a zero coefficient: the reference's logprobs are computed and KL(policy || SFT model) is
# logged as policy/kl_loss, but nothing is added to the loss
MEASURE_KL = ["trainer.algorithm.use_kl_loss=true", "trainer.algorithm.kl_loss_coef=0"]
ARM_FILE = "arm.json"  # what an arm was run with and how long it took


def by_source(after: list[float], before: list[float], sources: list[str]) -> dict[str, tuple[int, float]]:
    """Per data source: prompts and mean paired difference (a source the RL prompts never cover may not move)."""
    groups: dict[str, list[float]] = {}
    for a, b, source in zip(after, before, sources):
        groups.setdefault(source, []).append(a - b)
    return {k: (len(v), statistics.fmean(v)) for k, v in sorted(groups.items())}


def stage_evals(run_dir: Path) -> dict:
    """Each saved eval stage ("after SFT", "after RL (step N)", ...) by name, with per-prompt scores."""
    from skyrl_stepwise.loop.evaluation import load_evals

    return {e.stage: e for e in load_evals(run_dir)}


def diagnostics(run_dir: Path) -> dict[str, float]:
    """Each diagnostic metric averaged over the run's RL steps (absent ones, or a folder without metrics.jsonl such
    as benchmarks/results/, are left out)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {k: statistics.fmean(r[k] for r in records if k in r) for k in DIAGNOSTICS if any(k in r for r in records)}


def plot(results: dict[str, dict], path: Path) -> None:
    """A bar per arm: its paired RL - SFT gain with the 95% interval (zero drawn, so "no gain" is plain to see)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.8 * len(names)), 4))
    means = [results[n]["rl_minus_sft"][0] for n in names]
    errors = [[m - results[n]["rl_minus_sft"][1] for n, m in zip(names, means)],
              [results[n]["rl_minus_sft"][2] - m for n, m in zip(names, means)]]
    ax.bar([n.replace("/", "\n").replace("_", "\n") for n in names], means, yerr=errors, capsize=6, alpha=0.7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("EM after RL - EM after SFT\n(paired, 95% bootstrap)")
    ax.set_title("Search-R1 tiny, SmolLM2-135M: RL gain over the SFT warm start", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def arm_result(run_dir: Path) -> dict:
    """One trained arm, read back from its run folder: paired RL - SFT, transitions, per-source gain, diagnostics."""
    stages = stage_evals(run_dir)
    after_rl = next((s for s in stages if s.startswith("after RL")), None)
    if "after SFT" not in stages or after_rl is None:
        raise RuntimeError(f"{run_dir}/evals.json has stages {list(stages)}: need 'after SFT' and 'after RL'")
    sft, rl = stages["after SFT"].scores, stages[after_rl].scores
    arm = json.loads((run_dir / ARM_FILE).read_text())
    return {**arm, "sft_scores": sft, "rl_scores": rl, "sft": statistics.fmean(sft), "rl": statistics.fmean(rl),
            "prompts": len(rl), "rl_minus_sft": paired_bootstrap(rl, sft), "transitions": transitions(rl, sft),
            "by_source": by_source(rl, sft, stages[after_rl].sources), "diagnostics": diagnostics(run_dir)}


def report(results: dict[str, dict], steps: int) -> str:
    """The markdown the README quotes: the paired table, each arm against the first, and the diagnostics."""
    prompts = sorted({r["prompts"] for r in results.values()})
    lines = [f"Paired on the same {'/'.join(map(str, prompts))} held-out prompts, {steps} RL steps per arm, greedy EM.",
             "", "| arm | lr | EM after SFT | EM after RL | RL - SFT [95% paired bootstrap] | fixed / broken | "
             "RL - SFT by source | minutes |", "|---|---:|---:|---:|---|---|---|---:|"]
    for name, r in results.items():
        d, lo, hi = r["rl_minus_sft"]
        sources = ", ".join(f"{k} ({n}) {m:+.3f}" for k, (n, m) in r["by_source"].items()) or "-"
        lines.append(f"| {name} | {r['lr']:g} | {r['sft']:.3f} | {r['rl']:.3f} | {d:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                     f"{r['transitions'][0]} / {r['transitions'][1]} | {sources} | {r['minutes']:.1f} |")
    bases: dict[str, str] = {}  # each run folder's first arm: arms of one folder share the seed and the SFT model
    for name in results:
        base = bases.setdefault(name.rsplit("/", 1)[0] if "/" in name else "", name)
        if base != name:
            d, lo, hi = paired_bootstrap(results[name]["rl_scores"], results[base]["rl_scores"])
            lines.append(f"\n{name} - {base} after RL (paired): {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    lines += pooled_over_runs(results, bases)
    lines += ["", "Diagnostics (mean over RL steps):", "",
              "| arm | " + " | ".join(DIAGNOSTICS) + " |", "|---|" + "---:|" * len(DIAGNOSTICS)]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{r['diagnostics'][k]:.4g}" if k in r["diagnostics"] else "-" for k in DIAGNOSTICS) + " |")
    return "\n".join(lines)


def pooled_over_runs(results: dict[str, dict], bases: dict[str, str]) -> list[str]:
    """Each mode run in several folders (seeds): its RL - SFT, and its difference from its folder's first arm,
    averaged per prompt over the runs and resampled by prompt, so a gain must hold up over training seeds and
    prompts at once (the per-run intervals above only resample prompts)."""
    by_mode: dict[str, list[str]] = {}
    for name, r in results.items():
        by_mode.setdefault(r["mode"], []).append(name)
    lines = []
    for mode, names in by_mode.items():
        if len(names) < 2 or len({results[n]["prompts"] for n in names}) != 1:
            continue
        per_prompt = [statistics.fmean(results[n]["rl_scores"][i] - results[n]["sft_scores"][i] for n in names)
                      for i in range(results[names[0]]["prompts"])]
        d, lo, hi = paired_bootstrap(per_prompt, [0.0] * len(per_prompt))
        lines.append(f"\n{mode}, pooled over {len(names)} runs: RL - SFT {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
        base_of = {n: bases[n.rsplit("/", 1)[0] if "/" in n else ""] for n in names}
        if any(base_of[n] == n for n in names):
            continue
        base_mode = results[base_of[names[0]]]["mode"]
        diff = [statistics.fmean(results[n]["rl_scores"][i] - results[base_of[n]]["rl_scores"][i] for n in names)
                for i in range(results[names[0]]["prompts"])]
        d, lo, hi = paired_bootstrap(diff, [0.0] * len(diff))
        lines.append(f"{mode} - {base_mode} after RL, pooled over {len(names)} runs: {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["outcome", "gigpo"])
    parser.add_argument("--out", default=None, help="output folder (default: outputs/search_r1_learning/<time>)")
    parser.add_argument("--measure-kl", action="store_true",
                        help="log KL(policy || SFT model) without penalising it (a reference pass per step)")
    parser.add_argument("--report", nargs="+", metavar="ARM_DIR", default=None,
                        help="train nothing: tabulate arm folders of earlier runs (OUT/<mode>); each arm is compared with "
                             "the first one listed from its own OUT folder")
    args, overrides = parser.parse_known_args()
    from skyrl_stepwise.policy.config import STEP_ADVANTAGES

    unknown = [m for m in args.modes if m not in STEP_ADVANTAGES]
    if unknown and not args.report:  # `--modes a b key=value` swallows the override as a mode
        parser.error(f"--modes {unknown} are not step_advantage modes {list(STEP_ADVANTAGES)}; put Hydra overrides "
                     f"before --modes (e.g. `trainer.algorithm.gamma=0.9 --modes discounted`)")
    if args.report:
        arms = {f"{Path(d).parent.name}/{Path(d).name}": Path(d) for d in args.report}
        out = Path(args.out or Path(args.report[0]).parent)
    else:
        if args.eval_prompts < 128:
            print(f"warning: {args.eval_prompts} eval prompts cannot resolve a few-point gain; the issue asks >= 128")
        out = Path(args.out or time.strftime("outputs/search_r1_learning/%Y-%m-%d_%H-%M-%S"))
        arms = {mode: out / mode for mode in args.modes}
        for mode, run_dir in arms.items():
            train_arm(mode, run_dir, args.steps, args.eval_prompts,
                      [*(MEASURE_KL if args.measure_kl else []), *overrides])
    results = {name: arm_result(run_dir) for name, run_dir in arms.items()}
    text = report(results, max(r["steps"] for r in results.values()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.md").write_text(text + "\n")
    plot(results, out / "learning.png")
    print(text)
    print(f"plot: {out / 'learning.png'}; table: {out / 'learning.md'}")


def train_arm(mode: str, run_dir: Path, steps: int, eval_prompts: int, overrides: list[str]) -> None:
    """The main job (eval, cached SFT, eval, RL, eval) for one step_advantage mode; writes arm.json beside it, so
    a finished arm is reported even when a later one fails (`--report`)."""
    from skyrl_stepwise.cli.train import load_config, run

    cfg = load_config(["experiment=search_r1_tiny", f"total_steps={steps}", f"eval_interval={steps}",
                       f"data.max_eval_prompts={eval_prompts}", f"trainer.algorithm.step_advantage={mode}",
                       "trainer.ckpt_interval=0", "logging.wandb_mode=disabled", f"logging.output_dir={run_dir}",
                       *overrides])
    start = time.perf_counter()
    run(cfg)
    arm = {"mode": mode, "lr": cfg.trainer.optim.lr, "steps": steps, "overrides": overrides,
           "minutes": (time.perf_counter() - start) / 60}
    (run_dir / ARM_FILE).write_text(json.dumps(arm, indent=1))


if __name__ == "__main__":
    main()
