"""Prompt mini-batches, rank shards, packed micro-batches, and logprobs from packed rows."""

from __future__ import annotations

import random

import pytest
import torch
from test_advantages import sample_trajs, stepwise_output

from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.policy.batching import (TrainBatch, balanced_partition, forward_logprobs, gather_logprobs,
                                             pack_indices, pack_micro_batch, packing_stats, prompt_mini_batches)


def test_mini_batches_are_whole_prompt_groups_and_do_not_depend_on_turns():
    stepwise = TrainBatch.from_output(stepwise_output(sample_trajs()))
    merged = TrainBatch.from_output(merge_stepwise_output(stepwise_output(sample_trajs())))
    for batch in (stepwise, merged):
        mbs = prompt_mini_batches(batch.instance_ids, 1)
        assert [sorted({batch.instance_ids[i] for i in mb}) for mb in mbs] == [["q1"], ["q2"]]
        assert sorted(i for mb in mbs for i in mb) == list(range(len(batch)))
    assert len(prompt_mini_batches(stepwise.instance_ids, 2)) == 1
    ids = [f"p{i % 7}" for i in range(40)]
    assert len(prompt_mini_batches(ids, 3)) == 3  # ceil(7 prompts / 3)


def test_pack_and_partition_cover_every_sample_once_within_budget():
    rng = random.Random(0)
    lens = [rng.randint(5, 300) for _ in range(60)] + [900]
    bins = pack_indices(lens, 512)
    assert sorted(i for b in bins for i in b) == list(range(len(lens)))
    assert all(sum(lens[i] for i in b) <= 512 for b in bins if len(b) > 1)
    assert [60] in bins  # the over-budget sample gets a row of its own
    assert len(bins) <= sum(lens) / 512 * 1.15 + 2  # first-fit-decreasing leaves little room unused
    parts = balanced_partition(lens[:60], 2)
    assert sorted(parts[0] + parts[1]) == list(range(60))
    loads = [sum(lens[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(lens[:60])


def test_packed_row_layout():
    batch = TrainBatch(prompt_ids=[[1, 2, 3], [4], [5, 6]], response_ids=[[7, 8], [9, 10, 11], []],
                       loss_masks=[[1, 0], [1, 1, 1], []], instance_ids=["a", "b", "c"],
                       advantages=[[0.5, 0.0], [1.0, 1.0, 1.0], []])
    mb = pack_micro_batch(batch, [0, 1, 2])
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 8, 4, 9, 10, 11, 5, 6]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]]
    assert (mb.input_ids[0, mb.logit_index + 1] == mb.targets).all()
    assert mb.logit_index.tolist() == [2, 3, 5, 6, 7]
    assert mb.loss_mask.tolist() == [1, 0, 1, 1, 1]
    assert mb.split(mb.advantages) == [[0.5, 0.0], [1.0, 1.0, 1.0], []]
    empty = pack_micro_batch(batch, [])
    assert empty.num_tokens == 1 and empty.targets.numel() == 0


def test_packing_stats_against_a_padded_batch():
    rng = random.Random(1)
    prompts = [[1] * rng.randint(50, 400) for _ in range(32)]
    responses = [[2] * rng.randint(10, 200) for _ in range(32)]
    batch = TrainBatch(prompts, responses, [[1] * len(r) for r in responses], ["x"] * 32)
    mbs = pack_indices(batch.seq_lens(), 1024)
    stats = packing_stats(batch, mbs)
    assert stats["train/real_tokens"] == sum(batch.seq_lens())
    assert stats["train/batch_padded_seq_len"] == max(map(len, prompts)) + max(map(len, responses))
    assert stats["train/pad_ratio"] <= 1.1
    assert stats["train/padded_batch_pad_ratio"] > 1.3  # what left-padding would have cost


def test_gather_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 101, generator=g) * 3
    targets = torch.randint(0, 101, (37,), generator=g)
    for temperature in (1.0, 0.7):
        lp, ent = gather_logprobs(logits, targets, temperature, with_entropy=True, chunk_rows=8)
        ref = torch.log_softmax(logits / temperature, -1)
        torch.testing.assert_close(lp, ref.gather(-1, targets[:, None]).squeeze(-1))
        torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_logprobs_values_and_gradients_match_log_softmax(dtype, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 101, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 101, (37,), generator=g)
    weights = torch.randn(37, generator=g)  # an upstream gradient that differs per token
    x, ref_x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    lp, _ = gather_logprobs(x, targets, temperature, chunk_rows=8)
    ref = torch.log_softmax(ref_x.float() / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    (lp * weights).sum().backward()
    (ref * weights).sum().backward()
    assert lp.dtype == torch.float32 and x.grad.dtype == dtype
    torch.testing.assert_close(lp, ref)
    torch.testing.assert_close(x.grad, ref_x.grad)
    # a rank whose micro-batch has no response token still runs a backward through the model
    empty = torch.zeros(0, 101, dtype=dtype, requires_grad=True)
    lp, ent = gather_logprobs(empty, targets[:0], temperature, with_entropy=True)
    lp.sum().backward()
    assert lp.shape == ent.shape == (0,) and empty.grad.shape == (0, 101)


def test_gather_logprobs_keeps_no_fp32_logits_for_backward():
    """Autograd must not keep an fp32 copy of the [R, V] logits: at R=8k, V=150k that is 5 GB per micro-batch."""
    r, v = 64, 1000
    logits = torch.randn(r, v).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (r,))
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # each storage counted once
        return t

    for temperature in (1.0, 0.7):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, _ = gather_logprobs(logits, targets, temperature, with_entropy=True, chunk_rows=16)
        assert sum(saved.values()) < r * v * 2.5  # the bf16 input (r * v * 2) and [R] vectors only
        lp.sum().backward()


@pytest.mark.integration
def test_packed_logprobs_equal_unpacked(tiny_smollm2):
    """Samples packed into one row (position_ids restarting) must not see each other: same logprobs as alone.
    The attention layout, not the weights: on SmolLM2's tiny twin (per-architecture packing: test_packing_conformance)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_smollm2, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()

    batch = TrainBatch(prompt_ids=[ids(12), ids(5), ids(20)], response_ids=[ids(6), ids(9), ids(4)],
                       loss_masks=[[1] * 6, [1] * 9, [1] * 4], instance_ids=["a", "a", "b"])
    with torch.no_grad():
        packed, _ = forward_logprobs(model, pack_micro_batch(batch, [0, 1, 2]))
        alone = [forward_logprobs(model, pack_micro_batch(batch, [i]))[0] for i in range(3)]
        # and against a plain full-logits forward of each sample on its own
        p, r = batch.prompt_ids[1], batch.response_ids[1]
        logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        plain = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-4)
    torch.testing.assert_close(alone[1], plain, rtol=0, atol=1e-4)
