"""Sample builders for each training mode, from one set of step-wise rollouts, and what each costs.

Replaying the *same* rollouts through every builder makes cost differences due to the mode alone.
With exact history a trajectory is one token chain, so `trajectory` (one sample per trajectory,
observations masked) and `step_wise_merged` build identical samples; a template fallback or
re-tokenization drift breaks the chain and both then yield one sample per chain.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.metrics import batch_padded_seq_len
from skyrl_stepwise.generator.output import GeneratorOutput

MODES = ("trajectory", "step_wise", "step_wise_merged")


def build_samples(stepwise: GeneratorOutput, mode: str) -> GeneratorOutput:
    """The training samples a mode would use for these rollouts."""
    if mode == "step_wise":
        return stepwise
    if mode in ("step_wise_merged", "trajectory"):
        return merge_stepwise_output(stepwise)
    raise ValueError(f"ablation mode {mode!r} is not one of {MODES}")


@dataclass
class SampleCost:
    """Token accounting of one batch of samples: what the trainer's forward pass pays for."""

    samples: int
    forward_tokens: int  # sum of prompt+response over samples: tokens a packed forward runs
    trained_tokens: int  # loss-masked response tokens
    batch_padded_seq_len: int
    padded_tokens: int  # what a left/right padded [samples, batch_padded_seq_len] batch runs

    @classmethod
    def of(cls, output: GeneratorOutput) -> SampleCost:
        padded = batch_padded_seq_len(output)
        return cls(samples=len(output),
                   forward_tokens=sum(len(p) + len(r) for p, r in zip(output.prompt_token_ids, output.response_ids)),
                   trained_tokens=sum(sum(m) for m in output.loss_masks),
                   batch_padded_seq_len=padded, padded_tokens=padded * len(output))


def trajectory_lengths(stepwise: GeneratorOutput) -> list[int]:
    """Length of each trajectory's full token sequence: its last step's prompt + response."""
    return [len(p) + len(r) for p, r, last in
            zip(stepwise.prompt_token_ids, stepwise.response_ids, stepwise.is_last_step) if last]
