"""Greedy eval on a fixed validation subset, reported as a mean with a 95% bootstrap interval.

A tiny eval set (tens of prompts) makes "EM went from 0.05 to 0.20" meaningless without its uncertainty, so
every eval keeps the per-prompt scores and resamples them (percentile bootstrap over prompts). The main job
evaluates the same prompts at each stage (before SFT, after SFT, after RL) and saves the stages to
`evals.json` in the run dir, where the run report reads them.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

EVALS_FILE = "evals.json"


@dataclass
class EvalResult:
    """One eval: per-prompt scores (trajectory reward; EM for Search-R1) and their bootstrap interval."""

    stage: str  # e.g. "before SFT", "after SFT", "after RL (step 3)"
    scores: list[float]
    mean: float
    ci_low: float
    ci_high: float
    seconds: float = 0.0
    by_source: dict[str, float] = field(default_factory=dict)  # mean score per data_source
    # prompts scored 0 because they produced no score (failed trajectory, first prompt over max_input_length):
    # every stage covers the same prompts, and this says how many of them could not be answered at all
    unscored: int = 0
    # each prompt's data_source, parallel to scores: a paired comparison of two stages can then be split by source
    sources: list[str] = field(default_factory=list)
    # agent programs (gateway.enabled): calls to the model per scored trajectory and the share with two or more, so a
    # warm start that teaches tool calls shows before and after (None: our own agent loop, not measured here)
    calls_per_trajectory: float | None = None
    multi_call_share: float | None = None
    # agent programs: trajectories those two average (0: none finished, so calls were not measured, not 0 calls)
    calls_counted: int | None = None
    tool_calls_per_trajectory: float | None = None  # replies that carried a tool call, per scored trajectory
    # the env's own per-trajectory metrics (`environment/*`, means over trajectories), e.g. the python-tool task's
    # tool calls and share of answers read from a run's output, so a stage's behaviour compares with the next one's
    env_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return len(self.scores)

    def describe(self) -> str:
        """One line for the console: `EM 0.250 [0.141, 0.375] on 32 prompts`."""
        line = f"{self.mean:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}] on {self.num_prompts} prompts"
        if self.unscored:
            line += f" ({self.unscored} unscored, counted as 0: failed or over generator.max_input_length)"
        if len(self.by_source) > 1:
            line += " (" + ", ".join(f"{k} {v:.3f}" for k, v in self.by_source.items()) + ")"
        if self.calls_per_trajectory is not None:
            line += (f"; {self.calls_per_trajectory:.2f} calls per trajectory, "
                     f"{100 * (self.multi_call_share or 0.0):.0f}% with >= 2")
            if self.tool_calls_per_trajectory is not None:
                line += f", {self.tool_calls_per_trajectory:.2f} with a tool call"
        elif self.calls_counted == 0:
            line += "; calls per trajectory not measured: no trajectory finished"
        if "environment/answer_from_output" in self.env_metrics:  # an env that says whether answers came from a run
            line += (f"; {self.env_metrics.get('environment/tool_calls', 0.0):.2f} tool calls per trajectory, "
                     f"{100 * self.env_metrics['environment/answer_from_output']:.0f}% of answers from a run's output")
        return line


def bootstrap_interval(scores: list[float], level: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap of the mean over prompts; seeded, so the same scores give the same interval."""
    if not scores:
        return 0.0, 0.0
    rng = random.Random(seed)
    n = len(scores)
    means = sorted(sum(rng.choices(scores, k=n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    return means[int(tail * resamples)], means[min(resamples - 1, int((1.0 - tail) * resamples))]


def eval_result(stage: str, scores: list[float], seconds: float = 0.0, sources: list[str] | None = None) -> EvalResult:
    """Mean and 95% interval of per-prompt scores (and the mean per data source, when given)."""
    low, high = bootstrap_interval(scores)
    by_source: dict[str, list[float]] = {}
    for score, source in zip(scores, sources or []):
        by_source.setdefault(source, []).append(score)
    return EvalResult(stage, list(scores), sum(scores) / max(len(scores), 1), low, high, seconds,
                      {k: sum(v) / len(v) for k, v in sorted(by_source.items())}, sources=list(sources or []))


def paired_bootstrap(after: list[float], before: list[float], level: float = 0.95, resamples: int = 4000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of after - before over the same prompts and its percentile interval, resampling prompts (pairs).

    Two stages scored on the same prompts differ far less in their difference than their separate intervals
    suggest (a prompt that is easy stays easy); resampling pairs is what resolves a gain of a few points.
    """
    if len(after) != len(before) or not after:
        raise ValueError(f"a paired comparison needs the same prompts in both evals, got {len(after)} and "
                         f"{len(before)} scores (a trajectory whose infrastructure failed is left out of an eval)")
    diffs = [a - b for a, b in zip(after, before)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    return sum(diffs) / n, means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]


def transitions(after: list[float], before: list[float]) -> tuple[int, int]:
    """Prompts the later stage fixed (scored 0 before, > 0 after) and prompts it broke (the reverse): a small net
    gain can hide a large churn, which says the policy moved but not in one direction."""
    fixed = sum(b <= 0 < a for a, b in zip(after, before))
    broken = sum(a <= 0 < b for a, b in zip(after, before))
    return fixed, broken


def score_label(records: list[dict]) -> str:
    """What an eval score is called: "EM" where the env scores exact match (Search-R1 reports `environment/em`, and
    its reward is that EM), else "reward" (a repo fix's hidden tests, HumanEval's, an agent program's own)."""
    return "EM" if any("environment/em" in r for r in records) else "reward"


def rl_minus_sft(results: list[EvalResult], metric: str = "EM") -> str | None:
    """The main job's answer to "did RL beat the warm start?": the last RL stage minus the SFT stage, paired over the
    same prompts, with its interval and the fixed / broken counts; None without both stages."""
    sft = next((r for r in results if r.stage == "after SFT"), None)
    rl = next((r for r in reversed(results) if r.stage.startswith("after RL")), None)
    if sft is None or rl is None or len(sft.scores) != len(rl.scores) or not sft.scores:
        return None
    diff, low, high = paired_bootstrap(rl.scores, sft.scores)
    fixed, broken = transitions(rl.scores, sft.scores)
    verdict = "RL beat SFT" if low > 0 else "RL fell below SFT" if high < 0 else "no difference resolved"
    return (f"{metric} {rl.stage} - after SFT (paired, {len(rl.scores)} prompts): {diff:+.3f} [{low:+.3f}, "
            f"{high:+.3f}] 95% bootstrap; {fixed} prompts fixed, {broken} broken: {verdict}")


def eval_subset(rows: list, size: int, seed: int = 0) -> list:
    """The fixed validation subset every stage evaluates: a seeded sample of `size` rows in their file order.

    Validation files are often grouped by source (the embedded one: 72 FanOutQA questions, then 200 held-out
    description questions), so the first `size` rows would test one source only.
    """
    if size >= len(rows):
        return list(rows)
    keep = sorted(random.Random(seed).sample(range(len(rows)), size))
    return [rows[i] for i in keep]


def save_evals(run_dir: str | Path, results: list[EvalResult]) -> Path:
    """All stages so far, rewritten after each eval: a crash later still leaves the earlier ones."""
    path = Path(run_dir) / EVALS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return path


def load_evals(run_dir: str | Path) -> list[EvalResult]:
    """The stages saved by `save_evals`, or [] when the run did none."""
    path = Path(run_dir) / EVALS_FILE
    if not path.is_file():
        return []
    return [EvalResult(**r) for r in json.loads(path.read_text())]


def eval_table(results: list[EvalResult], metric: str = "EM") -> str:
    """A markdown table of the stages, each with its interval."""
    rows = [f"| stage | {metric} | 95% interval | prompts (unscored = 0) |", "|---|---:|---|---:|"]
    sources = sorted({k for r in results for k in r.by_source})
    if len(sources) > 1:  # one column per source when the subset mixes them
        rows[0] += "".join(f" {s} |" for s in sources)
        rows[1] += "---:|" * len(sources)
    # agent programs: calls per trajectory
    calls = any(r.calls_per_trajectory is not None or r.calls_counted is not None for r in results)
    if calls:
        rows[0] += " calls per trajectory | >= 2 calls | tool calls per trajectory |"
        rows[1] += "---:|---:|---:|"
    for r in results:
        cells = "".join(f" {r.by_source[s]:.3f} |" if s in r.by_source else " - |" for s in sources) \
            if len(sources) > 1 else ""
        if calls:
            cells += " none finished | - |" if r.calls_counted == 0 else " - | - |" if r.calls_per_trajectory is None \
                else f" {r.calls_per_trajectory:.2f} | {100 * (r.multi_call_share or 0.0):.0f}% |"
            cells += " - |" if r.tool_calls_per_trajectory is None else f" {r.tool_calls_per_trajectory:.2f} |"
        prompts = f"{r.num_prompts} ({r.unscored} unscored)" if r.unscored else f"{r.num_prompts}"
        rows.append(f"| {r.stage} | {r.mean:.3f} | [{r.ci_low:.3f}, {r.ci_high:.3f}] | {prompts} |{cells}")
    return "\n".join(rows)
