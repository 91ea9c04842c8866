"""From samples to model inputs: prompt-grouped mini-batches, rank shards, and packed micro-batches.

Mini-batches are cut by prompt (instance_id), so the number of optimizer steps per batch is fixed by the
number of prompts, not by how many turns the agent took. Inside a mini-batch, samples are packed
(prompt + response concatenated) into rows of at most `micro_batch_tokens` tokens, with position_ids
restarting at 0 for every sample. Every row carries `subtree_end` (the end of each token's sample), from which
policy/packing/ builds the explicit masks that keep samples apart (block-diagonal, with each layer type's sliding
window): transformers' own packed-sequence detection from position ids is not relied on, since some models build
their masks without position ids (gpt-oss) and a prepared mask replaces every window. Models whose layers carry a
state along the row get one sample per row. `forward_logprobs` always passes use_cache=False (with the cache on,
transformers attends across samples).

With `trainer.packing=tree` (policy/tree.py) a micro-batch is instead one prefix trie of its samples: every
distinct prefix forwarded once, an explicit ancestor mask, and per-sample logprob copies, so the worker's loss
code sees the same flat per-sample tensors either way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from skyrl_stepwise.generator.output import GeneratorOutput
from skyrl_stepwise.inference.truncation import truncation_keep_mask
from skyrl_stepwise.policy.packing import AttentionLayout, attention_layout, row_model_inputs


@dataclass
class TrainBatch:
    """Per-sample token lists for the worker; every per-token list is parallel to response_ids.

    old_logprobs=None means on-policy (the update's own detached logprobs are used, ratio = 1);
    ref_logprobs/rollout_logprobs are needed only when the KL loss / TIS are on. loss_weights=None weighs every
    loss-masked token 1 (token_mean); `trajectory_mean` gives each token 1 / its trajectory's loss tokens.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_masks: list[list[int]]
    instance_ids: list[str]
    advantages: list[list[float]] | None = None
    old_logprobs: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    rollout_logprobs: list[list[float]] | None = None
    loss_weights: list[list[float]] | None = None

    @classmethod
    def from_output(cls, output: GeneratorOutput, advantages: list[list[float]] | None = None,
                    old_logprobs: list[list[float]] | None = None,
                    ref_logprobs: list[list[float]] | None = None,
                    loss_weights: list[list[float]] | None = None) -> TrainBatch:
        """Take the generator's samples as they are; advantages/logprobs come from the trainer's own passes."""
        output.validate()
        if output.trajectory_ids is None:
            raise ValueError("TrainBatch.from_output needs GeneratorOutput.trajectory_ids (got None): "
                             "mini-batches are grouped by instance_id")
        batch = cls(prompt_ids=output.prompt_token_ids, response_ids=output.response_ids,
                    loss_masks=output.loss_masks, instance_ids=[t.instance_id for t in output.trajectory_ids],
                    advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                    rollout_logprobs=output.rollout_logprobs, loss_weights=loss_weights)
        batch.validate()
        return batch

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def validate(self) -> None:
        """Name the field and sample whose lengths disagree; a silent misalignment trains on wrong tokens."""
        n = len(self)
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and len(value) != n:
                raise ValueError(f"TrainBatch.{f.name} has {len(value)} entries, prompt_ids has {n}")
        for i in range(n):
            if not self.prompt_ids[i]:
                raise ValueError(f"TrainBatch sample {i} has an empty prompt: the first response token needs a "
                                 f"token before it to be predicted from")
            r = len(self.response_ids[i])
            for name in ("loss_masks", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs",
                         "loss_weights"):
                value = getattr(self, name)
                if value is not None and len(value[i]) != r:
                    raise ValueError(f"TrainBatch sample {i}: {r} response ids but {len(value[i])} {name}")

    @classmethod
    def concat(cls, batches: list[TrainBatch]) -> TrainBatch:
        """One batch of all these samples in order; an optional field is kept only if every batch has it."""
        if not batches:
            raise ValueError("TrainBatch.concat needs at least one batch")
        merged = {}
        for f in fields(cls):
            values = [getattr(b, f.name) for b in batches]
            merged[f.name] = None if any(v is None for v in values) else [x for v in values for x in v]
        return cls(**merged)

    def select(self, indices: list[int]) -> TrainBatch:
        """The sub-batch of these samples, in this order (for mini-batches and rank shards)."""
        return TrainBatch(**{f.name: None if getattr(self, f.name) is None
                             else [getattr(self, f.name)[i] for i in indices] for f in fields(self)})

    def seq_lens(self) -> list[int]:
        """Packed length of each sample: prompt + response."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    def num_loss_tokens(self) -> int:
        """Loss-masked tokens: the denominator of the token-mean loss."""
        return sum(sum(m) for m in self.loss_masks)

    def loss_denominator(self) -> float:
        """The weighted token count the summed per-token losses are divided by: the loss-masked tokens
        (token_mean), or with trajectory weights the number of trajectories that have any (trajectory_mean)."""
        if self.loss_weights is None:
            return float(self.num_loss_tokens())
        return sum(m * w for mask, weights in zip(self.loss_masks, self.loss_weights) for m, w in zip(mask, weights))


def prompt_mini_batches(instance_ids: list[str], prompts_per_mini_batch: int) -> list[list[int]]:
    """Sample indices of each mini-batch: `prompts_per_mini_batch` whole prompt groups, in first-seen order.

    All samples of a prompt (every step of every repetition) land in the same mini-batch, so the
    optimizer step count depends only on the number of prompts.
    """
    if prompts_per_mini_batch <= 0:
        raise ValueError(f"trainer.policy_mini_batch_size must be > 0, got {prompts_per_mini_batch}")
    groups: dict[str, list[int]] = {}
    for i, iid in enumerate(instance_ids):
        groups.setdefault(iid, []).append(i)
    order = list(groups.values())
    return [[i for g in order[k:k + prompts_per_mini_batch] for i in g]
            for k in range(0, len(order), prompts_per_mini_batch)]


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Split indices into `parts` lists of near-equal token totals (greedy, longest first; deterministic).

    Used to shard a mini-batch over ranks; every rank computes the same split from the same batch.
    """
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(parts), key=lambda k: (loads[k], k))
        out[k].append(i)
        loads[k] += lengths[i]
    return [sorted(p) for p in out]


def pack_indices(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bins of at most `max_tokens` tokens; a longer sample gets a bin of its own."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for k, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[k].append(i)
                loads[k] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


@dataclass
class PackedMicroBatch:
    """One packed row plus flat per-response-token tensors, in sample order.

    Logits at `logit_index[j]` predict `targets[j]`; `response_lens` splits the flat tensors back per sample.
    Token q attends to token k iff k <= q < subtree_end[k] (and within the layer's window): for rows, subtree_end[k]
    is the end of k's sample; for a tree row (packing=tree) the row is a trie in preorder, subtree_end[k] the end of
    k's subtree, and `logit_index` may repeat a node (one logprob copy per sample).
    """

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logit_index: torch.Tensor  # [R]
    targets: torch.Tensor  # [R]
    sample_indices: list[int]
    response_lens: list[int]
    loss_mask: torch.Tensor  # [R] float
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None
    subtree_end: torch.Tensor | None = None  # [T]

    @property
    def num_tokens(self) -> int:
        """Row length: what this micro-batch costs the model."""
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        """Move every tensor, keep the bookkeeping."""
        return PackedMicroBatch(**{f.name: v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor)
                                   else v for f in fields(self)})

    def split(self, flat: torch.Tensor) -> list[list[float]]:
        """Per-sample lists from a flat [R] tensor."""
        return [t.tolist() for t in flat.detach().float().cpu().split(self.response_lens)]


def _flat_fields(batch: TrainBatch, indices: list[int]) -> dict[str, torch.Tensor | None]:
    """The per-response-token fields of these samples, concatenated in sample order."""
    def flat(name: str) -> torch.Tensor | None:
        value = getattr(batch, name)
        return None if value is None else torch.tensor([x for i in indices for x in value[i]], dtype=torch.float32)

    return {"loss_mask": flat("loss_masks"), **{name: flat(name) for name in (
        "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "loss_weights")}}


def pack_tree_micro_batch(batch: TrainBatch, indices: list[int]) -> PackedMicroBatch:
    """These samples as one prefix-trie row (packing=tree): each distinct prefix once, position ids = depths.

    Response token j of a sample is predicted from the node of the token before it, so each sample gathers its
    own logprobs (a node shared by several samples' prefixes is gathered once per sample that trains it).
    """
    from skyrl_stepwise.policy.tree import build_trie

    seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in indices]
    trie = build_trie(seqs)
    logit_index: list[int] = []
    targets: list[int] = []
    for i, nodes in zip(indices, trie.sample_nodes):
        p, resp = len(batch.prompt_ids[i]), batch.response_ids[i]
        logit_index += nodes[p - 1:p - 1 + len(resp)]
        targets += resp
    ids, pos, end = (trie.tokens, trie.depths, trie.subtree_end) if len(trie) else ([0], [0], [1])
    return PackedMicroBatch(
        input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
        logit_index=torch.tensor(logit_index, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
        sample_indices=list(indices), response_lens=[len(batch.response_ids[i]) for i in indices],
        subtree_end=torch.tensor(end, dtype=torch.long), **_flat_fields(batch, indices))


def pack_micro_batch(batch: TrainBatch, indices: list[int], packing: str = "rows") -> PackedMicroBatch:
    """Concatenate these samples into one row; an empty `indices` gives a 1-token row with nothing to train.

    The empty row exists because FSDP ranks must run the same number of forward/backward passes: a rank
    with fewer micro-batches runs empty ones. `packing="tree"` builds a prefix-trie row instead.
    """
    if packing == "tree":
        return pack_tree_micro_batch(batch, indices)
    if packing != "rows":
        raise ValueError(f"trainer.packing: {packing!r} is not one of ('rows', 'tree')")
    ids: list[int] = []
    pos: list[int] = []
    end: list[int] = []
    logit_index: list[int] = []
    targets: list[int] = []
    for i in indices:
        prompt, resp = batch.prompt_ids[i], batch.response_ids[i]
        start = len(ids) + len(prompt)
        logit_index += range(start - 1, start - 1 + len(resp))
        targets += resp
        ids += prompt + resp
        pos += range(len(prompt) + len(resp))
        end += [len(ids)] * (len(prompt) + len(resp))
    if not ids:
        ids, pos, end = [0], [0], [1]
    return PackedMicroBatch(
        input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
        logit_index=torch.tensor(logit_index, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
        sample_indices=list(indices), response_lens=[len(batch.response_ids[i]) for i in indices],
        subtree_end=torch.tensor(end, dtype=torch.long), **_flat_fields(batch, indices))


def _sequences(batch: TrainBatch) -> list[list[int]]:
    return [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]


def rank_micro_batches(batch: TrainBatch, rank: int, world_size: int, max_tokens: int,
                       packing: str = "rows", one_sample_per_row: bool = False) -> list[list[int]]:
    """This rank's micro-batches (batch indices): a token-balanced rank shard, packed by token budget.

    packing=tree shards and packs whole prompt groups (trie units, policy/tree.py) priced by their distinct
    prefixes, so a group's shared tokens are forwarded once, on one rank, in one micro-batch.
    `one_sample_per_row` (architectures whose layers carry a state along the row) gives every sample its own row.
    """
    if one_sample_per_row:
        if packing == "tree":
            raise ValueError("trainer.packing=tree cannot hold one sample per row")
        return [[i] for i in balanced_partition(batch.seq_lens(), world_size)[rank]]
    if packing == "tree":
        from skyrl_stepwise.policy.tree import pack_units, tree_units, unique_tokens

        seqs = _sequences(batch)
        units, _ = tree_units(seqs, batch.instance_ids, max_tokens)
        shard = balanced_partition([unique_tokens([seqs[i] for i in u]) for u in units], world_size)[rank]
        mine = [units[u] for u in shard]
        return [sorted(i for u in b for i in mine[u]) for b in pack_units(seqs, mine, max_tokens)]
    lens = batch.seq_lens()
    shard = balanced_partition(lens, world_size)[rank]
    return [[shard[j] for j in b] for b in pack_indices([lens[i] for i in shard], max_tokens)]


def packing_stats(batch: TrainBatch, micro_batches: list[list[int]], packing: str = "rows",
                  max_tokens: int | None = None) -> dict[str, float]:
    """Packing efficiency vs a padded batch (prompts left-padded, responses right-padded), for logging.

    pad_ratio = tokens run through the model / real tokens (1.0 means no padding at all);
    padded_batch_pad_ratio is what a left-padded [n, batch_padded_seq_len] batch would cost instead.
    forward_tokens = tokens run through the model (rows: packed row lengths; tree: trie nodes per row);
    unique_tokens = distinct prefixes of the whole batch (the least any packing on one rank can forward);
    compression_ratio = real_tokens / forward_tokens (1.0 for rows; what tree packing saves).
    """
    from skyrl_stepwise.policy.tree import tree_units, unique_tokens

    lens = batch.seq_lens()
    real = sum(lens)
    packed = sum(max(1, sum(lens[i] for i in mb)) for mb in micro_batches)
    seqs = _sequences(batch)
    forward = packed if packing == "rows" else sum(max(1, unique_tokens([seqs[i] for i in mb]))
                                                   for mb in micro_batches)
    padded_len = (max(map(len, batch.prompt_ids), default=0) + max(map(len, batch.response_ids), default=0))
    stats = {
        "train/real_tokens": real,
        "train/packed_tokens": packed,
        "train/forward_tokens": forward,
        "train/unique_tokens": unique_tokens(seqs),
        "train/compression_ratio": real / max(forward, 1),
        "train/num_micro_batches": len(micro_batches),
        "train/pad_ratio": packed / max(real, 1),
        "train/batch_padded_seq_len": padded_len,
        "train/padded_batch_tokens": padded_len * len(batch),
        "train/padded_batch_pad_ratio": padded_len * len(batch) / max(real, 1),
    }
    if packing == "tree" and max_tokens is not None:  # a group too big for one row loses some sharing: count it
        stats["train/tree_split_groups"] = tree_units(seqs, batch.instance_ids, max_tokens)[1]
    return stats


class _TargetLogprob(torch.autograd.Function):
    """log_softmax(truncate(logits / T))[target] in fp32, chunk by chunk, saving only the logits and the [R]
    logsumexp.

    Plain autograd would keep every chunk's fp32 copy of the logits for backward (the full [R, V] in fp32);
    backward recomputes each chunk's softmax instead: d logp / d logits = (onehot(target) - softmax) / T.
    With top-k / top-p the distribution is the sampler's truncated one (inference/truncation.py), recomputed
    in backward from the same logits; the target is always kept, so a token the engine drew and the trainer's
    slightly different logits would have cut scores finitely instead of -inf.
    """

    @staticmethod
    def _scaled(logits, targets, temperature, top_k, top_p):
        x = logits.float() / temperature
        keep = truncation_keep_mask(x, top_k, top_p)
        if keep is not None:
            keep.scatter_(-1, targets[:, None], True)
            x = x.masked_fill(~keep, float("-inf"))
        return x

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk_rows, top_k, top_p):
        logps, lses, ents = [], [], []
        for s in range(0, logits.shape[0], chunk_rows):
            x = _TargetLogprob._scaled(logits[s:s + chunk_rows], targets[s:s + chunk_rows], temperature, top_k, top_p)
            lse = torch.logsumexp(x, dim=-1)
            logps.append(x.gather(-1, targets[s:s + chunk_rows, None]).squeeze(-1) - lse)
            lses.append(lse)
            if with_entropy:
                p = torch.softmax(x, dim=-1)
                ents.append(lse - (p * x.masked_fill(p == 0, 0.0)).sum(-1))

        def cat(xs):  # an empty row still gets its own [0] tensors: a graph to backward through
            return torch.cat(xs) if xs else logits.new_zeros(0, dtype=torch.float32)

        ctx.save_for_backward(logits, targets, cat(lses))
        ctx.temperature, ctx.chunk_rows, ctx.top_k, ctx.top_p = temperature, chunk_rows, top_k, top_p
        ent = cat(ents)
        ctx.mark_non_differentiable(ent)
        return cat(logps), ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, _grad_ent):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        t, n = ctx.temperature, ctx.chunk_rows
        for s in range(0, logits.shape[0], n):
            x = _TargetLogprob._scaled(logits[s:s + n], targets[s:s + n], t, ctx.top_k, ctx.top_p)
            d = (x - lse[s:s + n, None]).exp()  # softmax (0 where truncated)
            d.scatter_add_(-1, targets[s:s + n, None], d.new_full((d.shape[0], 1), -1.0))  # softmax - onehot
            grad[s:s + n] = d.mul_(grad_logp[s:s + n, None] / -t)
        return grad, None, None, None, None, None, None


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_rows: int = 1024, top_k: int = -1, top_p: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target under [R, V] logits (fp32), optionally the entropy (no grad).

    The distribution is the sampler's: logits / temperature, truncated by top_k / top_p exactly as the
    engines truncate before drawing (their logprobs are of that distribution), so on-policy TIS weights are 1.
    logsumexp + gather per chunk of rows instead of a full log_softmax, in a custom autograd function: only
    [chunk, V] fp32 temporaries exist at once, in forward and in backward, and only the logits themselves
    (in their own dtype) and an [R] logsumexp are kept for backward. Entropy is a metric: no gradient.
    An empty row still returns a graph-connected [0] tensor, so a rank with no response token can backward.
    """
    logp, ent = _TargetLogprob.apply(logits, targets, float(temperature), with_entropy, chunk_rows,
                                     int(top_k), float(top_p))
    return logp, ent if with_entropy else None


def forward_logprobs(model: torch.nn.Module, mb: PackedMicroBatch, temperature: float = 1.0,
                     with_entropy: bool = False, top_k: int = -1, top_p: float = 1.0,
                     layout: AttentionLayout | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one packed row and return the logprobs (and entropy) of its response tokens, flat [R].

    The row's samples are kept apart by the masks policy/packing/ builds for this model's layout (read from the
    model when not given). Only the R positions that predict response tokens go through the LM head
    (logits_to_keep), so the [T, V] logits of prompt and observation positions are never built.
    """
    layout = layout or attention_layout(model)
    inputs = row_model_inputs(mb.input_ids, mb.position_ids, mb.subtree_end, layout)
    out = model(**inputs, use_cache=False, logits_to_keep=mb.logit_index)
    return gather_logprobs(out.logits[0], mb.targets, temperature, with_entropy, top_k=top_k, top_p=top_p)
