"""Prefix-tree packing (policy/tree.py): trie properties (hypothesis), scheduling, the masks per attention, and the
acceptance on SmolLM2 fp32: tree logprobs == separate forwards, loss and every gradient == rows packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_stepwise.policy.batching import (TrainBatch, forward_logprobs, pack_micro_batch, packing_stats,
                                             rank_micro_batches)
from skyrl_stepwise.policy.config import AlgorithmConfig, TrainerConfig
from skyrl_stepwise.policy.packing.masks import allowed_mask, dense_mask
from skyrl_stepwise.policy.tree import PrefixCounter, build_trie, pack_units, tree_units, unique_tokens

# a tiny alphabet makes random sequences share prefixes (and diverge again) all the time
tokens = st.integers(0, 3)
sequences = st.lists(st.lists(tokens, min_size=1, max_size=10), min_size=1, max_size=8)


@st.composite
def prompt_groups(draw):
    """A prompt group: a shared prompt, samples extending it (step-wise chains, merged, broken ones)."""
    prompt = draw(st.lists(tokens, min_size=1, max_size=6))
    seqs = []
    for _ in range(draw(st.integers(1, 6))):
        base = draw(st.sampled_from(seqs)) if seqs and draw(st.booleans()) else prompt
        cut = draw(st.integers(1, len(base)))  # cut < len: a broken chain (a stripped or re-rendered history)
        seqs.append(base[:cut] + draw(st.lists(tokens, min_size=1, max_size=6)))
    return seqs


def _ancestors(parents: list[int], node: int) -> set[int]:
    out = set()
    while node >= 0:
        out.add(node)
        node = parents[node]
    return out


@settings(max_examples=150, deadline=None)
@given(st.one_of(sequences, prompt_groups()))
def test_trie_nodes_are_distinct_prefixes_and_positions_are_depths(seqs):
    trie = build_trie(seqs)
    prefixes = {tuple(s[:i + 1]) for s in seqs for i in range(len(s))}
    assert len(trie) == len(prefixes) == unique_tokens(seqs)
    for seq, nodes in zip(seqs, trie.sample_nodes):
        assert [trie.tokens[n] for n in nodes] == seq
        assert [trie.depths[n] for n in nodes] == list(range(len(seq)))  # position ids == depths
        assert [trie.parents[n] for n in nodes] == [-1] + nodes[:-1]
    assert all(trie.parents[n] < n for n in range(len(trie)))  # preorder: a parent comes first


@settings(max_examples=150, deadline=None)
@given(st.one_of(sequences, prompt_groups()))
def test_each_token_attends_to_exactly_its_own_prefix(seqs):
    trie = build_trie(seqs)
    mask = allowed_mask(torch.tensor(trie.subtree_end), torch.tensor(trie.depths))
    for q in range(len(trie)):
        assert set(mask[q].nonzero().flatten().tolist()) == _ancestors(trie.parents, q)
    for nodes in trie.sample_nodes:  # no token attends across branches: a sample's token sees its own prefix only
        for i, q in enumerate(nodes):
            assert set(mask[q].nonzero().flatten().tolist()) == set(nodes[:i + 1])


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@settings(max_examples=100, deadline=None)
@given(sequences, sequences)
def test_prefix_counter_prices_the_marginal_nodes(a, b):
    counter = PrefixCounter()
    assert counter.new_nodes(a, add=True) == unique_tokens(a)
    assert counter.new_nodes(b) == unique_tokens(a + b) - unique_tokens(a)
    assert len(counter) == unique_tokens(a)  # pricing alone adds nothing


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@settings(max_examples=100, deadline=None)
@given(st.lists(prompt_groups(), min_size=1, max_size=5), st.integers(4, 40))
def test_units_and_bins_keep_groups_whole_within_budget(groups, budget):
    seqs = [s for g in groups for s in g]
    ids = [f"g{k}" for k, g in enumerate(groups) for _ in g]
    units, split = tree_units(seqs, ids, budget)
    assert sorted(i for u in units for i in u) == list(range(len(seqs)))
    for u in units:
        assert len({ids[i] for i in u}) == 1
        assert len(u) == 1 or unique_tokens([seqs[i] for i in u]) <= budget  # the T x T mask stays bounded
    pieces = {g: sum(1 for u in units if ids[u[0]] == g) for g in set(ids)}
    assert split == sum(n > 1 for n in pieces.values())
    for g, n in pieces.items():  # a group whose trie fits the budget is never cut
        assert n == 1 or unique_tokens([seqs[i] for i, x in enumerate(ids) if x == g]) > budget
    bins = pack_units(seqs, units, budget)
    assert sorted(u for b in bins for u in b) == list(range(len(units)))
    for b in bins:
        assert len(b) == 1 or unique_tokens([seqs[i] for u in b for i in units[u]]) <= budget


def _toy_batch() -> TrainBatch:
    """Two prompt groups sharing a 3-token system prompt; q1 has a step-wise chain and a branching sample."""
    system = [1, 2, 3]
    return TrainBatch(
        prompt_ids=[system + [10], system + [10, 20, 21, 30], system + [10], system + [11]],
        response_ids=[[20, 21], [40], [20, 22], [50, 51]],
        loss_masks=[[1, 1], [1], [1, 0], [1, 1]], instance_ids=["q1", "q1", "q1", "q2"],
        advantages=[[0.5, 0.5], [1.0], [-1.0, -1.0], [2.0, 2.0]])


def test_tree_row_layout():
    batch = _toy_batch()
    mb = pack_micro_batch(batch, [0, 1, 2, 3], "tree")
    # preorder: 1 2 3 10 20 21 30 40 | 22 | 11 50 51 (first-seen children first)
    assert mb.input_ids.tolist() == [[1, 2, 3, 10, 20, 21, 30, 40, 22, 11, 50, 51]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 5, 3, 4, 5]]
    assert mb.subtree_end.tolist() == [12, 12, 12, 9, 9, 8, 8, 8, 9, 12, 12, 12]
    # sample 2's first response token is predicted by the same node (10) as sample 0's: one copy each
    assert mb.logit_index.tolist() == [3, 4, 6, 3, 4, 9, 10]
    assert mb.input_ids[0, mb.logit_index].tolist() == [10, 20, 30, 10, 20, 11, 50]
    assert mb.targets.tolist() == [20, 21, 40, 20, 22, 50, 51]
    assert mb.split(mb.advantages) == batch.advantages and mb.loss_mask.tolist() == [1, 1, 1, 1, 0, 1, 1]
    empty = pack_micro_batch(batch, [], "tree")
    assert empty.num_tokens == 1 and empty.targets.numel() == 0 and empty.subtree_end.tolist() == [1]


def test_tree_scheduling_and_token_accounting():
    batch = _toy_batch()
    seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    [one] = rank_micro_batches(batch, 0, 1, 100, "tree")
    assert one == [0, 1, 2, 3]
    stats = packing_stats(batch, [one], "tree", 100)
    assert stats["train/forward_tokens"] == stats["train/unique_tokens"] == 12 < stats["train/real_tokens"] == 26
    assert stats["train/compression_ratio"] == pytest.approx(26 / 12) and stats["train/tree_split_groups"] == 0
    rows = packing_stats(batch, rank_micro_batches(batch, 0, 1, 100), "rows")
    assert rows["train/forward_tokens"] == rows["train/packed_tokens"] == 26 and rows["train/unique_tokens"] == 12
    # two ranks: a prompt group never straddles ranks; q1 (9 nodes) and q2 (6) go to different ranks
    shards = [rank_micro_batches(batch, r, 2, 100, "tree") for r in range(2)]
    assert sorted(shards, key=len) == [[[3]], [[0, 1, 2]]] or sorted(map(sorted, shards)) == [[[0, 1, 2]], [[3]]]
    # a budget below q1's trie splits it (counted), and no row exceeds the budget unless it holds one sample
    small = rank_micro_batches(batch, 0, 1, 8, "tree")
    assert sorted(i for mb in small for i in mb) == [0, 1, 2, 3]
    assert all(len(mb) == 1 or unique_tokens([seqs[i] for i in mb]) <= 8 for mb in small)
    assert packing_stats(batch, small, "tree", 8)["train/tree_split_groups"] == 1


def test_masks_per_attention_implementation():
    end, depths = torch.tensor([3, 2, 3]), torch.tensor([0, 1, 1])  # node 0 with children 1 and 2
    sdpa = dense_mask(end, depths, None, "sdpa")
    assert sdpa.dtype == torch.bool and sdpa.shape == (1, 1, 3, 3)
    assert sdpa[0, 0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    eager = dense_mask(end, depths, None, "eager")  # eager adds the mask to the scores: it must be 0 / -inf-like
    assert eager.dtype == torch.float32 and (eager[0, 0][sdpa[0, 0]] == 0).all()
    assert (eager[0, 0][~sdpa[0, 0]] == torch.finfo(torch.float32).min).all()
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        dense_mask(end, depths, None, "flash_attention_2")


def test_config_refuses_tree_with_flash_attention_naming_both_keys():
    cfg = TrainerConfig(packing="tree", attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match=r"trainer.packing=tree.*trainer.attn_implementation=flash_attention_2"):
        cfg.validate()
    with pytest.raises(ValueError, match="trainer.packing: 'trie'"):
        TrainerConfig(packing="trie").validate()
    TrainerConfig(packing="tree", attn_implementation="flex_attention").validate()


def _tiny_model(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)).eval()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("attn", ["eager", "flex_attention"])
def test_eager_and_flex_tree_masks_give_the_sdpa_logprobs(attn):
    """eager takes the additive mask; flex (CPU: forward only, uncompiled, as a reference for the GPU path) the
    BlockMask from the trie over a row padded to 128. Both must score like sdpa's boolean mask."""
    from skyrl_stepwise.policy.packing.flex import register_packed_flex_attention

    batch = _toy_batch()
    mb = pack_micro_batch(batch, [0, 1, 2, 3], "tree")
    with torch.no_grad():
        ref, _ = forward_logprobs(_tiny_model("sdpa"), mb)
        model = _tiny_model("sdpa")
        model.set_attn_implementation(register_packed_flex_attention() if attn == "flex_attention" else attn)
        got, _ = forward_logprobs(model, mb)
        alone = torch.cat([forward_logprobs(model if attn == "eager" else _tiny_model("sdpa"),
                                            pack_micro_batch(batch, [i]))[0] for i in range(4)])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_worker_tree_and_rows_train_the_same_step(tiny_model_dir):
    """The PolicyWorker (FSDP2, 1 rank) with packing=tree: same logprobs, loss and gradient norm as rows from one
    snapshot, fewer tokens forwarded, and the accounting in the step's metrics."""
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = TrainerConfig(model_path=str(tiny_model_dir), micro_batch_tokens=64, ckpt_dir=str(tiny_model_dir / "c"),
                        packing="rows")
    cfg.fsdp.mixed_precision = False
    cfg.algorithm.use_kl_loss = False
    cfg.algorithm.tis_ratio_clip_high = None
    worker = PolicyWorker(cfg)
    batch = _toy_batch()
    worker.snapshot()
    rows_lp = worker.compute_logprobs(batch)
    rows = worker.train_step(batch)
    worker.restore_snapshot()
    assert worker.set_packing("tree") == "rows"
    torch.testing.assert_close(torch.tensor(sum(worker.compute_logprobs(batch), [])),
                               torch.tensor(sum(rows_lp, [])), rtol=1e-5, atol=1e-5)
    tree = worker.train_step(batch)
    assert tree["policy/loss"] == pytest.approx(rows["policy/loss"], rel=1e-5)
    assert tree["train/grad_norm"] == pytest.approx(rows["train/grad_norm"], rel=1e-5)
    assert tree["train/forward_tokens"] == 12 < rows["train/forward_tokens"] == 26
    assert tree["train/compression_ratio"] == pytest.approx(26 / 12)
    with pytest.raises(ValueError, match="trainer.packing"):
        worker.set_packing("trie")


# ------------------------------------------------------------------- acceptance on SmolLM2 fp32 (real tokens)

def _acceptance_batch(tokenizer) -> TrainBatch:
    """Two prompt groups with one system prompt: step-wise samples, a merged sample, a Qwen3-style broken chain
    (the next step's history strips the previous reasoning), and responses that share their first tokens.
    Short texts in SmolLM2's ChatML: a CPU backward of SmolLM2 costs ~0.1 s per token on a loaded 2-core box."""
    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def prompt(q):
        return enc(f"<|im_start|>system\nUse search.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
                   f"<|im_start|>assistant\n")

    def obs(info):
        return enc(f"<|im_start|>user\n{info}<|im_end|>\n<|im_start|>assistant\n")

    p1, p2 = prompt("Hamlet author?"), prompt("2+3?")
    a1, a2 = enc("<search>Hamlet</search><|im_end|>\n"), enc("<answer>Shakespeare</answer><|im_end|>")
    b1, b2 = enc("<search>play</search><|im_end|>\n"), enc("<answer>Marlowe</answer><|im_end|>")
    o1 = obs("a play")
    think = enc("<think>a play</think><search>Hamlet</search><|im_end|>\n")
    stripped = enc("<search>Hamlet</search><|im_end|>\n")
    samples = [  # (prompt, response, loss mask, group)
        (p1, a1, [1] * len(a1), "q1"), (p1 + a1 + o1, a2, [1] * len(a2), "q1"),  # step-wise chain
        (p1, b1 + o1 + b2, [1] * len(b1) + [0] * len(o1) + [1] * len(b2), "q1"),  # merged, observation masked
        (p1, think, [1] * len(think), "q1"), (p1 + stripped + o1, b2, [1] * len(b2), "q1"),  # broken chain
        (p2, a1, [1] * len(a1), "q2"), (p2, b2, [1] * len(b2), "q2"),
    ]
    g = torch.Generator().manual_seed(0)

    def per_token(n, scale, shift=0.0):
        return ((torch.rand(n, generator=g) * 2 - 1) * scale + shift).tolist()

    return TrainBatch(prompt_ids=[s[0] for s in samples], response_ids=[s[1] for s in samples],
                      loss_masks=[s[2] for s in samples], instance_ids=[s[3] for s in samples],
                      # positive, so the loss is not a cancelling sum near 0 (a relative tolerance on one would
                      # measure the cancellation, not the packing)
                      advantages=[per_token(len(s[1]), 0.75, 1.0) for s in samples])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _loss_and_grads(model, batch: TrainBatch, packing: str, cfg: AlgorithmConfig):
    from skyrl_stepwise.policy.fsdp_worker import micro_batch_loss

    model.zero_grad(set_to_none=True)
    loss, metrics = micro_batch_loss(model, pack_micro_batch(batch, list(range(len(batch))), packing), cfg,
                                     batch.loss_denominator())
    loss.backward()
    return loss.item(), metrics, {k: p.grad.clone() for k, p in model.named_parameters()}


def _grad_errors(grads: dict, ref: dict) -> tuple[float, tuple[float, str]]:
    """(relative error of the whole gradient, worst relative error of one parameter's gradient, its name)."""
    whole = (torch.cat([(grads[k] - ref[k]).flatten() for k in ref]).norm()
             / torch.cat([ref[k].flatten() for k in ref]).norm()).item()
    return whole, max((_rel(grads[k], ref[k]), k) for k in ref)


@pytest.mark.integration
def test_tree_equals_separate_forwards_and_rows_on_smollm2(model_path, tokenizer):
    """Needs the real SmolLM2: its tolerances were measured on the real weights' summation-order noise.
    fp32, the acceptance: logprobs == separate forwards, loss and metrics == rows within 1e-5 relative, the
    whole gradient within 1e-5 relative, with gradient checkpointing too. Per parameter, fp32 summation order alone
    moves a gradient by up to ~4e-4 relative (rows with every sample in its own micro-batch vs all in one row,
    measured on this batch), so each parameter is held to 1e-4 here and to 1e-5 in float64 (next test)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    batch = _acceptance_batch(tokenizer)
    everything = list(range(len(batch)))
    tree_mb = pack_micro_batch(batch, everything, "tree")
    assert tree_mb.num_tokens < 0.5 * pack_micro_batch(batch, everything).num_tokens  # shared tokens forwarded once

    with torch.no_grad():
        alone = [forward_logprobs(model, pack_micro_batch(batch, [i]))[0] for i in everything]
        tree_lp, _ = forward_logprobs(model, tree_mb)
    torch.testing.assert_close(tree_lp, torch.cat(alone), rtol=1e-5, atol=1e-5)

    # realistic old / rollout / reference logprobs: the model's own, perturbed per token (ratio and TIS clip engage)
    g = torch.Generator().manual_seed(1)

    def noisy(scale):
        return [(a + scale * (torch.rand(a.shape, generator=g) * 2 - 1)).tolist() for a in alone]

    batch.old_logprobs, batch.rollout_logprobs, batch.ref_logprobs = noisy(0.3), noisy(1.0), noisy(0.3)
    cfg = AlgorithmConfig(tis_ratio_clip_high=2.0, use_kl_loss=True, kl_loss_coef=0.1)
    model.train()  # SmolLM2 has no dropout: train mode only lets checkpointing act
    loss_r, m_r, grads_r = _loss_and_grads(model, batch, "rows", cfg)
    assert m_r["policy/clip_frac"] > 0 and m_r["policy/tis_clip_frac"] > 0
    tree = _loss_and_grads(model, batch, "tree", cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _loss_and_grads(model, batch, "tree", cfg)
    model.gradient_checkpointing_disable()
    for loss, metrics, grads in (tree, checkpointed):
        assert loss == pytest.approx(loss_r, rel=1e-5)
        for k in m_r:
            # ppo_kl and kl_loss are means of per-token logprob differences, near 0: held to the logprobs' own
            # absolute tolerance (1e-5, above), not to 1e-5 of their small value. On an AVX-512 CPU (other fp32
            # kernels, other summation order) ppo_kl 0.0119873 moved by 2.2e-7 (1.9e-5 relative) between rows and tree
            # while every logprob stayed within 1e-5; every other metric keeps 1e-5 relative
            diff_of_logprobs = k in ("policy/ppo_kl", "policy/kl_loss")
            assert metrics[k] == pytest.approx(m_r[k], rel=1e-5, abs=1e-5 if diff_of_logprobs else 1e-9), k
        assert grads.keys() == grads_r.keys()
        whole, worst = _grad_errors(grads, grads_r)
        assert whole < 1e-5 and worst[0] < 1e-4, (whole, worst)
    assert sum(g.abs().sum() for g in grads_r.values()) > 0


@pytest.mark.integration
def test_tree_is_exact_in_float64(tiny_smollm2, tokenizer):
    """float64: the tree's hidden states are bit-for-bit those of separate forwards (each node sees exactly its own
    prefix at its own positions), and every parameter's gradient equals rows within 1e-5 relative. Not closer:
    a shared node's gradient is summed at the node (rows sums it in the weight gradients), and LlamaRMSNorm
    computes in float32 even in a float64 model, so that change of summation order is rounded to float32.
    Bit-for-bit is a property of the layout, not of the weights: on SmolLM2's tiny twin (the fp32 acceptance above
    keeps the real model and its measured tolerances)."""
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.policy.packing import attention_layout, row_model_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_smollm2, dtype=torch.float64, attn_implementation="sdpa")
    batch = _acceptance_batch(tokenizer)
    tree = pack_micro_batch(batch, list(range(len(batch))), "tree")
    with torch.no_grad():
        hidden = model.model(**row_model_inputs(tree.input_ids, tree.position_ids, tree.subtree_end,
                                                attention_layout(model)),
                             use_cache=False).last_hidden_state[0, tree.logit_index]
        alone = torch.cat([model.model(input_ids=torch.tensor([p + r]), use_cache=False).last_hidden_state[
            0, len(p) - 1:-1] for p, r in zip(batch.prompt_ids, batch.response_ids)])
    assert torch.equal(hidden, alone)
    cfg = AlgorithmConfig(tis_ratio_clip_high=None, use_kl_loss=False)
    loss_r, _, grads_r = _loss_and_grads(model, batch, "rows", cfg)
    loss_t, _, grads_t = _loss_and_grads(model, batch, "tree", cfg)
    assert loss_t == pytest.approx(loss_r, rel=1e-12)
    whole, worst = _grad_errors(grads_t, grads_r)
    assert whole < 1e-6 and worst[0] < 1e-5, (whole, worst)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_ablation_tree_mode_replays_the_same_samples_from_the_same_start(tiny_model_dir):
    """The ablation's fourth mode: the step-wise samples trained with packing=tree, from the same snapshot; it
    forwards the distinct prefixes only and takes the same update (grad norm) as step_wise rows."""
    from test_advantages import sample_trajs, stepwise_output

    from skyrl_stepwise.cli.ablate import LocalPolicy, replay_costs

    cfg = TrainerConfig(model_path=str(tiny_model_dir), ckpt_dir=str(tiny_model_dir / "c"), packing="rows")
    cfg.fsdp.mixed_precision = False
    cfg.algorithm.use_kl_loss = False
    policy = LocalPolicy(cfg)
    policy.call("snapshot")
    stepwise = stepwise_output(sample_trajs())
    by_mode = {r["mode"]: r for r in replay_costs(stepwise, "exact", ["step_wise", "tree"], policy, cfg.algorithm)}
    seqs = [p + r for p, r in zip(stepwise.prompt_token_ids, stepwise.response_ids)]
    assert by_mode["tree"]["forward_tokens"] == unique_tokens(seqs) < by_mode["step_wise"]["forward_tokens"]
    assert by_mode["tree"]["samples"] == by_mode["step_wise"]["samples"] == len(stepwise)
    assert by_mode["tree"]["start_weights"] == by_mode["step_wise"]["start_weights"]
    assert by_mode["tree"]["grad_norm"] == pytest.approx(by_mode["step_wise"]["grad_norm"], rel=1e-5)
    assert policy.worker.cfg.packing == "rows"  # left as configured


def test_step_metrics_sum_the_token_counts_and_recompute_the_compression():
    from skyrl_stepwise.loop.loop import combine_train_metrics

    batch = _toy_batch()
    first = packing_stats(batch, [[0, 1, 2, 3]], "tree", 100)
    second = packing_stats(batch.select([3]), [[0]], "tree", 100)
    step = combine_train_metrics([first, second])
    assert step["train/forward_tokens"] == 12 + 6 and step["train/unique_tokens"] == 12 + 6
    assert step["train/compression_ratio"] == pytest.approx((26 + 6) / (12 + 6))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_worker_with_flex_attention_loads_the_packed_flex_kernel(tiny_model_dir):
    """flex_attention: the worker loads the packed flex attention (dynamic-shape compile on GPUs; here the CPU
    forward reference) and scores like plain rows, with the tree and with rows (both take a BlockMask)."""
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = TrainerConfig(model_path=str(tiny_model_dir), packing="tree", attn_implementation="flex_attention",
                        ckpt_dir=str(tiny_model_dir / "c"))
    cfg.fsdp.mixed_precision = False
    worker = PolicyWorker(cfg, trainable=False)
    assert worker.model.config._attn_implementation == "skyrl_packed_flex"
    batch = _toy_batch()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected, _ = forward_logprobs(plain, pack_micro_batch(batch, [0, 1, 2, 3]))
    torch.testing.assert_close(torch.tensor(sum(worker.compute_logprobs(batch), [])), expected, rtol=1e-5, atol=1e-5)
    assert worker.set_packing("rows") == "tree"
    torch.testing.assert_close(torch.tensor(sum(worker.compute_logprobs(batch), [])), expected, rtol=1e-5, atol=1e-5)
