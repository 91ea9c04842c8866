"""Rollout metrics: what a researcher looks at to see whether rollouts cost what they should."""

from __future__ import annotations

from collections import Counter

from skyrl_stepwise.generator.output import GeneratorOutput


def batch_padded_seq_len(output: GeneratorOutput) -> int:
    """Sequence length of the batch as a left-padded prompt + right-padded response tensor would have it."""
    if len(output) == 0:
        return 0
    return max(map(len, output.prompt_token_ids)) + max(map(len, output.response_ids))


def sample_metrics(output: GeneratorOutput) -> dict[str, float]:
    """Token and padding figures of a set of samples (step-wise, merged or whole-trajectory)."""
    lengths = [len(p) + len(r) for p, r in zip(output.prompt_token_ids, output.response_ids)]
    if not lengths:
        return {"generate/num_samples": 0}
    padded = batch_padded_seq_len(output)
    metrics = {
        "generate/num_samples": len(lengths),
        "generate/tokens_per_sample_min": min(lengths),
        "generate/tokens_per_sample_mean": sum(lengths) / len(lengths),
        "generate/tokens_per_sample_max": max(lengths),
        "generate/real_tokens": sum(lengths),
        "generate/batch_padded_seq_len": padded,
        "generate/padded_tokens": padded * len(lengths),
        "generate/response_tokens_trained": sum(sum(m) for m in output.loss_masks),
    }
    if output.stop_reasons:
        for reason, count in Counter(output.stop_reasons).items():
            metrics[f"generate/stop_reason/{reason}"] = count
    return metrics
