"""The ablation's outputs: a markdown table people can paste and PNG plots people would rather look at.

Two things the table alone would hide are stated: how noisy each timing is (median and spread of repeated
updates from the same start), and which batches or training steps had no advantage on any trained token (every
sample of each group scored alike: the update is a no-op, so its time and grad norm compare nothing).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COST_COLUMNS = [("samples", "samples / step"), ("forward_tokens", "forward tokens"),
                ("padded_tokens", "padded tokens"), ("batch_padded_seq_len", "batch_padded_seq_len"),
                ("trained_tokens", "trained tokens"), ("train_step_s", "train step (s)"),
                ("train_step_s_spread", "spread (s)"),
                ("peak_mem_mib", "peak mem (MiB)"), ("merge_rate", "merge rate"),
                ("bridge_fallbacks", "bridge fallbacks"), ("retokenize_drift_steps", "retok. drift steps"),
                # the update itself: from the same start, trajectory and step-wise samples of the same tokens give
                # the same token-mean loss, so equal checksums and (near-)equal grad norms are the sanity check
                ("grad_norm", "grad norm"), ("kl_loss", "KL loss"), ("start_weights", "start weights")]


def timing_summary(seconds: list[float]) -> tuple[float, float]:
    """(median, spread = max - min) of repeated timings of one update; one timing has spread 0."""
    return statistics.median(seconds), max(seconds) - min(seconds)


def flags(rows: list[dict], curves: dict[str, list[dict]] | None = None) -> list[str]:
    """One line per replayed batch (history, mode) whose advantages are all zero, and per training step that
    trained no group with signal (`advantages/groups_with_signal` = 0)."""
    lines = [f"- replay `{r['history']}` / `{r['mode']}`: every advantage is 0 (each group's samples scored alike), "
             "so the update only applies the KL term, if any: its time and grad norm compare a no-op. More prompts "
             "(ablation.num_prompts) or samples (generator.n_samples_per_prompt) give groups that differ."
             for r in rows if r.get("zero_advantages")]
    for mode, steps in (curves or {}).items():
        lines += [f"- training `{mode}` step {s['step']}: no group with a non-zero advantage (nothing learned)"
                  for s in steps if s.get("advantages/groups_with_signal") == 0]
    return lines


def _fmt(value) -> str:
    if isinstance(value, float):
        if 0 < abs(value) < 1e-3:  # a KL loss near the reference would read 0.000
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    """One row per (history, mode), plus each mode's forward tokens relative to step-wise; a column no row has
    (KL loss with the KL loss off) is left out."""
    columns = [(key, title) for key, title in COST_COLUMNS if any(key in r for r in rows)]
    head = ["history", "mode"] + [title for _, title in columns] + ["fwd tokens vs step_wise"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {r["history"]: r["forward_tokens"] for r in rows if r["mode"] == "step_wise"}
    for r in rows:
        ratio = r["forward_tokens"] / base[r["history"]] if base.get(r["history"]) else float("nan")
        cells = [r["history"], r["mode"]] + [_fmt(r.get(key, "")) for key, _ in columns] + [f"{ratio:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_costs(rows: list[dict], path: Path) -> None:
    """Bar charts, one panel per cost, bars per (history, mode)."""
    keys = [k for k, _ in COST_COLUMNS[:6]] + ["peak_mem_mib"]
    titles = dict(COST_COLUMNS)
    labels = [f"{r['mode']}\n({r['history']})" for r in rows]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 4.2))
    colors = ["#4C72B0" if r["history"] == "exact" else "#DD8452" for r in rows]
    for ax, key in zip(axes, keys):
        ax.bar(range(len(rows)), [r.get(key, 0) or 0 for r in rows], color=colors)
        ax.set_title(titles[key], fontsize=10)
        ax.set_xticks(range(len(rows)), labels, rotation=60, fontsize=7, ha="right")
    fig.suptitle("Same rollouts, each way to train on them (blue: exact history, orange: retokenize)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(curves: dict[str, list[dict]], path: Path) -> None:
    """Reward, EM and cost per training step, one line per mode: whether a mode learns, and what it pays."""
    panels = [("reward/mean", "train reward"), ("environment/em", "exact match (search prompts)"),
              ("reward/pass_at_n", "pass@n"),
              ("generate/num_samples", "samples per step"), ("timing/train_s", "train time per step (s)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]  # modes often coincide: keep each visible
    for ax, (key, title) in zip(axes, panels):
        for k, (mode, steps) in enumerate(curves.items()):
            xs = [s["step"] for s in steps if key in s]
            marker, line = styles[k % len(styles)]
            ax.plot(xs, [s[key] for s in steps if key in s], marker=marker, linestyle=line, label=mode,
                    markersize=8 - 2 * (k % 3), alpha=0.85)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out_dir: Path, rows: list[dict], curves: dict[str, list[dict]], header: str,
                 curve_starts: dict[str, str] | None = None) -> Path:
    """report.md + costs.png (+ curves.png when training curves were run); `curve_starts` is each training
    run's starting weight checksum."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_costs(rows, out_dir / "costs.png")
    parts = [f"# Step-wise ablation\n\n{header}\n", "## Cost of the same rollouts per mode\n",
             markdown_table(rows)]
    repeats = max((len(r.get("train_step_s_runs", [])) for r in rows), default=0)
    if repeats:
        parts.append(f"\nTrain step: median of {repeats} updates from the same start; spread = max - min. A "
                     "difference between modes smaller than their spreads is timing noise.")
    flagged = flags(rows, curves)
    parts += [f"\n**Flagged** ({len(flagged)}):\n", *flagged] if flagged else \
        ["\nFlagged: none (no replayed batch or training step without a non-zero advantage)."]
    parts.append("\n![costs](costs.png)\n")
    if curves:
        plot_curves(curves, out_dir / "curves.png")
        starts = curve_starts or {}
        parts += ["## Training curves\n",
                  "| mode | start weights | step | reward | pass@n | KL loss | samples | train s |", "|---" * 8 + "|"]
        for mode, steps in curves.items():
            for s in steps:
                kl = f"{s['policy/kl_loss']:.2e}" if "policy/kl_loss" in s else ""
                parts.append(f"| {mode} | {starts.get(mode, '')} | {s['step']} | "
                             f"{s.get('reward/mean', float('nan')):.3f} | "
                             f"{s.get('reward/pass_at_n', float('nan')):.3f} | {kl} | "
                             f"{s.get('generate/num_samples', 0)} | {s.get('timing/train_s', float('nan')):.1f} |")
        parts.append("\n![curves](curves.png)\n")
    path = out_dir / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path
