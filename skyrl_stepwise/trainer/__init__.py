"""FSDP2 trainer core for step-wise GRPO: advantages, PPO loss, packing, the policy worker, checkpoints."""

from skyrl_stepwise.trainer.advantages import group_advantages, trajectory_scores
from skyrl_stepwise.trainer.batching import (PackedMicroBatch, TrainBatch, forward_logprobs, gather_logprobs,
                                             pack_indices, pack_micro_batch, packing_stats, prompt_mini_batches)
from skyrl_stepwise.trainer.checkpoint import (find_latest_complete, load_checkpoint, resolve_resume,
                                               save_checkpoint)
from skyrl_stepwise.trainer.config import AlgorithmConfig, FSDPConfig, OptimConfig, TrainerConfig
from skyrl_stepwise.trainer.credit import compute_advantages
from skyrl_stepwise.trainer.fsdp_worker import PolicyWorker, micro_batch_loss
from skyrl_stepwise.trainer.losses import kl_penalty, policy_loss

__all__ = [
    "AlgorithmConfig", "FSDPConfig", "OptimConfig", "PackedMicroBatch", "PolicyWorker", "TrainBatch",
    "TrainerConfig", "compute_advantages", "find_latest_complete", "forward_logprobs", "gather_logprobs",
    "group_advantages", "kl_penalty", "load_checkpoint", "micro_batch_loss", "pack_indices", "pack_micro_batch",
    "packing_stats", "policy_loss", "prompt_mini_batches", "resolve_resume", "save_checkpoint",
    "trajectory_scores",
]
