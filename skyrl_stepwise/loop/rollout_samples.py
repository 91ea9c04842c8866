"""A few decoded trajectories per step and eval, so "reward 0" can be explained by reading what the model wrote.

Each sample is rebuilt from the token ids the trainer got (GeneratorOutput), never from a separate sampling run:
the first prompt, then each turn as the model sampled it (`model`) and what came back from the env or its tools
(`env`), with the tool calls the model's renderer parses from the sampled ids, the trajectory reward and its
stop reason. Per step, the best and the worst trajectory of each group are picked first, so a group that learned
something shows both sides. Written to <run dir>/rollouts.jsonl (one line per trajectory), read back by
`skyrl-stepwise show` and the run report, and logged as a wandb table.

For the trajectory viewer (`skyrl-stepwise view`), the first `logging.view_samples` of those picks also go to
<run dir>/view_tokens.jsonl per token, exactly as the trainer received them: ids, loss mask, the engine's and the
trainer's logprob, the advantage and where a merge put observations (TokenRecord). The page colours tokens from
these masks, never from re-tokenised text.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.tools.executor import error_kind_of

logger = logging.getLogger("skyrl_stepwise")
FILE = "rollouts.jsonl"
TOKENS_FILE = "view_tokens.jsonl"


@dataclass
class Segment:
    """One piece of a trajectory's text: `prompt` (the first render), `model` (sampled), `env` (observations,
    tool results, the next turn's header), or `prompt_rerendered` (history re-rendered by a template fallback)."""

    role: str
    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RolloutSample:
    """One decoded trajectory as a line of rollouts.jsonl."""

    step: int
    stage: str  # "train" or the eval's stage ("step 3", "before SFT", ...)
    trajectory: str
    pick: str  # why it was chosen: best / worst of its group, only (a group of one), or failed
    reward: float | None  # None: a failed trajectory (never scored, never trained)
    stop_reason: str | None
    turns: int
    segments: list[Segment]
    # where a context policy edited the context and what it dropped or summarised (GeneratorOutput.context_events)
    context_events: list[dict] = field(default_factory=list)
    failure: str | None = None  # why a failed trajectory failed ("env_step: ValueError(...)")
    # its env reported `reward/tamper_suspected` (GeneratorOutput.tamper_suspected): the grading saw a forgery attempt
    tamper_suspected: bool = False

    @property
    def prompt(self) -> str:
        return self.segments[0].text if self.segments else ""


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal loss-mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


# parsers only look for calls when the turn had tools; a run that does not say which gets this stand-in
ANY_TOOL = [{"type": "function", "function": {"name": "tool", "parameters": {"type": "object", "properties": {}}}}]


def call_verdict(error: str | None, name: str | None, tools: list[dict] | None) -> str:
    """The parser's verdict on one call, as the executor (tools/executor.py) answers it: `malformed` (a parse
    error), `unknown tool` (the parser's `unknown_tool`, or a name none of the run's tools has) or `ok`. With no
    tool list (`tools` None) every readable name counts as known."""
    if error is not None:
        return "unknown tool" if error_kind_of(error) == "unknown_tool" else "malformed"
    names = None if tools is None else {t.get("function", t).get("name") for t in tools}
    return "unknown tool" if names is not None and name not in names else "ok"


def _tool_calls(renderer, ids: list[int], prompt_ids: list[int], tools: list[dict] | None) -> list[dict[str, Any]]:
    """The calls the renderer parses from sampled ids (what a tool env executed), each with the parser's verdict
    (call_verdict); none when it cannot parse."""
    if renderer is None or not ids:
        return []
    try:
        turn = renderer.parse(ids, prompt_ids, tools or ANY_TOOL)
    except Exception:  # a log line must never fail a step; the text itself is still shown
        return []
    return [{"name": c.name, "arguments": c.arguments, **({"error": c.error} if c.error else {}),
             "verdict": call_verdict(c.error, c.name, tools)} for c in turn.tool_calls]


def decode_trajectory(renderer, samples: list[tuple[list[int], list[int], list[int]]],
                      tools: list[dict] | None = None) -> list[Segment]:
    """Segments of one trajectory from its samples' (prompt ids, response ids, loss mask), in order.

    A later sample's prompt that extends the previous sample's full sequence contributes only the new tokens
    (observations); one that does not (a re-render) is shown whole. Within a response, trained runs are the
    model's turns and untrained runs are observations merged in between; a response masked out entirely
    (overlong filtering) is still the model's."""
    segments: list[Segment] = []
    context: list[int] | None = None
    for prompt, response, mask in samples:
        if context is None:
            segments.append(Segment("prompt", renderer.decode(prompt)))
        elif prompt[:len(context)] == context:
            if len(prompt) > len(context):
                segments.append(Segment("env", renderer.decode(prompt[len(context):])))
        else:
            segments.append(Segment("prompt_rerendered", renderer.decode(prompt)))
        runs = _runs(mask) if any(mask) else [(0, len(response), 1)]
        for start, end, trained in runs:
            ids = response[start:end]
            if trained:
                segments.append(Segment("model", renderer.decode(ids),
                                         _tool_calls(renderer, ids, prompt + response[:start], tools)))
            else:
                segments.append(Segment("env", renderer.decode(ids)))
        context = prompt + response
    return segments


def pick_trajectories(scores: dict[TrajectoryID, float], n: int) -> list[tuple[TrajectoryID, str]]:
    """Up to n trajectories: the best and the worst of each group in turn (groups in batch order), so the
    samples show what a reward difference looks like; a group whose samples all tied gives one."""
    groups: dict[str, list[TrajectoryID]] = defaultdict(list)
    for tid in scores:
        groups[tid.instance_id].append(tid)
    picked: list[tuple[TrajectoryID, str]] = []
    for members in groups.values():
        best = min(members, key=lambda t: (-scores[t], t.repetition_id))
        worst = min(members, key=lambda t: (scores[t], t.repetition_id))
        if scores[best] == scores[worst]:
            picked.append((best, "only" if len(members) == 1 else "tied"))
        else:
            picked += [(best, "best"), (worst, "worst")]
    return picked[:n]


def trajectories(output: GeneratorOutput) -> tuple[dict[TrajectoryID, list[int]], dict[TrajectoryID, float]]:
    """Each trajectory's output rows (in order) and its total reward."""
    by_traj: dict[TrajectoryID, list[int]] = defaultdict(list)
    for i, tid in enumerate(output.trajectory_ids or []):
        by_traj[tid].append(i)
    rewards = output.trajectory_rewards()
    return by_traj, {tid: sum(rewards[i] for i in idx) for tid, idx in by_traj.items()}


def failed_samples(output: GeneratorOutput, renderer, step: int, stage: str, n: int,
                   tools: list[dict] | None = None) -> list[RolloutSample]:
    """Up to n failed trajectories, decoded up to their failure (the turn the env failed on included): what the
    model wrote before it, and why it failed. Never trained, so never among the picks above."""
    out = []
    for failed in output.failed_trajectories[:max(n, 0)]:
        samples = [(list(p), list(r), list(m)) for p, r, m in failed["samples"]]
        segments = decode_trajectory(renderer, samples, tools) if samples else []
        out.append(RolloutSample(step, stage, failed["trajectory"], "failed", None,
                                 f"failed: {failed['cause']}", sum(s.role == "model" for s in segments), segments,
                                 failure=failed["message"]))
    return out


def rollout_samples(output: GeneratorOutput, renderer, step: int, stage: str, n: int,
                    tools: list[dict] | None = None) -> list[RolloutSample]:
    """Up to n decoded trajectories of `output` (see pick_trajectories), then up to n failed ones
    (failed_samples); `tools`: the run's tool schemas."""
    failed = failed_samples(output, renderer, step, stage, n, tools)
    if n <= 0 or len(output) == 0 or output.trajectory_ids is None:
        return failed
    by_traj, scores = trajectories(output)
    out = []
    for tid, pick in pick_trajectories(scores, n):
        idx = by_traj[tid]
        segments = decode_trajectory(renderer, [(output.prompt_token_ids[i], output.response_ids[i],
                                                 output.loss_masks[i]) for i in idx], tools)
        stop = output.stop_reasons[idx[-1]] if output.stop_reasons else None
        events = [{k: v for k, v in e.items() if k != "trajectory"} for e in output.context_events
                  if e.get("trajectory") == tid.key()]
        out.append(RolloutSample(step, stage, tid.key(), pick, scores[tid], stop,
                                 sum(s.role == "model" for s in segments), segments, events,
                                 tamper_suspected=tid.key() in output.tamper_suspected))
    return out + failed


@dataclass
class TokenSample:
    """One training sample of a trajectory as the trainer received it; every list is parallel to response_ids.

    The prompt is stored as `prefix` tokens shared with the previous sample's prompt + response, then `prompt_ids`
    (the rest): a step-wise chain stores each token once. `prefix` == the previous sequence's length: the new
    prompt tokens are observations; shorter: the context was rewritten (a context edit or a re-render)."""

    prefix: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    engine_logprobs: list[float] | None  # what the engine sampled with (None: not returned)
    trainer_logprobs: list[float] | None  # the trainer's, before this step's update (None: not scored, e.g. evals)
    advantages: list[float] | None  # the advantage the loss used per token (None: not trained, e.g. evals)
    observation_spans: list[list[int]] | None  # merged samples: [start, end) of observations inside the response


@dataclass
class TokenRecord:
    """One trajectory per token: a line of view_tokens.jsonl; `texts` decodes each token id it uses."""

    step: int
    stage: str
    trajectory: str
    samples: list[TokenSample]
    texts: dict[str, str]


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def token_record(output: GeneratorOutput, rows: list[int], renderer, step: int, stage: str,
                 trainer: dict[int, list[float]], advantages: dict[int, list[float]]) -> TokenRecord:
    """The TokenRecord of the trajectory made of output rows `rows` (in order); `trainer` / `advantages`: per
    output row, where the trainer recorded them."""
    samples, context = [], []
    for i in rows:
        prompt = output.prompt_token_ids[i]
        prefix = _shared_prefix(context, prompt)
        lists = (output.rollout_logprobs, output.observation_spans)
        engine, spans = (None if v is None else list(v[i]) for v in lists)
        samples.append(TokenSample(prefix, list(prompt[prefix:]), list(output.response_ids[i]),
                                   list(output.loss_masks[i]), engine, trainer.get(i), advantages.get(i), spans))
        context = list(prompt) + list(output.response_ids[i])
    ids = sorted({t for s in samples for t in s.prompt_ids + s.response_ids})
    return TokenRecord(step, stage, output.trajectory_ids[rows[0]].key(), samples,
                       {str(t): renderer.decode([t]) for t in ids})


def batch_rows(output: GeneratorOutput, batch) -> dict[int, int]:
    """Output row -> its row in the TrainBatch built from it (dynamic sampling keeps only some groups).
    TrainBatch.from_output, select and concat carry the generator's token lists as they are, never copies, so a
    row is found by the identity of its response list: no second matching rule that could pick another sample."""
    where = {id(r): j for j, r in enumerate(batch.response_ids)}
    return {i: where[id(r)] for i, r in enumerate(output.response_ids) if id(r) in where}


class RolloutLog:
    """Appends the picked samples of every step and eval to <run dir>/rollouts.jsonl (and a wandb table), and the
    first `view_samples` of them per token to view_tokens.jsonl."""

    def __init__(self, output_dir: str | Path, renderer, num_samples: int, tracker=None,
                 tools: list[dict] | None = None, view_samples: int = 0) -> None:
        """`tools`: the run's tool schemas, for parsing calls out of the sampled turns (None: any call)."""
        self.path = Path(output_dir) / FILE
        self.tokens_path = Path(output_dir) / TOKENS_FILE
        self.renderer, self.num_samples, self.tracker, self.tools = renderer, num_samples, tracker, tools
        self.view_samples = view_samples

    def view_rows(self, output: GeneratorOutput) -> list[list[int]]:
        """The output rows of each trajectory recorded per token (the first view_samples picks, as in
        rollouts.jsonl), each trajectory's rows in order."""
        if self.view_samples <= 0 or len(output) == 0 or output.trajectory_ids is None:
            return []
        by_traj, scores = trajectories(output)
        return [by_traj[tid] for tid, _ in pick_trajectories(scores, self.view_samples)]

    def record_tokens(self, output: GeneratorOutput, step: int, stage: str,
                      trainer: dict[int, list[float]] | None = None,
                      advantages: dict[int, list[float]] | None = None) -> int:
        """Append the view_rows trajectories per token; returns the bytes written. Logged, never raised."""
        try:
            lines = [json.dumps(asdict(token_record(output, rows, self.renderer, step, stage, trainer or {},
                                                    advantages or {})), separators=(",", ":"))
                     for rows in self.view_rows(output)]
            if not lines:
                return 0
            self.tokens_path.parent.mkdir(parents=True, exist_ok=True)
            text = "".join(line + "\n" for line in lines)
            with open(self.tokens_path, "a") as f:
                f.write(text)
            return len(text)
        except Exception:
            logger.exception(f"per-token view samples of {stage} (step {step}) could not be written")
            return 0

    def record(self, output: GeneratorOutput, step: int, stage: str) -> list[RolloutSample]:
        """Decode, append and table this output's samples; a failure here is logged, never raised (the step's
        training must not depend on its log)."""
        if self.num_samples <= 0:
            return []
        try:
            samples = rollout_samples(output, self.renderer, step, stage, self.num_samples, self.tools)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                for s in samples:
                    f.write(json.dumps(asdict(s)) + "\n")
            if self.tracker is not None and samples:
                self.tracker.log_rollouts(samples, step, stage)
            return samples
        except Exception:
            logger.exception(f"rollout samples of {stage} (step {step}) could not be written")
            return []

    def rewind(self, step: int) -> None:
        """Drop training samples after `step` (a resumed run redoes those steps), per token too."""
        for path in (self.path, self.tokens_path):
            if path.is_file():
                kept = [line for line in path.read_text().splitlines() if _keep(line, step)]
                path.write_text("".join(line + "\n" for line in kept))


def _keep(line: str, step: int) -> bool:
    try:
        return json.loads(line)["step"] <= step
    except (json.JSONDecodeError, KeyError, TypeError):
        return False


def load_rollouts(run_dir: str | Path, name: str = FILE) -> list[dict[str, Any]]:
    """Every sample a run wrote (a line cut short by a kill is skipped)."""
    path = Path(run_dir) / name
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load_token_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every per-token trajectory a run wrote to view_tokens.jsonl (a line cut short by a kill is skipped)."""
    return load_rollouts(run_dir, TOKENS_FILE)


def format_sample(sample: dict[str, Any], max_chars: int = 2000) -> str:
    """A sample as readable text: header, then each segment labelled, long texts shortened in the middle."""
    def clip(text: str) -> str:
        return text if len(text) <= max_chars else text[: max_chars // 2] + " [...] " + text[-max_chars // 2:]

    reward = "not scored" if sample.get("reward") is None else f"{sample['reward']:g}"
    lines = [f"--- step {sample['step']} {sample['stage']} | {sample['trajectory']} ({sample['pick']}) | "
             f"reward {reward} | stop {sample['stop_reason']} | {sample['turns']} turn(s)"]
    if sample.get("tamper_suspected"):
        lines.append("[TAMPER SUSPECTED: the grading saw a forgery attempt (reward/tamper_suspected)]")
    if sample.get("failure"):
        lines.append(f"[FAILED, not trained: {sample['failure']}]")
        if not sample["segments"]:
            lines.append("(no turn before the failure)")
    for seg in sample["segments"]:
        lines.append(f"[{seg['role']}]")
        lines.append(clip(seg["text"]).rstrip())
        for call in seg.get("tool_calls") or []:
            lines.append(f"  -> tool call {call['name']}({json.dumps(call['arguments'])})"
                         + (f" [{call['verdict']}]" if call.get("verdict") else "")
                         + (f" ERROR {call['error']}" if call.get("error") else ""))
    for event in sample.get("context_events") or []:  # what the context policy changed, and where
        lines.append(f"[context {event['kind']} by {event['policy']} before model turn {event['before_step'] + 1}: "
                     f"{event['tokens_dropped']} tokens dropped; {event['note']}]")
    return "\n".join(lines)
