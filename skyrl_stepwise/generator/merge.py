"""Prefix-aware merging of step-wise samples into as few token chains per trajectory as the tokens allow.

A step-wise trajectory with exact history is one growing token chain: step i's prompt is step i-1's
prompt + response + the observation tokens. Training on every step re-runs the whole shared prefix once per
turn; merging the chain into one sample runs it once. The merger never re-tokenizes or edits a token: it joins
step i onto the running group only when the group's full sequence (prompt + response so far) is literally a
token prefix of step i's prompt, and the tokens in between (the observation delta) are added untrained
(loss_mask 0, rollout logprob 0.0, reward 0.0). Anything else (a template fallback, a truncated or rewritten
history) closes the group and starts a new sample, so what gets trained is exactly what was sampled.

Rewards come out per token. Per-token inputs are carried over unchanged. A per-sample float is put on the
last token of the merged response up to and including that step: the step's last response token, or, if the
step's response is empty, the token before it. Merged or not, every sample therefore has one reward form
and the total reward of every trajectory is preserved.

Turn indices (when the input has them) are carried per token too; the observation delta takes the index of the
step before it. The merge computes no credit: each step's reward stays on that step's tokens, so per-step
advantages (algorithms/credit.py) come out the same per token whether samples are merged or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID


@dataclass
class _Group:
    """One merged sample under construction: the first step's prompt plus the growing response."""

    prompt: list[int]
    full: list[int]  # prompt + response so far: what the next step's prompt must start with
    response: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    observations: list[list[int]] = field(default_factory=list)  # [start, end) of each delta in the response
    last: int = 0  # index of the group's last step in the input


def trajectory_ranges(output: GeneratorOutput) -> list[tuple[int, int]]:
    """Return the [start, end) sample ranges of each trajectory, so that merging can never cross one.

    Trajectories are delimited by is_last_step; a range must carry a single trajectory id, and an id must
    not come back after its trajectory ended (steps of one trajectory are contiguous by contract).
    """
    if output.trajectory_ids is None:
        raise ValueError("merge_stepwise_output needs GeneratorOutput.trajectory_ids (got None): it merges "
                         "only steps of the same trajectory")
    if output.is_last_step is None:
        raise ValueError("merge_stepwise_output needs GeneratorOutput.is_last_step (got None): it marks where "
                         "each trajectory ends")
    ranges: list[tuple[int, int]] = []
    seen: dict[TrajectoryID, int] = {}
    start = 0
    for i, (tid, last) in enumerate(zip(output.trajectory_ids, output.is_last_step)):
        if tid != output.trajectory_ids[start]:
            raise ValueError(f"sample {i} has trajectory_id {tid.key()} but trajectory "
                             f"{output.trajectory_ids[start].key()}, started at sample {start}, has not ended "
                             f"(no is_last_step=True before sample {i}); steps of a trajectory must be contiguous")
        if i == start and tid in seen:
            raise ValueError(f"trajectory {tid.key()} appears again at sample {i} after it ended at sample "
                             f"{seen[tid]}; steps of a trajectory must be contiguous")
        if last:
            seen[tid] = i
            ranges.append((start, i + 1))
            start = i + 1
    if start != len(output):
        raise ValueError(f"trajectory {output.trajectory_ids[start].key()} (samples {start}..{len(output) - 1}) "
                         f"does not end with is_last_step=True")
    return ranges


def _add_step(group: _Group, output: GeneratorOutput, i: int, delta: list[int], joined: bool) -> None:
    """Append step i (after its observation delta) to the group, keeping every per-token list aligned. A step that
    joins a group records its delta's span even when the delta is empty, so every span's end is where a step begins
    (the trajectory viewer splits a merged sample back into its steps there: view/page.py step_ranges)."""
    resp, reward = output.response_ids[i], output.rewards[i]
    if joined:
        group.observations.append([len(group.response), len(group.response) + len(delta)])
    if output.observation_spans is not None:  # an already merged input keeps its own observations
        start = len(group.response) + len(delta)
        group.observations += [[start + a, start + b] for a, b in output.observation_spans[i]]
    group.response += delta + resp
    group.full += delta + resp
    group.loss_mask += [0] * len(delta) + output.loss_masks[i]
    if output.rollout_logprobs is not None:
        group.logprobs += [0.0] * len(delta) + output.rollout_logprobs[i]
    group.rewards += [0.0] * len(delta)
    if output.turn_indices is not None:  # the observation belongs to the step whose action it answers
        # (when every earlier step of the group was empty, the delta goes to this step: a turn with no token has no
        # index to carry, and an observation must not make up a step of its own)
        step_turns = output.turn_indices[i]
        before = group.turns[-1] if group.turns else (step_turns[0] if step_turns else 0)
        group.turns += [before] * len(delta) + step_turns
    if isinstance(reward, list):
        group.rewards += reward
    else:  # a float lands on the last token so far: the step's last response token unless it has none
        group.rewards += [0.0] * len(resp)
        if group.rewards:
            group.rewards[-1] += float(reward)
        elif float(reward) != 0.0:
            raise ValueError(f"sample {i} has reward {reward} but an empty response and no token before it in "
                             f"its merged sample, so there is no token to put the reward on")
    group.last = i


def merge_stepwise_output(output: GeneratorOutput) -> GeneratorOutput:
    """Merge each trajectory's steps into the fewest exact token chains, so shared prefixes are run once.

    Greedy and exact: step i joins the current group iff the group's prompt+response is a token prefix of
    step i's prompt (see the module docstring for rewards). The merged sample takes its prompt from the
    group's first step and stop reason, trajectory id and is_last_step from its last. Costs O(total tokens).
    """
    output.validate()
    groups: list[_Group] = []
    for start, end in trajectory_ranges(output):
        group: _Group | None = None
        for i in range(start, end):
            prompt = output.prompt_token_ids[i]
            if group is not None and len(prompt) >= len(group.full) and prompt[:len(group.full)] == group.full:
                _add_step(group, output, i, prompt[len(group.full):], joined=True)
                continue
            group = _Group(prompt=list(prompt), full=list(prompt))
            groups.append(group)
            _add_step(group, output, i, [], joined=False)

    before = sum(len(p) + len(r) for p, r in zip(output.prompt_token_ids, output.response_ids))
    after = sum(len(g.full) for g in groups)
    metrics = dict(output.rollout_metrics)
    metrics.update({
        "generate/num_seq_before_merge": len(output),
        "generate/num_seq_after_merge": len(groups),
        "generate/merge_tokens_saved": before - after,
        # fraction of input samples absorbed into an earlier one
        "generate/merge_rate": (len(output) - len(groups)) / len(output) if len(output) else 0.0,
    })
    merged = GeneratorOutput(
        prompt_token_ids=[g.prompt for g in groups],
        response_ids=[g.response for g in groups],
        rewards=[g.rewards for g in groups],
        loss_masks=[g.loss_mask for g in groups],
        stop_reasons=None if output.stop_reasons is None else [output.stop_reasons[g.last] for g in groups],
        rollout_logprobs=None if output.rollout_logprobs is None else [g.logprobs for g in groups],
        trajectory_ids=[output.trajectory_ids[g.last] for g in groups],
        is_last_step=[output.is_last_step[g.last] for g in groups],
        turn_indices=None if output.turn_indices is None else [g.turns for g in groups],
        rollout_metrics=metrics,
        failed_trajectory_ids=list(output.failed_trajectory_ids),
        failed_trajectories=list(output.failed_trajectories),
        context_events=list(output.context_events),
        tamper_suspected=list(output.tamper_suspected),
        observation_spans=[g.observations for g in groups],
    )
    merged.validate()
    return merged
