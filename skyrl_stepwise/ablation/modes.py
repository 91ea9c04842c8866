"""Sample builders for each training mode, from one set of step-wise rollouts, and what each costs.

Replaying the *same* rollouts through every builder makes cost differences due to the mode alone.
With exact history a trajectory is one token chain, so `trajectory` (one sample per trajectory,
observations masked) and `step_wise_merged` build identical samples; a template fallback or
re-tokenization drift breaks the chain and both then yield one sample per chain.
`tree` trains the step-wise samples themselves with trainer.packing=tree (policy/tree.py): the same per-step
samples and loss, every distinct prefix of a prompt group forwarded once.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.metrics import batch_padded_seq_len
from skyrl_stepwise.generator.output import GeneratorOutput

MODES = ("trajectory", "step_wise", "step_wise_merged", "tree")


def build_samples(stepwise: GeneratorOutput, mode: str) -> GeneratorOutput:
    """The training samples a mode would use for these rollouts."""
    if mode in ("step_wise", "tree"):
        return stepwise
    if mode in ("step_wise_merged", "trajectory"):
        return merge_stepwise_output(stepwise)
    raise ValueError(f"ablation mode {mode!r} is not one of {MODES}")


@dataclass
class SampleCost:
    """Token accounting of one batch of samples: what the trainer's forward pass pays for."""

    samples: int
    forward_tokens: int  # tokens a packed forward runs: sum of prompt+response (rows), distinct prefixes (tree)
    trained_tokens: int  # loss-masked response tokens
    batch_padded_seq_len: int
    padded_tokens: int  # what a left/right padded [samples, batch_padded_seq_len] batch runs

    @classmethod
    def of(cls, output: GeneratorOutput, packing: str = "rows") -> SampleCost:
        """`packing="tree"`: the forward runs each distinct prefix of the batch once (one trie, one micro-batch;
        the replay replaces it with what the worker actually forwarded)."""
        from skyrl_stepwise.policy.tree import unique_tokens

        padded = batch_padded_seq_len(output)
        seqs = [p + r for p, r in zip(output.prompt_token_ids, output.response_ids)]
        return cls(samples=len(output),
                   forward_tokens=unique_tokens(seqs) if packing == "tree" else sum(map(len, seqs)),
                   trained_tokens=sum(sum(m) for m in output.loss_masks),
                   batch_padded_seq_len=padded, padded_tokens=padded * len(output))


def packing_of(mode: str) -> str:
    """The trainer.packing a mode trains with: only `tree` packs prefix tries, every other mode plain rows."""
    return "tree" if mode == "tree" else "rows"


def trajectory_lengths(stepwise: GeneratorOutput) -> list[int]:
    """Length of each trajectory's full token sequence: its last step's prompt + response."""
    return [len(p) + len(r) for p, r, last in
            zip(stepwise.prompt_token_ids, stepwise.response_ids, stepwise.is_last_step) if last]


def advantages_all_zero(advantages: list[list[float]] | None, loss_masks: list[list[int]]) -> bool:
    """Whether no trained token carries an advantage: every group's samples scored alike (all right or all
    wrong), so the policy-gradient term is 0 and the update only moves weights through the KL term, if any. Such
    a batch's timing and grad norm compare modes on a no-op update, so the report flags it."""
    if advantages is None:
        return True
    return not any(a != 0 for adv, mask in zip(advantages, loss_masks) for a, m in zip(adv, mask) if m)
