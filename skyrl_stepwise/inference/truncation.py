"""The sampler's top-k / top-p truncation, defined once for the engines and the trainer.

Both engines return the logprob of each token under the distribution it was drawn from: softmax of the
logits after temperature, top-k and top-p (vLLM's `processed_logprobs`). The trainer must score that same
truncated, renormalised distribution, or every importance weight `exp(trainer - rollout)` is the kept
probability mass instead of 1 (0.91 on every token at top_p=0.9). One function keeps the two in step.
"""

from __future__ import annotations

import torch


def truncation_keep_mask(scaled_logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor | None:
    """Which tokens the sampler may draw, over the last dim of logits already divided by the temperature.

    vLLM's order and ties (v1 `apply_top_k_top_p`): top-k keeps every logit >= the k-th largest; top-p then
    drops, in ascending order, the tokens whose cumulative probability stays <= 1 - top_p, always keeping
    the most likely one. None when nothing is truncated (top_k <= 0 and top_p >= 1), so callers skip the work.
    """
    use_k, use_p = top_k > 0, top_p < 1.0
    if not (use_k or use_p):
        return None
    x = scaled_logits.float()
    keep = torch.ones_like(x, dtype=torch.bool)
    if use_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        keep &= x >= kth
    if use_p:
        masked = x.masked_fill(~keep, float("-inf"))
        sorted_x, order = masked.sort(dim=-1)  # ascending
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1] = False  # the most likely token always stays
        keep &= ~torch.zeros_like(keep).scatter(-1, order, drop_sorted)
    return keep


def truncate_logits(scaled_logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Logits with every token the sampler may not draw set to -inf (unchanged when nothing truncates)."""
    keep = truncation_keep_mask(scaled_logits, top_k, top_p)
    return scaled_logits if keep is None else scaled_logits.masked_fill(~keep, float("-inf"))
