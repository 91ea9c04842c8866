"""The run report: `report.md` (what ran, every step, where the files are) and `curves.png`, in the run directory.

Written at the end of every run, also one that failed or was interrupted after some steps, from what was logged
(metrics.jsonl, which also holds the steps of earlier launches of a resumed run; else the tracker's history), so
a researcher can look at reward, cost and time per step without opening wandb or parsing JSON.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from skyrl_stepwise.loop.tracking import load_history  # noqa: E402,F401  (read here, and by cli/train.py from here)

# (title, y label, kind, [(metric, legend label)]); eval series are drawn dashed. kind "fraction": the y axis
# shows 0..1 whenever the values lie in it (a flat 0.5 is not drawn as a wild swing); "count": integer y ticks
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Reward, EM and pass@n", "score", "fraction", [
        ("reward/mean", "train reward"), ("environment/em", "train EM"), ("reward/pass_at_n", "train pass@n"),
        ("eval/reward/mean", "eval reward (greedy)"),
        ("advantages/groups_with_signal_frac", "prompt groups with signal (a non-zero advantage)"),
        ("dynamic_sampling/generated_signal_frac", "generated groups with signal (dynamic sampling)")]),
    ("Tokens per step", "tokens", "count", [
        ("generate/real_tokens", "in samples (prompt + response)"), ("generate/padded_tokens", "as a padded batch"),
        ("train/packed_tokens", "packed for the update"),
        ("train/forward_tokens", "forwarded (tree: distinct prefixes)"),
        ("generate/response_tokens_trained", "trained (loss mask)")]),
    ("Sequence length", "tokens", "count", [
        ("generate/batch_padded_seq_len", "batch_padded_seq_len"), ("generate/tokens_per_sample_max", "longest sample"),
        ("generate/tokens_per_sample_mean", "mean sample")]),
    ("Time per phase", "seconds", "", []),  # every timing/*_s logged, see _timing_series
    ("Merge rate", "fraction of step samples merged", "fraction", [("generate/merge_rate", "merge rate")]),
    ("Bridge fallbacks and failures", "count per step", "count", [
        ("generate/bridge_fallbacks", "bridge fallbacks"), ("generate/retokenize_drift_steps", "retokenize drift steps"),
        ("generate/failed_trajectories", "failed trajectories")]),
    ("Context management", "count per step", "count", [
        ("context/edits", "context edits"), ("context/summaries", "summaries"),
        ("context/exhausted_trajectories", "context exhausted"),
        ("context/budget_exhausted_trajectories", "token budget exhausted")]),
]
TIMING_ORDER = ["generate", "ref_logprobs", "old_logprobs", "train", "weight_sync", "weight_sync_probe", "eval", "step"]
TIMING_LABELS = {"generate": "rollouts", "train": "update", "step": "whole step"}  # as the progress bars say
# per-step table: (metric, column title); columns no step has are left out
TABLE_COLUMNS = [("reward/mean", "reward"), ("reward/pass_at_n", "pass@n"),
                 ("reward/tamper_suspected", "tamper suspected"), ("environment/em", "EM"),
                 ("advantages/groups_with_signal", "groups w/ signal"), ("dynamic_sampling/draws", "draws"),
                 ("eval/reward/mean", "eval reward"), ("eval/reward/ci_low", "eval 95% low"),
                 ("eval/reward/ci_high", "eval 95% high"),
                 ("policy/loss", "loss"), ("policy/kl_loss", "KL"), ("train/grad_norm", "grad norm"),
                 ("train/skipped_step", "skipped updates"),
                 ("generate/num_samples", "samples"), ("generate/real_tokens", "tokens"),
                 ("generate/batch_padded_seq_len", "padded len"), ("generate/merge_rate", "merge rate"),
                 ("train/forward_tokens", "fwd tokens"), ("train/compression_ratio", "compression"),
                 ("generate/bridge_fallbacks", "fallbacks"), ("context/edits", "ctx edits"),
                 ("context/exhausted_trajectories", "ctx exhausted"), ("timing/generate_s", "generate s"),
                 ("timing/train_s", "update s"), ("timing/weight_sync_s", "sync s"), ("timing/step_s", "step s")]
SHOWN_WHEN_NONZERO = {"train/skipped_step", "reward/tamper_suspected"}  # columns left out unless some step has a non-zero value
STYLES = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", "-"), ("P", "--"), ("X", ":")]


def _numeric(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in history
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
             and math.isfinite(float(r[key]))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _timing_series(history: list[dict]) -> list[tuple[str, str]]:
    names = {k[len("timing/"):-2] for r in history for k in r if k.startswith("timing/") and k.endswith("_s")}
    ordered = [n for n in TIMING_ORDER if n in names] + sorted(names - set(TIMING_ORDER))
    return [(f"timing/{n}_s", TIMING_LABELS.get(n, n.replace("_", " "))) for n in ordered]


def plot_curves(history: list[dict], path: Path, title: str = "") -> Path:
    """Six panels over steps (reward/EM/pass@n, tokens, sequence length, time per phase, merge rate, bridge
    fallbacks): labelled axes, integer steps, a legend per panel; a panel with nothing logged says so."""
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for ax, (panel_title, ylabel, kind, series) in zip(axes.flat, PANELS):
        series = series or _timing_series(history)
        drawn, values = 0, []
        for k, (key, label) in enumerate(series):
            xs, ys = _numeric(history, key)
            if not xs:
                continue
            marker, line = STYLES[k % len(STYLES)]
            if key.startswith("eval/"):
                line = "--"
            if key == "timing/step_s":
                marker, line = "o", ":"
            ax.plot(xs, ys, marker=marker, linestyle=line, label=label, markersize=7 - (k % 3), alpha=0.85)
            drawn += 1
            values += ys
        ax.set_title(panel_title, fontsize=11)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if kind == "fraction" and values and 0 <= min(values) and max(values) <= 1:
            ax.set_ylim(-0.05, 1.05)
        if kind == "count" and values:
            top = max(max(values), 1.0)  # all zero: 0 and 1 on the axis, not -0.045 .. 0.045
            ax.set_ylim(min(min(values), 0.0) - 0.05 * top, top * 1.05)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_yticks([])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _column_format(values: list) -> str:
    """One number format per column, so a column reads evenly: counts as integers, the rest to a precision that
    fits the column's magnitude."""
    numbers = [abs(float(v)) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if all(float(v).is_integer() for v in numbers):
        return "{:.0f}"
    top = max(numbers, default=0.0)
    if top >= 100:
        return "{:.0f}"
    if top >= 10:
        return "{:.1f}"
    if 0 < top < 1e-3:
        return "{:.2e}"
    return "{:.3f}"


def _cell(value, fmt: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return "" if value is None else str(value)


def step_table(history: list[dict]) -> str:
    """One markdown row per step with the columns that were logged."""
    columns = [(k, t) for k, t in TABLE_COLUMNS
               if any(r.get(k) if k in SHOWN_WHEN_NONZERO else k in r for r in history)]
    head = ["step"] + [t for _, t in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    formats = {k: _column_format([r[k] for r in history if k in r]) for k, _ in columns}
    for r in history:
        cells = [str(r["step"])] + [_cell(r[k], formats[k]) if k in r else "" for k, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _hydra_job() -> tuple[dict, list[str]]:
    """Hydra's config-group choices and the command-line overrides, when this runs inside a Hydra job."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return {}, []
        hc = HydraConfig.get()
        choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v is not None}
        return choices, list(hc.overrides.task)
    except Exception:  # the report never fails over its header
        return {}, []


def fsdp_backend(fsdp) -> str:
    """The collective backend the policy ranks use (`auto` resolved the way the workers resolve it)."""
    if fsdp.backend != "auto":
        return fsdp.backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def describe_lora(cfg) -> str:
    """What trains and what the engines serve: full fine-tuning, or LoRA's rank, alpha, targets, adapter lr (RL's
    and the SFT warm start's), and the sync mode. The console prints it at start-up; report.md's Config lists it."""
    from skyrl_stepwise.loop.warm_start import sft_lora_config

    lora = cfg.trainer.lora
    if not lora.enabled:
        return f"full fine-tuning (trainer.lora.enabled=false), lr {cfg.trainer.optim.lr:g}"
    serves = ("the LoRA adapter alone, loaded by version (trainer.lora.sync=adapter; v0: no adapter yet)"
              if lora.sync == "adapter" else "the merged weights W + alpha/rank x B @ A (trainer.lora.sync=merged)")
    text = (f"LoRA rank {lora.rank}, alpha {lora.alpha:g}, targets {list(lora.target_modules)}, adapter "
            f"{lora.describe_lr(cfg.trainer.optim.lr)}; the engines serve {serves}")
    if cfg.sft.enabled:
        sft = sft_lora_config(cfg)
        text += ("; SFT warm start: an adapter at " + sft.describe_lr(cfg.sft.lr, "sft.lr", "sft.lora_lr")
                 if sft.enabled else "; SFT warm start: every weight (sft.lora=false)")
    return text


def config_summary(cfg) -> list[str]:
    """The settings that decide what a run's curves mean, as markdown bullets."""
    g, t, a = cfg.generator, cfg.trainer, cfg.trainer.algorithm
    choices, overrides = _hydra_job()
    mode = ("step-wise, merged" if g.merge_stepwise_output else "step-wise") if g.step_wise_trajectories \
        else "whole trajectories"
    kl = f"KL loss {a.kl_loss_type} x {a.kl_loss_coef}" if a.use_kl_loss else "no KL loss"
    lines = []
    if choices:
        lines.append("- recipe: " + ", ".join(f"`{k}={v}`" for k, v in sorted(choices.items())))
    if overrides:
        lines.append("- command-line overrides: " + " ".join(f"`{o}`" for o in overrides))
    lines += [
        f"- model: `{cfg.model_path}` ({t.model_path})",
        f"- {cfg.total_steps} steps, eval " + (f"every {cfg.eval_interval} steps and " if cfg.eval_interval else "")
        + f"at the end; "
        f"{cfg.data.train_batch_size} prompts x {g.n_samples_per_prompt} samples per step, "
        f"up to {g.max_turns} turns",
        f"- samples: {mode}, `{g.history}` history, renderer `{g.renderer}`, "
        f"T={g.sampling.temperature}, max {g.sampling.max_generate_length} tokens per turn",
        f"- trains: {describe_lora(cfg)}",
        f"- algorithm: {a.advantage_estimator}, {kl}, lr {t.lora.optimizer_lr(t.optim.lr) if t.lora.enabled else t.optim.lr:g}, mini-batch {t.policy_mini_batch_size} prompts, "
        f"TIS clip {a.tis_ratio_clip_high}",
        f"- engine: {cfg.engine.num_engines} x {cfg.engine.backend} ({cfg.engine.dtype}); policy: FSDP2 on "
        f"{t.fsdp.world_size} rank(s) ({fsdp_backend(t.fsdp)}), {t.attn_implementation}, "
        f"{t.micro_batch_tokens} tokens per micro-batch, packing `{t.packing}`",
        f"- seeds: trainer {t.seed}, data {cfg.data.seed}, engine {cfg.engine.seed}; wandb {cfg.logging.wandb_mode}",
    ]
    return lines


def failure_text(failure: BaseException, limit: int = 2000) -> str:
    """The error's whole first line (the guard's message is one long line: cut at 300 characters it stopped
    mid-sentence); a line past `limit` is cut after its last full sentence within it."""
    line = str(failure).splitlines()[0] if str(failure) else ""
    if len(line) <= limit:
        return line
    end = line.rfind(". ", 0, limit)
    return (line[:end + 1] if end > 0 else line[:limit]) + " [...]"


def _status(history: list[dict], total_steps: int, failure: BaseException | None,
            checkpoints: list[str] | None = None, ckpt_interval: int | None = None) -> str:
    done = max((r["step"] for r in history), default=0)
    if failure is None:
        return f"finished: {done} of {total_steps} steps."
    import asyncio

    if isinstance(failure, (KeyboardInterrupt, asyncio.CancelledError)):  # Ctrl-C or SIGTERM
        resume = (f"The same command resumes from the last complete checkpoint, {checkpoints[-1]} (see Files)."
                  if checkpoints else
                  f"No checkpoint was saved before that (trainer.ckpt_interval={ckpt_interval}), so the same command "
                  "starts again from step 1 (a finished SFT warm start is cached and reused).")
        return f"**interrupted at step {done}** of {total_steps}; the steps below were logged before that. {resume}"
    what = f"failed with `{type(failure).__name__}: {failure_text(failure)}`"
    updated = getattr(failure, "updated_step", None)  # set by the RL loop: this step's update ran, then it failed
    if updated is not None and updated > done:
        return (f"**{what}** in step {updated} of {total_steps}, after its update ran (the weights were trained; the "
                f"step's metrics were not logged); the steps below were logged before that.")
    if done == 0:
        return f"**{what}** before step 1 of {total_steps}; nothing was trained (details in run.log)."
    return f"**{what}** after step {done} of {total_steps}; the steps below were logged before that."


def skipped_section(history: list[dict]) -> list[str]:
    """A line naming the steps that skipped optimizer updates (lost their gradient), or nothing when none did."""
    from skyrl_stepwise.loop.tracking import skipped_updates

    skipped = [(r["step"], skipped_updates(r)) for r in history if skipped_updates(r)]
    if not skipped:
        return []
    steps = "; ".join(f"step {step}: {what}" for step, what in skipped)
    return [f"**{len(skipped)} of {len(history)} steps skipped optimizer updates** ({steps}): a non-finite gradient "
            "norm or nothing to train on, so their batches' gradients were lost (`train/skipped_step`).", ""]


SFT_COLUMNS = [("sft/loss", "loss"), ("train/grad_norm", "grad norm"), ("sft/entropy", "entropy"),
               ("train/lr", "lr"), ("train/step_time_s", "s")]


def sft_section(run_dir: Path) -> list[str]:
    """The warm start's steps (sft_metrics.jsonl, written as they happen): a warm start that diverged or was
    stopped shows where, not only on the console."""
    steps = load_history(run_dir / "sft_metrics.jsonl")
    if not steps:
        return []
    head = ["SFT step"] + [t for k, t in SFT_COLUMNS if any(k in r for r in steps)]
    keys = [k for k, _ in SFT_COLUMNS if any(k in r for r in steps)]
    formats = {k: "{:.3g}" for k in keys}
    lines = ["## SFT warm start", "", f"{len(steps)} SFT steps logged (`sft_metrics.jsonl`).", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    lines += ["| " + " | ".join([str(r["step"])] + [_cell(r.get(k), formats[k]) for k in keys]) + " |"
              for r in steps]
    return lines + [""]


def failures_section(run_dir: Path, history: list[dict]) -> list[str]:
    """How many trajectories failed (env or engine errors: not trained) and why, or nothing when none did: a
    step line reading `samples=4` otherwise looks like a clean run on 4 samples."""
    steps = [r for r in history if r.get("generate/failed_trajectories")]
    if not steps:
        return []
    total = sum(r["generate/failed_trajectories"] for r in steps)
    causes: dict[str, float] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("generate/failed_trajectories/") and v:
                causes[k.rsplit("/", 1)[1]] = causes.get(k.rsplit("/", 1)[1], 0.0) + v
    by_cause = ", ".join(f"{cause} {n:.0f}" for cause, n in sorted(causes.items(), key=lambda kv: -kv[1]))
    where = ", ".join(f"step {r['step']}: {r['generate/failed_trajectories']:.0f}" for r in steps)
    return [f"**{total:.0f} trajectories failed** on {len(steps)} of {len(history)} steps ({by_cause}; {where}): "
            "an env or engine error ended them, so they were not trained and their steps trained on fewer samples "
            f"than were drawn (`generate/failed_trajectories`). `skyrl-stepwise show {run_dir} --failed` prints what "
            "each did up to its failure, and why.", ""]


def _never_fired_why(ctx, max_input_length: int) -> str:
    """What the policy waits for, with this run's values: why a policy that never fired did nothing."""
    if ctx.policy == "truncate":
        return f"no observation was longer than `max_observation_tokens`={ctx.max_observation_tokens}"
    if ctx.policy == "sliding_window":
        return f"no trajectory had observations older than the last `window`={ctx.window} turns"
    if ctx.policy == "summarize":
        return (f"no next prompt crossed the summarize threshold of {ctx.threshold(max_input_length)} tokens "
                f"(`summarize_threshold`, max_input_length {max_input_length})")
    return "the plugin returned no edit on every turn"


def context_section(cfg, history: list[dict]) -> list[str]:
    """Whether the context policy did anything on this run, in words: a policy that never fired leaves the run
    identical to policy=none, which a 0 in `context/fires_per_trajectory` alone does not make anyone notice; and
    with `none`, how many trajectories ran out of context that a policy could have kept going."""
    ctx = getattr(cfg.generator, "context", None)
    steps = [r for r in history if "context/fires_per_trajectory" in r]
    if ctx is None or not steps:
        return []
    exhausted = sum(r.get("context/exhausted_trajectories", 0) for r in steps)
    budget = sum(r.get("context/budget_exhausted_trajectories", 0) for r in steps)
    limits = (f"{exhausted:.0f} trajectories ran out of context (`context_exhausted`)"
              + (f", {budget:.0f} hit the token budget (`budget_exhausted`)" if budget else ""))
    if ctx.policy == "none":
        if not exhausted and not budget:
            return []
        return ["## Context", "", f"{limits} over {len(steps)} steps with `generator.context.policy=none`; "
                "a context policy (truncate, sliding_window, summarize) keeps such trajectories going (README "
                '"Long-horizon agents: context policies").', ""]
    fired = [r["step"] for r in steps if r["context/fires_per_trajectory"] > 0]
    if not fired:
        why = _never_fired_why(ctx, cfg.generator.max_input_length)
        return ["## Context", "", f"**The context policy `{ctx.policy}` never fired on this run** "
                f"(`context/fires_per_trajectory` = 0 on all {len(steps)} steps): {why}, so nothing was truncated, "
                f"dropped or summarised and these steps trained exactly as with `generator.context.policy=none`; "
                f"{limits}.", ""]
    edits = sum(r.get("context/edits", 0) for r in steps)
    summaries = sum(r.get("context/summaries", 0) for r in steps)
    dropped = sum(r.get("context/tokens_dropped", 0) for r in steps)
    return ["## Context", "", f"The context policy `{ctx.policy}` fired on {len(fired)} of {len(steps)} steps: "
            f"{edits:.0f} edits (each starts a new step chain), {summaries:.0f} summaries, {dropped:.0f} tokens "
            f"dropped; {limits}.", ""]


def _files(cfg, run_dir: Path) -> list[str]:
    """Where everything is, relative to the run dir where possible, only what exists."""
    from skyrl_stepwise.checkpoint.store import complete_checkpoints

    def rel(p: Path) -> str:
        try:
            return str(p.resolve().relative_to(run_dir.resolve()))
        except ValueError:
            return str(p.resolve())

    lines = [f"Run directory: `{run_dir.resolve()}`", ""]
    entries = [(run_dir / "metrics.jsonl", "every step's metrics, one JSON object per line"),
               (run_dir / "sft_metrics.jsonl", "every SFT warm-start step's metrics, written as they happened"),
               (run_dir / "curves.png", "the plots above"),
               (run_dir / "rollouts.jsonl", "decoded trajectories of every step and eval (`skyrl-stepwise show`)"),
               (run_dir / "view_tokens.jsonl", "a few trajectories per step and eval, per token (the viewer's data)"),
               (run_dir / "view" / "index.html", "the trajectory viewer page (`skyrl-stepwise view`)"),
               (run_dir / "run.log", "vLLM, Ray, transformers and retrieval-server output, our own log lines"),
               (run_dir / ".hydra" / "config.yaml", "the composed config (`overrides.yaml`: the command line)")]
    for path, what in entries:
        if path.exists():
            lines.append(f"- `{rel(path)}`: {what}")
    ckpt_dir = Path(cfg.trainer.ckpt_dir)
    ckpts = complete_checkpoints(ckpt_dir) if ckpt_dir.is_dir() else []
    if ckpts:
        lines.append(f"- `{rel(ckpt_dir)}/`: complete checkpoints {', '.join(c.name for c in ckpts)} "
                     "(`trainer.resume=auto` with this run dir continues from the last)")
        adapter = " (`--adapter-only`: the LoRA adapter in peft format)" if cfg.trainer.lora.enabled else ""
        lines.append(f"- export the last as a Hugging Face folder: `skyrl-stepwise model export {ckpt_dir.resolve()} "
                     f"--out <dir>`{adapter}")
    wandb_dir = run_dir / "wandb"
    if wandb_dir.is_dir():
        runs = sorted(p for p in wandb_dir.glob("*run-*") if p.is_dir())
        hint = f"; upload with `wandb sync {runs[-1].resolve()}`" if runs and "offline" in runs[-1].name else ""
        lines.append(f"- `{rel(wandb_dir)}/`: wandb files ({cfg.logging.wandb_mode}){hint}")
    return lines


def learning_summary(history: list[dict]) -> str | None:
    """How many RL steps could learn at all: a step whose prompt groups all scored alike has no gradient."""
    counts = [r["advantages/groups_with_signal"] for r in history if "advantages/groups_with_signal" in r]
    if not counts:
        return None
    fracs = [r.get("advantages/groups_with_signal_frac", 0.0) for r in history if "advantages/groups_with_signal" in r]
    summary = (f"{sum(c > 0 for c in counts)} of {len(counts)} RL steps had non-zero advantages; "
               f"{sum(f >= 0.5 for f in fracs)} had reward variance in at least half of their prompt groups.")
    draws = [r for r in history if "dynamic_sampling/draws" in r]
    if draws:  # the trained groups were filtered: say what it took to find them
        generated = sum(r["dynamic_sampling/generated_groups"] for r in draws)
        signal = sum(r["dynamic_sampling/generated_signal_frac"] * r["dynamic_sampling/generated_groups"]
                     for r in draws)
        summary += (f" Dynamic sampling kept only groups with variance: {sum(r['dynamic_sampling/draws'] for r in draws):.0f}"
                    f" prompt batches drawn for {len(draws)} steps, {signal:.0f} of {generated:.0f} generated groups "
                    f"({signal / max(generated, 1):.0%}) had variance.")
        unused = sum(r.get("dynamic_sampling/draws_not_needed", 0.0) for r in draws)
        if unused:  # trainer.algorithm.draws_at_once: generated with the draws used, never trained
            summary += f" Draws generated with those and not needed (draws_at_once), never trained: {unused:.0f}."
    return summary


def sft_zero_section(cfg, run_dir: Path) -> list[str]:
    """The console's warning when SFT left the eval at or near 0 (loop/warm_start.py sft_left_no_signal), in bold."""
    from skyrl_stepwise.loop.evaluation import load_evals
    from skyrl_stepwise.loop.warm_start import sft_history, sft_left_no_signal

    zero = sft_left_no_signal(cfg, load_evals(run_dir), sft_history(cfg.trainer.model_path))
    return [f"**{zero}**", ""] if zero else []


def evaluation_section(run_dir: Path, history: list[dict]) -> list[str]:
    """The staged evals (before SFT, after SFT, after RL) with intervals, and how many steps had signal."""
    from skyrl_stepwise.loop.evaluation import eval_table, load_evals, rl_minus_sft, score_label

    evals, learning = load_evals(run_dir), learning_summary(history)
    if not evals and learning is None:
        return []
    lines = ["## Evaluation", ""]
    if evals:
        lines += ["Greedy, the same validation prompts at every stage; 95% percentile-bootstrap intervals over "
                  "prompts.", "", eval_table(evals, score_label(history)), ""]
        paired = rl_minus_sft(evals, score_label(history))
        if paired:
            lines += [f"**{paired}**", ""]
    if learning:
        lines += [learning, ""]
    return lines


def rollouts_section(run_dir: Path, max_chars: int = 1200) -> list[str]:
    """The decoded samples of the last training step and the last eval (rollouts.jsonl), each as a text block:
    what the model wrote, the tool calls it made and what came back, next to the reward they got."""
    from skyrl_stepwise.loop.rollout_samples import format_sample, load_rollouts

    samples = load_rollouts(run_dir)
    if not samples:
        return []
    lines = ["## Rollout samples", "",
             f"A few decoded trajectories (best and worst of a group first); every step's are in `rollouts.jsonl` "
             f"(`skyrl-stepwise show {run_dir}` prints them, `--step N` one step).", ""]
    train = [s for s in samples if s["stage"] == "train"]
    evals = [s for s in samples if s["stage"] != "train"]
    for title, chosen in (("last training step", train), ("last eval", evals)):
        if not chosen:
            continue
        last = max(s["step"] for s in chosen)
        stage = [s for s in chosen if s["step"] == last][-1]["stage"]
        picked = [s for s in chosen if s["step"] == last and s["stage"] == stage]
        lines += [f"### {title} ({stage}, step {last})", "", "````text",
                  *[format_sample(s, max_chars) for s in picked], "````", ""]
    return lines


def viewer_page(run_dir: Path) -> Path | None:
    """Write the trajectory viewer page (view/page.py) next to the report; None when it could not be (logged: the
    report, and the run's own error, come first)."""
    from skyrl_stepwise.view.page import write_page

    try:
        return write_page(run_dir)
    except Exception:
        logging.getLogger(__name__).exception("the trajectory viewer page could not be written")
        return None


def viewer_section(page: Path | None) -> list[str]:
    """The link to the viewer page, first thing after the evaluation: where to see what each step trained on."""
    if page is None:
        return []
    return ["## Trajectory viewer", "", f"[view/index.html](view/index.html) ({page.stat().st_size / 1e6:.1f} MB, "
            "opens from disk): every step on a timeline, and per step its recorded trajectories token by token, "
            "coloured by what the loss did with each token, with both logprobs and the advantage on hover.", ""]


def write_run_report(cfg, run_dir: str | Path, history: list[dict] | None = None,
                     failure: BaseException | None = None) -> Path:
    """report.md + curves.png in `run_dir` from metrics.jsonl (else `history`); returns report.md's path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = load_history(run_dir / "metrics.jsonl", history)
    title = f"{cfg.logging.run_name}: {Path(str(cfg.model_path)).name}, {len(steps)} of {cfg.total_steps} steps"
    plot_curves(steps, run_dir / "curves.png", title)
    page = viewer_page(run_dir)
    from skyrl_stepwise.checkpoint.store import complete_checkpoints

    ckpt_dir = Path(cfg.trainer.ckpt_dir)
    ckpts = [c.name for c in complete_checkpoints(ckpt_dir)] if ckpt_dir.is_dir() else []
    parts = [f"# Run report: {cfg.logging.run_name}", "",
             _status(steps, cfg.total_steps, failure, ckpts, cfg.trainer.ckpt_interval), "",
             *sft_section(run_dir),
             *skipped_section(steps),
             *failures_section(run_dir, steps),
             *context_section(cfg, steps),
             *sft_zero_section(cfg, run_dir),
             *evaluation_section(run_dir, steps),
             *viewer_section(page),
             "## Config", "", *config_summary(cfg), "", "## Curves", "", "![curves](curves.png)", "",
             "## Steps", "", step_table(steps) if steps else "No step was logged.", "",
             *rollouts_section(run_dir),
             "## Files", "", *_files(cfg, run_dir), ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(parts))
    return path
