"""The trajectory viewer: one static, self-contained page per run, <run dir>/view/index.html.

"What did it train on?" is a token-level question. The page answers it from what the run recorded, nothing else:
metrics.jsonl (the steps timeline), evals.json (the stages), rollouts.jsonl (decoded trajectories, tool calls,
stop reasons, failures) and view_tokens.jsonl (a few trajectories per step per token: ids, loss mask, engine and
trainer logprob, advantage, where a merge put observations). Each token's role comes from the recorded loss mask
and merge spans (`token_roles`), never from re-tokenising text, so the colours are what the loss did.

The page is one HTML file: the data as JSON, the hand-written CSS and JS of assets/ inlined, no network access.
Trajectory bodies are drawn only when opened, so a page of 1,000 trajectories opens fast (benchmarks/view_page.py).
"""

from __future__ import annotations

import heapq
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from skyrl_stepwise.generator.agent_loop import LIMIT_STOPS
from skyrl_stepwise.loop.evaluation import load_evals
from skyrl_stepwise.loop.rollout_samples import call_verdict, load_rollouts, load_token_records
from skyrl_stepwise.loop.tracking import load_history

PAGE_DIR, PAGE = "view", "index.html"
ASSETS = Path(__file__).parent / "assets"
# one letter per token; the page's legend and colours use the same letters
ROLES = {"p": "prompt (not trained)", "h": "history: shared with the previous sample (not trained)",
         "o": "observation or tool output (not trained)", "e": "rewritten context: a context edit or re-render",
         "t": "sampled and trained", "m": "sampled or appended, but masked (not trained)"}
TIMELINE = {"reward/mean": "reward", "reward/pass_at_n": "pass@n", "advantages/groups_with_signal": "signal groups",
            "eval/reward/mean": "eval reward"}
WORST_TOKENS = 20  # the engine-vs-trainer disagreements listed per step
DIGITS = 5  # logprobs and advantages are rounded to this many decimals (float32 engine-vs-trainer diffs are ~1e-5)


@dataclass
class ViewSample:
    """One training sample of a trajectory for the page: roles per token, one letter each (see ROLES)."""

    prefix: int  # leading tokens shared with the previous sample's prompt + response (not repeated here)
    prompt_ids: list[int]
    prompt_roles: str
    response_ids: list[int]
    response_roles: str
    engine_logprobs: list[float] | None
    trainer_logprobs: list[float] | None
    advantages: list[float] | None
    boundaries: list[int] = field(default_factory=list)  # response positions where a merged-in step begins
    # a merged sample's steps as generated: the [start, end) of each step's sampled tokens in the response
    # (step_ranges); step k's prompt is this sample's prompt + response[:start]. Empty: not merged.
    steps: list[list[int]] = field(default_factory=list)


@dataclass
class ViewTrajectory:
    """One trajectory row of the page."""

    key: str
    stage: str
    step: int
    group: str  # the prompt group (instance id)
    pick: str | None
    reward: float | None
    stop_reason: str | None
    failure: str | None
    turns: int
    flags: str  # F failed, T truncated, E context-edited, X tampering suspected (as recorded)
    advantage: float | None  # mean advantage over its trained tokens (None: not recorded)
    segments: list[dict[str, Any]]
    context_events: list[dict[str, Any]]
    samples: list[ViewSample] | None  # None: only its decoded text was recorded


def _round(values: list[float] | None) -> list[float] | None:
    if values is None:
        return None
    return [round(v, DIGITS) if math.isfinite(v) else None for v in values]


def token_roles(samples: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(prompt roles, response roles) of each recorded sample, one letter per token, from the recorded masks only.

    Prompt: the first sample's is the prompt; a later sample's new tokens are observations when it extends the
    previous sample's full sequence, else a rewritten context. Response: loss mask 1 is trained; a merge's
    observation span is an observation; any other mask-0 token was sampled (or appended) and masked."""
    out, context = [], 0
    for k, s in enumerate(samples):
        prompt_role = "p" if k == 0 else ("o" if s["prefix"] == context else "e")
        spans = s.get("observation_spans") or []
        observed = {i for a, b in spans for i in range(a, b)}
        response = "".join("t" if m else ("o" if i in observed else "m") for i, m in enumerate(s["loss_mask"]))
        out.append((prompt_role * len(s["prompt_ids"]), response))
        context = s["prefix"] + len(s["prompt_ids"]) + len(s["response_ids"])
    return out


def step_ranges(spans: list[list[int]] | None, length: int) -> list[list[int]]:
    """The step-wise samples a merged sample was made of, from the merge's recorded observation spans: [start, end)
    of each step's response. The merge joins a step only when the sequence so far is literally its prompt's prefix
    and records a span for every joined step (generator/merge.py), so step k's prompt is the merged prompt +
    response[:start] and its ids, mask and logprobs are the merged lists' slices: nothing re-tokenised. []: not
    merged (no spans)."""
    if not spans:
        return []
    starts = [0] + [b for _, b in spans]
    ends = [a for a, _ in spans] + [length]
    return [[a, b] for a, b in zip(starts, ends)]


def view_samples(record: dict[str, Any]) -> list[ViewSample]:
    """A view_tokens.jsonl record's samples with their token roles."""
    out = []
    for s, (prompt_roles, response_roles) in zip(record["samples"], token_roles(record["samples"])):
        spans = s.get("observation_spans") or []
        out.append(ViewSample(s["prefix"], s["prompt_ids"], prompt_roles, s["response_ids"], response_roles,
                              _round(s.get("engine_logprobs")), _round(s.get("trainer_logprobs")),
                              _round(s.get("advantages")), [b for _, b in spans],
                              step_ranges(spans, len(s["response_ids"]))))
    return out


def mean_advantage(samples: list[ViewSample] | None) -> float | None:
    """The mean advantage over a trajectory's trained tokens (what a sort by advantage orders by)."""
    values = [a for s in samples or [] if s.advantages for a, r in zip(s.advantages, s.response_roles) if r == "t"]
    return round(sum(values) / len(values), DIGITS) if values else None


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _flags(sample: dict[str, Any], edited: bool) -> str:
    stop = sample.get("stop_reason") or ""
    return "".join(flag for flag, on in (
        ("F", sample.get("pick") == "failed" or bool(sample.get("failure"))),
        ("T", stop == "length" or stop in LIMIT_STOPS),
        ("E", edited),
        ("X", bool(sample.get("tamper_suspected")))) if on)


def trajectories(run_dir: Path) -> list[ViewTrajectory]:
    """Every recorded trajectory, its decoded text (rollouts.jsonl) joined with its tokens (view_tokens.jsonl)."""
    tokens = {(r["step"], r["stage"], r["trajectory"]): r for r in load_token_records(run_dir)}
    texts = {(s["step"], s["stage"], s["trajectory"]): s for s in load_rollouts(run_dir)}
    out = []
    for key in list(texts) + [k for k in tokens if k not in texts]:
        text = texts.get(key, {})
        samples = view_samples(tokens[key]) if key in tokens else None
        events = text.get("context_events") or []
        edited = bool(events) or any("e" in s.prompt_roles for s in samples or [])
        out.append(ViewTrajectory(key[2], key[1], key[0], key[2].rsplit("_", 1)[0], text.get("pick"),
                                  _finite(text.get("reward")), text.get("stop_reason"), text.get("failure"),
                                  text.get("turns", 0), _flags(text, edited), mean_advantage(samples),
                                  answered(text.get("segments") or []), events, samples))
    return out


def answered(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decoded segments, each tool call with the parser's verdict (as recorded; a run from before verdicts
    were recorded gets it from the parse error, with no tool list) and each calling turn with the answer: the env
    segment that follows it (the tool output the model read next)."""
    out = []
    for k, seg in enumerate(segments):
        calls = [dict(c, verdict=c.get("verdict") or call_verdict(c.get("error"), c.get("name"), None))
                 for c in seg.get("tool_calls") or []]
        after = segments[k + 1] if k + 1 < len(segments) else None
        answer = after["text"] if calls and after is not None and after["role"] == "env" else None
        out.append(dict(seg, tool_calls=calls, answer=answer))
    return out


def token_texts(run_dir: Path) -> dict[str, str]:
    """Token id -> its decoded text, for every id the per-token records use."""
    out: dict[str, str] = {}
    for record in load_token_records(run_dir):
        out.update(record.get("texts") or {})
    return out


def worst_agreement(trajs: list[ViewTrajectory], n: int = WORST_TOKENS) -> dict[str, list[list]]:
    """Per "step|stage", the n sampled tokens whose engine and trainer logprobs differ most:
    [trajectory index, sample index, response position, |difference|]."""
    found: dict[str, list[tuple]] = {}
    for t, traj in enumerate(trajs):
        for k, s in enumerate(traj.samples or []):
            if s.engine_logprobs is None or s.trainer_logprobs is None:
                continue
            diffs = ((abs(e - tr), i) for i, (e, tr, role) in enumerate(zip(s.engine_logprobs, s.trainer_logprobs,
                                                                            s.response_roles))
                     if role in "tm" and e is not None and tr is not None and e != 0.0)  # 0.0: appended, not sampled
            top = found.setdefault(f"{traj.step}|{traj.stage}", [])
            top.extend((d, t, k, i) for d, i in heapq.nlargest(n, diffs))
    return {key: [[t, k, i, round(d, DIGITS)] for d, t, k, i in heapq.nlargest(n, v)] for key, v in found.items()}


AGREEMENT = ("agreement/logprob_abs_diff_mean", "agreement/logprob_abs_diff_max")  # the loss's, over every token


def steps_timeline(history: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step: the timeline's series, the phase times (timing/*_s) and the loss's engine-vs-trainer agreement over
    all the step's trained tokens (beside the worst tokens listed from the recorded trajectories), numbers only."""
    keep = lambda k: k in TIMELINE or k in AGREEMENT or k == "step" or (  # noqa: E731
        k.startswith("timing/") and k.endswith("_s"))
    return [{k: v for k, v in r.items() if keep(k) and isinstance(v, (int, float)) and math.isfinite(v)}
            for r in history]


def rollout_stage(eval_stage: str) -> str:
    """The rollouts.jsonl stage of an evals.json stage: "before SFT" -> "eval before SFT"; the last eval is
    recorded as "eval step N" and relabelled "after RL (step N)" in evals.json (cli/train.py)."""
    match = re.fullmatch(r"after RL \(step (\d+)\)", eval_stage)
    return f"eval step {match.group(1)}" if match else f"eval {eval_stage}"


def eval_prompt_index(trajectory: str) -> int | None:
    """The eval prompt (row) a recorded eval trajectory answered: its instance id ends with the row
    (loop/loop.py evaluate_prompts: "eval/<stage>/<id>/<row>", then "_<repetition>")."""
    match = re.search(r"/(\d+)_\d+$", trajectory)
    return int(match.group(1)) if match else None


def paired_changes(evals: list[dict[str, Any]], trajs: list[ViewTrajectory] = ()) -> list[dict[str, Any]]:
    """Between consecutive eval stages (the same prompts, in order): the prompts that went from a score of 0 to
    above 0 (fixed) and back (broken), each with its data source and the recorded eval trajectory (page index)
    that answered it at either stage, where one was recorded (logging.num_rollout_samples picks)."""
    where = {(t.stage, eval_prompt_index(t.key)): i for i, t in enumerate(trajs) if t.stage.startswith("eval ")}
    out = []
    for before, after in zip(evals, evals[1:]):
        if len(before["scores"]) != len(after["scores"]):
            continue
        pairs = list(enumerate(zip(before["scores"], after["scores"])))
        sources = before.get("sources") or []

        def listed(indices: list[int]) -> list[dict[str, Any]]:
            return [{"prompt": i, "source": sources[i] if i < len(sources) else None,
                     "before": where.get((rollout_stage(before["stage"]), i)),
                     "after": where.get((rollout_stage(after["stage"]), i))} for i in indices]

        out.append({"from": before["stage"], "to": after["stage"],
                    "fixed": listed([i for i, (a, b) in pairs if a <= 0 < b]),
                    "broken": listed([i for i, (a, b) in pairs if b <= 0 < a])})
    return out


def page_data(run_dir: str | Path, live: bool = False) -> dict[str, Any]:
    """Everything the page shows, as one JSON-ready dict; `live`: the page polls for a newer build (--serve)."""
    run_dir = Path(run_dir)
    trajs = trajectories(run_dir)
    evals = [asdict(e) for e in load_evals(run_dir)]
    return {"run": str(run_dir.resolve()), "roles": ROLES, "live": live, "stamp": input_stamp(run_dir),
            "steps": steps_timeline(load_history(run_dir / "metrics.jsonl")), "timeline": TIMELINE,
            "evals": [{k: e[k] for k in ("stage", "mean", "ci_low", "ci_high", "scores")} for e in evals],
            "paired": paired_changes(evals, trajs), "texts": token_texts(run_dir),
            "trajectories": [_plain(t) for t in trajs], "worst": worst_agreement(trajs)}


def _plain(traj: ViewTrajectory) -> dict[str, Any]:
    """A trajectory as a dict, sharing its lists (dataclasses.asdict deep-copies every token list: 40 s at 1,000)."""
    out = {f.name: getattr(traj, f.name) for f in fields(traj)}
    if traj.samples is not None:
        out["samples"] = [{f.name: getattr(s, f.name) for f in fields(s)} for s in traj.samples]
    return out


INPUTS = ("metrics.jsonl", "evals.json", "rollouts.jsonl", "view_tokens.jsonl")


def input_stamp(run_dir: Path) -> str:
    """Sizes and modification times of the files the page reads: a new step changes it (--serve reloads)."""
    parts = []
    for name in INPUTS:
        path = run_dir / name
        parts.append(f"{path.stat().st_size}:{path.stat().st_mtime_ns}" if path.is_file() else "-")
    return "|".join(parts)


def runs(values: list[float] | None) -> list[list[float]] | None:
    """[[value, count], ...] of equal neighbours: an advantage is constant over a turn, so it is stored once."""
    if values is None:
        return None
    out: list[list[float]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _wire(traj: dict[str, Any]) -> dict[str, Any]:
    """A trajectory as the page carries it: its samples as one string of JSON (parsed when opened), advantages as
    runs, and, where its tokens are recorded, its decoded segments only for their tool calls (the tokens are the
    text). The page expands them back (page.js samplesOf)."""
    if traj["samples"] is None:
        return traj
    compact = dict(separators=(",", ":"), allow_nan=False)
    samples = [dict(s, advantages=runs(s["advantages"])) for s in traj["samples"]]
    segments = [{"role": g["role"], "text": "", "tool_calls": g["tool_calls"], "answer": g.get("answer")}
                for g in traj["segments"] if g.get("tool_calls")]
    return dict(traj, samples=json.dumps(samples, **compact), segments=segments)


def render(data: dict[str, Any]) -> str:
    """The page: assets/page.html with the CSS, the JS and the data inlined (a `</` in the data is escaped, so no
    text of a trajectory can close the script element); trajectories in their wire form (`_wire`), so the page's
    load parses strings, not a million numbers (1,000 trajectories: benchmarks/view_page.py)."""
    data = dict(data, trajectories=[_wire(t) for t in data["trajectories"]])
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    html = (ASSETS / "page.html").read_text()
    return (html.replace("/*CSS*/", (ASSETS / "page.css").read_text())
            .replace("/*JS*/", (ASSETS / "page.js").read_text())
            .replace("/*DATA*/", blob))


def write_page(run_dir: str | Path, live: bool = False) -> Path:
    """Write <run dir>/view/index.html from what the run recorded; returns its path."""
    run_dir = Path(run_dir)
    path = run_dir / PAGE_DIR / PAGE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render(page_data(run_dir, live)))
    tmp.replace(path)  # a browser reloading mid-write never sees half a page
    return path
