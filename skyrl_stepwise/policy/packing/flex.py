"""flex_attention for packed rows (GPU): a BlockMask built from the row's subtree ends, depths and window.

A BlockMask skips fully masked 128 x 128 blocks, so a long row of many samples (or a trie whose branches are blocks
of their own) costs what its visible blocks cost, without a dense T x T mask. The attention function is registered
with transformers under its own name and compiled once with dynamic=True (a new padded length would otherwise
recompile: seconds each).
"""

from __future__ import annotations

import torch

FLEX_BLOCK = 128  # flex_attention's block size: rows are padded to a multiple of it
PACKED_FLEX_ATTENTION = "skyrl_packed_flex"
_COMPILED_FLEX = None


def flex_block_mask(subtree_end: torch.Tensor, depths: torch.Tensor, window: int | None = None):
    """The BlockMask of `k <= q < subtree_end[k]` (and `depth[q] - depth[k] < window`) for a padded row.

    The row must already be padded to a multiple of FLEX_BLOCK (pad nodes end their own subtree: they attend to
    themselves only, and no real node attends to them). Built outside inference_mode: a mask made under it could
    not be saved for backward. On CUDA the block mask is computed by a compiled kernel without a dense [T, T].
    """
    from torch.nn.attention.flex_attention import create_block_mask

    end, depth = subtree_end, depths

    def mask_mod(b, h, q, k):
        inside = (k <= q) & (q < end[k])
        return inside if window is None else inside & (depth[q] - depth[k] < window)

    t = end.shape[0]
    with torch.inference_mode(False):
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device=end.device,
                                 BLOCK_SIZE=FLEX_BLOCK, _compile=end.device.type == "cuda")


def pad_for_flex(input_ids: torch.Tensor, position_ids: torch.Tensor, subtree_end: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a row to a multiple of FLEX_BLOCK with isolated nodes (token 0, position 0, own subtree only),
    so flex_attention compiles for few distinct lengths; logit_index never points at them."""
    t = input_ids.shape[1]
    pad = -t % FLEX_BLOCK
    if not pad:
        return input_ids, position_ids, subtree_end
    new = torch.arange(t, t + pad, device=subtree_end.device)
    return (torch.cat([input_ids, input_ids.new_zeros(1, pad)], 1),
            torch.cat([position_ids, position_ids.new_zeros(1, pad)], 1), torch.cat([subtree_end, new + 1]))


def _packed_flex_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """A transformers attention function: flex_attention with the row's BlockMask (compiled on CUDA).

    Attention sinks (gpt-oss's `s_aux`) have no flex form here: refused rather than silently dropped.
    """
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if kwargs.get("s_aux") is not None:
        raise ValueError("trainer.attn_implementation=flex_attention does not apply attention sinks (this model has "
                         "them): use eager")
    if attention_mask is None:  # a single-sample row of a state-carrying model: plain causal attention
        if getattr(module, "sliding_window", None):
            raise ValueError(f"{type(module).__name__} has a sliding window but got no BlockMask: use sdpa or eager")
        from torch.nn.attention.flex_attention import create_block_mask

        t = query.shape[2]
        with torch.inference_mode(False):
            attention_mask = create_block_mask(lambda b, h, q, k: k <= q, B=None, H=None, Q_LEN=t, KV_LEN=t,
                                               device=query.device, _compile=query.device.type == "cuda")
    if not hasattr(attention_mask, "mask_mod"):
        raise ValueError(f"the packed flex attention needs a BlockMask, got {type(attention_mask).__name__}")
    if query.device.type == "cuda" and _COMPILED_FLEX is None:
        # unsloth raises the recompile limit too: past it dynamo silently falls back to a wrong-result path
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    fn = _COMPILED_FLEX if query.device.type == "cuda" else flex_attention  # CPU: forward-only reference path
    if kwargs.get("softcap") is not None:  # refused at start-up (packing/layout.py); never silently dropped
        raise ValueError("the packed flex attention does not apply attention logit soft-capping: use eager")
    out = fn(query, key, value, block_mask=attention_mask, scale=scaling,
             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_packed_flex_attention() -> str:
    """Register the packed flex attention with transformers; returns the attn_implementation name to load with."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_FLEX_ATTENTION, _packed_flex_attention)
    return PACKED_FLEX_ATTENTION
