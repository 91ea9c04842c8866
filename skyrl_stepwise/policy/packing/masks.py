"""The model inputs of one packed row: the masks that keep its samples apart, in the form each attention takes.

A row (rows packing: samples end to end; tree packing: a prefix trie in preorder) is described by two [T] tensors:
`subtree_end` (token k is visible to queries in [k, subtree_end[k]): the rest of its sample, or its trie subtree)
and the position ids (depths). Query q may attend to key k iff

    k <= q < subtree_end[k]   and, on a sliding-window layer,   depth[q] - depth[k] < window

which is transformers' own causal + `sliding_window_overlay` rule applied per sample. Layer types with different
windows get one mask each, passed as {layer_type: mask} (the mapping transformers' models build for themselves).
A row that is a single chain from position 0 needs no mask at all: the model builds its own, exactly as for a
sample alone, which is also the only exact input for state-carrying layers (flex_attention gets its BlockMask even
then: transformers builds no mask for a registered attention function).
"""

from __future__ import annotations

import torch

from skyrl_stepwise.policy.packing.layout import DENSE_MASK_ATTENTIONS, VARLEN_ATTENTIONS, AttentionLayout


def allowed_mask(subtree_end: torch.Tensor, depths: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[T, T] bool: query q may attend to key k (k is q or an ancestor of q, and within the window)."""
    idx = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    allowed = (idx[None, :] <= idx[:, None]) & (idx[:, None] < subtree_end[None, :])
    if window is not None:
        allowed &= (depths[:, None] - depths[None, :]) < window
    return allowed


def dense_mask(subtree_end: torch.Tensor, depths: torch.Tensor, window: int | None, attn_implementation: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [1, 1, T, T] mask a transformers model takes as-is: bool for sdpa (True = attend), additive for eager.

    Eager *adds* the mask to the scores, so a bool mask there would be a silent 0/1 bias.
    """
    allowed = allowed_mask(subtree_end, depths, window)[None, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"no dense mask for trainer.attn_implementation={attn_implementation!r}; use sdpa, eager or "
                     f"flex_attention")


def is_single_chain(subtree_end: torch.Tensor, position_ids: torch.Tensor) -> bool:
    """True when the row is one sample from position 0: every token sees all earlier ones, nothing to separate."""
    t = subtree_end.shape[0]
    return bool((subtree_end == t).all()) and int(position_ids[0, 0]) == 0


def row_model_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, subtree_end: torch.Tensor,
                     layout: AttentionLayout, mask_dtype: torch.dtype = torch.float32) -> dict:
    """input_ids, position_ids and (unless the row is a single sample) the masks that keep its samples apart."""
    inputs = {"input_ids": input_ids, "position_ids": position_ids}
    attn = layout.attn_implementation
    if is_single_chain(subtree_end, position_ids) and (attn in DENSE_MASK_ATTENTIONS + VARLEN_ATTENTIONS
                                                        or layout.one_sample_per_row):
        return inputs
    if layout.one_sample_per_row:
        raise ValueError(f"a packed row holds several samples, but on {layout.describe()} "
                         f"{layout.why_one_sample_per_row()}: one sample per row is the only exact packing (the "
                         f"scheduler should have done that)")
    if attn in VARLEN_ATTENTIONS:  # varlen kernels take the sample boundaries from the position ids
        if not bool((subtree_end[1:] >= subtree_end[:-1]).all()):  # a branch ends before its parent: a tree
            raise ValueError(f"trainer.attn_implementation={attn} cannot take a prefix-tree row (trainer.packing=tree)")
        return inputs
    depths = position_ids[0]
    if attn in DENSE_MASK_ATTENTIONS:
        def build(window):
            return dense_mask(subtree_end, depths, window, attn, mask_dtype)
    else:  # flex_attention: a BlockMask, the row padded to whole blocks
        from skyrl_stepwise.policy.packing.flex import flex_block_mask, pad_for_flex

        input_ids, position_ids, subtree_end = pad_for_flex(input_ids, position_ids, subtree_end)
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        depths = position_ids[0]

        def build(window):
            return flex_block_mask(subtree_end, depths, window)
    by_window = {w: build(w) for w in dict.fromkeys(layout.windows.values())}
    if layout.per_layer_type_masks:
        inputs["attention_mask"] = {t: by_window[w] for t, w in layout.windows.items()}
    else:
        inputs["attention_mask"] = next(iter(by_window.values()))
    return inputs
