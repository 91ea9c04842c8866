"""Prefix-aware step merger: exactness (what is trained never changes), grouping, errors."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID

tokens = st.lists(st.integers(0, 40), min_size=1, max_size=6)
logprob = st.floats(-8.0, 0.0, allow_nan=False)


@dataclass
class Step:
    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float]
    rewards: list[float]
    stop: str
    starts_group: bool  # True for the first step and for every step whose prompt does not extend the chain


@st.composite
def step_response(draw):
    """A sampled response: trained tokens, sometimes a masked appended EOS, reward on the last token."""
    resp = draw(st.lists(st.integers(0, 40), min_size=0, max_size=6))
    mask = [draw(st.sampled_from([1, 1, 1, 0])) for _ in resp]
    if resp and draw(st.booleans()):
        mask[-1] = 0  # an EOS the generator appended itself
    lps = [draw(logprob) for _ in resp]
    rewards = [0.0] * len(resp)
    if resp:
        rewards[-1] = draw(st.sampled_from([0.0, 1.0, -0.5, 0.25]))
    return resp, mask, lps, rewards


@st.composite
def trajectory(draw, allow_breaks: bool = True) -> list[Step]:
    """Exact chains (next prompt = previous prompt + response + observation), with optional template breaks."""
    steps: list[Step] = []
    prompt = draw(tokens)
    for i in range(draw(st.integers(1, 5))):
        starts_group = i == 0
        if i > 0:
            prev = steps[-1].prompt + steps[-1].response
            if allow_breaks and draw(st.integers(0, 3)) == 0:
                # a fallback re-render: the history diverges from the sampled tokens at some position k
                k = draw(st.integers(0, len(prev) - 1))
                prompt = prev[:k] + [prev[k] + 1] + draw(st.lists(st.integers(0, 40), max_size=6))
                starts_group = True
            else:
                prompt = prev + draw(st.lists(st.integers(0, 40), max_size=6))
        resp, mask, lps, rewards = draw(step_response())
        steps.append(Step(prompt, resp, mask, lps, rewards, draw(st.sampled_from(["stop", "length"])),
                          starts_group))
    return steps


@st.composite
def batch(draw, allow_breaks: bool = True):
    trajs = draw(st.lists(trajectory(allow_breaks), min_size=1, max_size=4))
    with_logprobs = draw(st.booleans())
    steps = [s for t in trajs for s in t]
    out = GeneratorOutput(
        prompt_token_ids=[list(s.prompt) for s in steps],
        response_ids=[list(s.response) for s in steps],
        rewards=[list(s.rewards) for s in steps],
        loss_masks=[list(s.mask) for s in steps],
        stop_reasons=[s.stop for s in steps],
        rollout_logprobs=[list(s.logprobs) for s in steps] if with_logprobs else None,
        trajectory_ids=[TrajectoryID(f"q{k // 2}", k % 2) for k, t in enumerate(trajs) for _ in t],
        is_last_step=[j == len(t) - 1 for t in trajs for j in range(len(t))],
        rollout_metrics={"generate/bridge_fallbacks": 3},
    )
    return trajs, out


def groups_of(trajs: list[list[Step]]) -> list[list[Step]]:
    """The groups the merger must form, as the strategy built them."""
    groups: list[list[Step]] = []
    for traj in trajs:
        for s in traj:
            if s.starts_group:
                groups.append([])
            groups[-1].append(s)
    return groups


def trained(samples, with_logprobs: bool) -> list[tuple]:
    """(token, logprob, reward) at every loss_mask==1 position, in order."""
    result = []
    for resp, mask, lps, rew in samples:
        lps = lps if with_logprobs else [None] * len(resp)
        result += [(t, lp, r) for t, m, lp, r in zip(resp, mask, lps, rew) if m]
    return result


def samples_of(out: GeneratorOutput, idx) -> list[tuple]:
    lps = out.rollout_logprobs
    return [(out.response_ids[i], out.loss_masks[i], lps[i] if lps else None, out.rewards[i]) for i in idx]


def by_trajectory(out: GeneratorOutput) -> dict[TrajectoryID, list[int]]:
    result: dict[TrajectoryID, list[int]] = {}
    for i, tid in enumerate(out.trajectory_ids):
        result.setdefault(tid, []).append(i)
    return result


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@settings(max_examples=200, deadline=None)
@given(batch())
def test_trained_tokens_logprobs_rewards_are_unchanged(data):
    _, out = data
    merged = merge_stepwise_output(out)
    merged.validate()
    before, after = by_trajectory(out), by_trajectory(merged)
    assert list(before) == list(after)  # same trajectories, same order
    with_lps = out.rollout_logprobs is not None
    for tid in before:
        assert trained(samples_of(merged, after[tid]), with_lps) == trained(samples_of(out, before[tid]), with_lps)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@settings(max_examples=200, deadline=None)
@given(batch())
def test_each_step_sits_verbatim_in_its_group_and_deltas_are_untrained(data):
    trajs, out = data
    merged = merge_stepwise_output(out)
    groups = groups_of(trajs)
    assert len(merged) == len(groups)  # one sample per group: 1 + breaks per trajectory
    for j, group in enumerate(groups):
        prompt, resp = merged.prompt_token_ids[j], merged.response_ids[j]
        assert prompt == group[0].prompt
        covered = [False] * len(resp)
        for s in group:
            off = len(s.prompt) - len(prompt)
            assert (prompt + resp)[:len(s.prompt)] == s.prompt  # the step's context is exactly what it saw
            window = slice(off, off + len(s.response))
            assert resp[window] == s.response and merged.loss_masks[j][window] == s.mask
            assert merged.rewards[j][window] == s.rewards
            if merged.rollout_logprobs is not None:
                assert merged.rollout_logprobs[j][window] == s.logprobs
            covered[window] = [True] * len(s.response)
        for k, c in enumerate(covered):  # observation deltas: never trained, no logprob, no reward
            if not c:
                assert merged.loss_masks[j][k] == 0 and merged.rewards[j][k] == 0.0
                assert merged.rollout_logprobs is None or merged.rollout_logprobs[j][k] == 0.0
        last = group[-1]
        assert prompt + resp == last.prompt + last.response  # so its length is the max over its steps
        assert merged.stop_reasons[j] == last.stop
        assert merged.is_last_step[j] == any(last is t[-1] for t in trajs)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@settings(max_examples=200, deadline=None)
@given(batch(allow_breaks=False))
def test_exact_chains_merge_to_one_sample_per_trajectory(data):
    trajs, out = data
    merged = merge_stepwise_output(out)
    assert len(merged) == len(trajs) and all(merged.is_last_step)
    assert merged.trajectory_ids == [out.trajectory_ids[i] for i, last in enumerate(out.is_last_step) if last]
    for j, traj in enumerate(trajs):
        assert merged.prompt_token_ids[j] + merged.response_ids[j] == traj[-1].prompt + traj[-1].response
    full = [len(p) + len(r) for p, r in zip(out.prompt_token_ids, out.response_ids)]
    m = merged.rollout_metrics
    assert m["generate/num_seq_before_merge"] == len(out) and m["generate/num_seq_after_merge"] == len(trajs)
    assert m["generate/merge_tokens_saved"] == sum(full) - sum(len(t[-1].prompt) + len(t[-1].response)
                                                            for t in trajs)
    assert m["generate/merge_rate"] == pytest.approx(1 - len(trajs) / len(out))
    assert m["generate/bridge_fallbacks"] == 3  # input metrics kept


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@settings(max_examples=200, deadline=None)
@given(batch())
def test_merge_is_idempotent_and_keeps_total_reward(data):
    _, out = data
    once = merge_stepwise_output(out)
    twice = merge_stepwise_output(once)
    for f in fields(GeneratorOutput):
        if f.name != "rollout_metrics":
            assert getattr(twice, f.name) == getattr(once, f.name), f.name
    assert twice.rollout_metrics["generate/merge_tokens_saved"] == 0
    assert twice.rollout_metrics["generate/merge_rate"] == 0.0
    totals = lambda o: {tid: sum(o.trajectory_rewards()[i] for i in idx) for tid, idx in by_trajectory(o).items()}
    assert totals(once) == pytest.approx(totals(out))
    lengths = [len(p) + len(r) for p, r in zip(once.prompt_token_ids, once.response_ids)]
    assert sum(lengths) == sum(len(p) + len(r) for p, r in zip(out.prompt_token_ids, out.response_ids)) \
        - once.rollout_metrics["generate/merge_tokens_saved"]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@settings(max_examples=100, deadline=None)
@given(batch())
def test_float_rewards_land_on_each_steps_last_token(data):
    _, out = data
    per_token = merge_stepwise_output(out)  # the strategy puts each reward on the step's last token
    out.rewards = [sum(r) for r in out.rewards]
    from_floats = merge_stepwise_output(out)
    assert from_floats.rewards == per_token.rewards
    assert all(isinstance(r, list) for r in from_floats.rewards)


def make(prompts, responses, tids, last, rewards=None, masks=None):
    return GeneratorOutput(prompt_token_ids=prompts, response_ids=responses,
                           rewards=rewards if rewards is not None else [[0.0] * len(r) for r in responses],
                           loss_masks=masks if masks is not None else [[1] * len(r) for r in responses],
                           stop_reasons=[f"s{i}" for i in range(len(prompts))],
                           rollout_logprobs=[[-0.5] * len(r) for r in responses],
                           trajectory_ids=[TrajectoryID(t, 0) for t in tids], is_last_step=last)


def test_two_step_chain():
    out = make(prompts=[[1, 2], [1, 2, 3, 4, 5, 6]], responses=[[3, 4], [7, 8, 99]], tids=["a", "a"],
               last=[False, True], rewards=[[0.0, 0.0], [0.0, 0.0, 1.0]], masks=[[1, 1], [1, 1, 0]])
    m = merge_stepwise_output(out)
    assert m.prompt_token_ids == [[1, 2]]
    assert m.response_ids == [[3, 4, 5, 6, 7, 8, 99]]
    assert m.loss_masks == [[1, 1, 0, 0, 1, 1, 0]]
    assert m.rollout_logprobs == [[-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5]]
    assert m.rewards == [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]
    assert m.stop_reasons == ["s1"] and m.is_last_step == [True]
    assert m.observation_spans == [[[2, 4]]]  # the delta 5, 6: not sampled (the appended 99 is, though masked)
    assert m.rollout_metrics["generate/merge_tokens_saved"] == 4  # (4 + 9) - 9
    assert m.rollout_metrics["generate/merge_rate"] == 0.5


def test_break_in_the_middle_starts_a_new_group():
    # step 3's prompt re-renders token 4 as 40: a template fallback, so it cannot join steps 1-2
    out = make(prompts=[[1], [1, 2, 3], [1, 2, 3, 40, 5], [1, 2, 3, 40, 5, 6, 7]],
               responses=[[2], [4], [6], [8]], tids=["a"] * 4, last=[False, False, False, True])
    m = merge_stepwise_output(out)
    assert m.prompt_token_ids == [[1], [1, 2, 3, 40, 5]]
    assert m.response_ids == [[2, 3, 4], [6, 7, 8]]
    assert m.loss_masks == [[1, 0, 1], [1, 0, 1]]
    assert m.stop_reasons == ["s1", "s3"] and m.is_last_step == [False, True]
    assert m.observation_spans == [[[1, 2]], [[1, 2]]]
    assert out.observation_spans is None  # not merged: every mask-0 response token was sampled or appended
    m.observation_spans[0] = [[1, 5]]
    with pytest.raises(ValueError, match="sample 0: observation_spans"):
        m.validate()


def test_turn_indices_follow_their_tokens_and_observations_belong_to_the_step_before():
    out = make(prompts=[[1], [1, 2, 3], [1, 2, 3, 40, 5], [1, 2, 3, 40, 5, 6, 7]],
               responses=[[2], [4], [6], [8, 9]], tids=["a"] * 4, last=[False, False, False, True],
               rewards=[[0.1], [0.2], [0.3], [0.0, 1.0]])
    out.turn_indices = [[0], [1], [2], [3, 3]]
    m = merge_stepwise_output(out)
    assert m.response_ids == [[2, 3, 4], [6, 7, 8, 9]]
    assert m.turn_indices == [[0, 0, 1], [2, 2, 3, 3]]  # the break (token 40) starts the second sample at turn 2
    assert m.rewards == [[0.1, 0.0, 0.2], [0.3, 0.0, 0.0, 1.0]]  # each step's reward stays on its own token
    out.turn_indices = None
    assert merge_stepwise_output(out).turn_indices is None
    out.turn_indices = [[0], [1], [2], [3, 2]]
    with pytest.raises(ValueError, match="sample 3: turn_indices must be >= 0 and non-decreasing"):
        out.validate()


def test_never_merges_across_trajectories():
    out = make(prompts=[[1], [1, 2]], responses=[[2], [3]], tids=["a", "b"], last=[True, True])
    assert merge_stepwise_output(out).response_ids == [[2], [3]]


def test_float_rewards_become_per_token():
    out = make(prompts=[[1], [1, 2, 3], [9]], responses=[[2], [4, 5], [7]], tids=["a", "a", "b"],
               last=[False, True, True], rewards=[0.5, 1.0, -1.0])
    m = merge_stepwise_output(out)
    assert m.rewards == [[0.5, 0.0, 0.0, 1.0], [-1.0]]
    assert m.trajectory_rewards() == [1.5, -1.0]


def test_float_reward_of_an_empty_response_goes_to_the_token_before():
    out = make(prompts=[[1], [1, 2, 3]], responses=[[2], []], tids=["a", "a"], last=[False, True],
               rewards=[0.0, 1.0])
    assert merge_stepwise_output(out).rewards == [[0.0, 1.0]]  # the observation's last token
    alone = make(prompts=[[1]], responses=[[]], tids=["a"], last=[True], rewards=[1.0])
    with pytest.raises(ValueError, match="sample 0 has reward 1.0 but an empty response"):
        merge_stepwise_output(alone)


def test_empty_output():
    out = GeneratorOutput([], [], [], [], trajectory_ids=[], is_last_step=[])
    m = merge_stepwise_output(out)
    assert len(m) == 0 and m.rollout_metrics["generate/merge_rate"] == 0.0


@pytest.mark.parametrize("change, message", [
    (dict(trajectory_ids=None), "needs GeneratorOutput.trajectory_ids"),
    (dict(is_last_step=None), "needs GeneratorOutput.is_last_step"),
    (dict(is_last_step=[True, False, True]), "trajectory a_0 appears again at sample 1 after it ended at sample 0"),
    (dict(trajectory_ids=[TrajectoryID("a", 0), TrajectoryID("b", 0), TrajectoryID("b", 0)]),
     "sample 1 has trajectory_id b_0 but trajectory a_0, started at sample 0, has not ended"),
    (dict(is_last_step=[False, False, False]), r"trajectory a_0 \(samples 0..2\) does not end with is_last_step"),
    (dict(loss_masks=[[1], [1], []]), "sample 2: 1 response ids but 0 loss_mask entries"),
])
def test_bad_input_is_rejected_with_a_clear_message(change, message):
    out = make(prompts=[[1], [1, 2, 3], [1, 2, 3, 4, 5]], responses=[[2], [4], [6]], tids=["a"] * 3,
               last=[False, False, True])
    for name, value in change.items():
        setattr(out, name, value)
    with pytest.raises(ValueError, match=message):
        merge_stepwise_output(out)


@settings(max_examples=40, deadline=None)
@given(batch(), st.sampled_from(["discounted", "gigpo"]))
def test_per_step_credit_is_the_same_merged_or_not(data, mode):
    """Turn indices ride along with their tokens, so every step keeps its reward, its observation history (the
    anchor) and hence its advantage: the masked tokens of each trajectory get the same advantages either way."""
    from skyrl_stepwise.policy.config import AlgorithmConfig
    from skyrl_stepwise.algorithms.credit import compute_credit

    trajs, out = data
    # a turn that sampled no token has no turn index, so the observation after it cannot keep its history apart
    assume(all(s.response for t in trajs for s in t[:-1]))
    out.turn_indices = [[j] * len(s.response) for t in trajs for j, s in enumerate(t)]
    merged = merge_stepwise_output(out)
    cfg = AlgorithmConfig(step_advantage=mode, gamma=0.7)

    def masked(o):
        credit = compute_credit(o, cfg)
        seen: dict = {}
        for tid, resp, mask, turns, adv in zip(o.trajectory_ids, o.response_ids, o.loss_masks, o.turn_indices,
                                               credit.advantages):
            seen.setdefault(tid, []).extend((tok, t, round(a, 9)) for tok, m, t, a in zip(resp, mask, turns, adv) if m)
        return seen, {k: v for k, v in credit.metrics.items() if "anchor" in k}

    assert masked(merged) == masked(out)


def test_a_step_joining_with_no_observation_still_marks_where_it_begins():
    # step 2's prompt is exactly step 1's prompt + response: an empty delta, still a step boundary (at 2)
    out = make(prompts=[[1], [1, 2, 3], [1, 2, 3, 4, 5]], responses=[[2, 3], [4], [6]], tids=["a"] * 3,
               last=[False, False, True])
    out.tamper_suspected = ["a_0"]
    m = merge_stepwise_output(out)
    assert m.response_ids == [[2, 3, 4, 5, 6]] and m.loss_masks == [[1, 1, 1, 0, 1]]
    assert m.observation_spans == [[[2, 2], [3, 4]]]  # every span's end is where a step's sampled tokens begin
    assert m.tamper_suspected == ["a_0"]  # which trajectories the grading suspected survives the merge
