"""Typed trainer config: plain dataclasses with defaults, so Hydra can use them as structured configs.

Key names follow SkyRL / verl (`algorithm.eps_clip_low`, `kl_loss_coef`, `policy_mini_batch_size`, ...).
Every `validate` names the full key path of the bad value, e.g. `trainer.algorithm.advantage_estimator`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from skyrl_stepwise.algorithms.config import (ADVANTAGE_ESTIMATORS, KL_LOSS_TYPES, LOSS_REDUCTIONS,  # noqa: F401
                                              STEP_ADVANTAGES, AlgorithmConfig)

SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
PACKINGS = ("auto", "rows", "tree")


@dataclass
class DivergenceConfig:
    """When a step counts as diverged (`null` turns one check off; `enabled=false` all of them)."""

    enabled: bool = True  # a diverged step stops the run, naming the check; false: no check at all
    # Steps whose median is the start value. 3: one noisy first batch does not define "normal"; small enough that
    # the 6-step tiny SFT recipe is judged on most of its steps.
    baseline_steps: int = 3
    # Grad norm (before clipping) past this multiple of its start. Healthy runs stay within a few x of their
    # start (the norm falls as the loss does; RL batches vary it by ~2-5x with the share of tokens that carry an
    # advantage); the Gemma divergence was ~100x. 20 leaves room for RL noise and catches that in one step.
    grad_norm_factor: float | None = 20.0
    # ... and only when the norm is also above this absolute value: a start near 0 (an RL batch whose advantages
    # are mostly 0) makes any ordinary later norm a large multiple of it. max_grad_norm is 1: a norm of 10 is
    # already clipped 10x, i.e. the gradient is no longer the one the loss describes.
    grad_norm_floor: float = 10.0
    # Grad norm (before clipping) past this absolute value, at any step, the first included: the relative check
    # has no sane start when step 1 is already wild. max_grad_norm is 1, so a norm of 1000 is clipped 1000x;
    # healthy SFT on Gemma 3 270M started at 48, the base model meeting a terminator it never produced at 487;
    # a step past 1000 is no longer a gradient the loss describes.
    grad_norm_max: float | None = 1000.0
    # Token-mean entropy (nats) rising more than this above its start. RL and SFT drift it by tenths of a nat over
    # many steps (RL usually lowers it); a jump of 2 nats is a distribution ~7x flatter per token (Gemma: +4.2).
    # Only a rise is judged: a falling entropy is what training towards demonstrations or rewards does.
    entropy_rise_nats: float | None = 2.0
    # SFT only (RL's policy loss changes sign with the advantages, so it has no scale to compare with): the
    # cross-entropy past this multiple of its start. SFT lowers its loss; a loss 3x its start means the model
    # forgot the language, not that a batch was hard (per-batch spread on the embedded demonstrations is < 1.5x).
    loss_factor: float | None = 3.0

    def validate(self, prefix: str) -> None:
        """Name the key of the first impossible value."""
        if self.baseline_steps < 1:
            raise ValueError(f"{prefix}.baseline_steps must be >= 1, got {self.baseline_steps}")
        for key in ("grad_norm_factor", "loss_factor"):
            value = getattr(self, key)
            if value is not None and value <= 1:
                raise ValueError(f"{prefix}.{key} must be > 1 (or null: off), got {value}")
        if self.entropy_rise_nats is not None and self.entropy_rise_nats <= 0:
            raise ValueError(f"{prefix}.entropy_rise_nats must be > 0 (or null: off), got {self.entropy_rise_nats}")
        if self.grad_norm_max is not None and self.grad_norm_max <= 0:
            raise ValueError(f"{prefix}.grad_norm_max must be > 0 (or null: off), got {self.grad_norm_max}")
        if self.grad_norm_floor < 0:
            raise ValueError(f"{prefix}.grad_norm_floor must be >= 0, got {self.grad_norm_floor}")


@dataclass
class OptimConfig:
    """AdamW + a transformers LR schedule; defaults are the Search-R1 GRPO recipe's."""

    lr: float = 1e-6  # the RL update's peak learning rate (full weights; the LoRA adapter's: trainer.lora.lr)
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's moment decays
    eps: float = 1e-8  # AdamW's epsilon
    max_grad_norm: float = 1.0  # the gradient's global norm is clipped to this before each optimizer step
    num_warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    scheduler: str = "constant_with_warmup"  # constant | constant_with_warmup | linear | cosine
    # Only schedules that decay need it (linear, cosine); -1 = unknown.
    num_training_steps: int = -1

    def validate(self, prefix: str = "trainer.optim") -> None:
        """Catch typos and impossible values before a model is loaded."""
        if self.lr <= 0:
            raise ValueError(f"{prefix}.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"{prefix}.betas must be two values in [0, 1), got {list(self.betas)}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"{prefix}.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.num_warmup_steps < 0:
            raise ValueError(f"{prefix}.num_warmup_steps must be >= 0, got {self.num_warmup_steps}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"{prefix}.scheduler: {self.scheduler!r} is not one of {SCHEDULERS}")
        if self.scheduler in ("linear", "cosine") and self.num_training_steps <= 0:
            raise ValueError(f"{prefix}.num_training_steps must be > 0 for scheduler {self.scheduler!r}, "
                             f"got {self.num_training_steps}")


@dataclass
class FSDPConfig:
    """FSDP2 sharding; the backend follows the hardware (nccl on GPU, gloo on CPU) unless forced."""

    world_size: int = 1  # policy ranks (processes) the weights are sharded over
    backend: str = "auto"  # auto | nccl | gloo
    # bf16 compute with fp32 master weights and fp32 gradient reduction, where the hardware has bf16.
    mixed_precision: bool = True
    gradient_checkpointing: bool = False  # recompute activations in the backward: less memory, one more forward
    # free the gathered full layer after its forward (gathered again for the backward): less memory, more traffic
    reshard_after_forward: bool = True
    # keep the gathered layers and their (fp32) gradients whole through all of a step's micro-batches: one gather
    # and one gradient reduction per step instead of one per micro-batch. The same gradients, summed in the same
    # order; costs each rank the whole model's params and gradients in memory. SmolLM2 on one CPU rank: an update
    # 5.5% faster in bf16 mixed precision, no resolved change in fp32 (benchmarks/update_accumulation.py).
    accumulate_unsharded: bool = False
    # CPU threads of each rank (torch and OpenMP). None -> the node's cores shared evenly by its ranks; Ray
    # would otherwise give a rank that reserves no CPU a single OpenMP thread.
    num_threads_per_rank: int | None = None
    # GPU, colocated with engines: move weights, gradients, AdamW state (and the reference) to host memory while the
    # engines generate, and back for the update. A no-op on CPU. Unverified on GPUs so far: off by default.
    offload_during_rollout: bool = False
    # How long a collective waits for the other ranks before it raises (a rank stopped but not dead: SIGSTOP, a
    # deadlock, a network partition). None: torch's default (30 min on gloo, 10 min on NCCL).
    collective_timeout_s: float | None = None

    def validate(self, prefix: str = "trainer.fsdp") -> None:
        """World size and backend are the usual sources of a hang at start-up; check them first."""
        if self.collective_timeout_s is not None and self.collective_timeout_s <= 0:
            raise ValueError(f"{prefix}.collective_timeout_s must be > 0 (or null: torch's default), got "
                             f"{self.collective_timeout_s}")
        if self.world_size < 1:
            raise ValueError(f"{prefix}.world_size must be >= 1, got {self.world_size}")
        if self.num_threads_per_rank is not None and self.num_threads_per_rank < 1:
            raise ValueError(f"{prefix}.num_threads_per_rank must be >= 1 (or null), got {self.num_threads_per_rank}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"{prefix}.backend must be auto, nccl or gloo, got {self.backend!r}")

    def threads_per_rank(self, cores: int | None = None) -> int:
        """Each rank's thread budget: configured, else this node's cores split over the ranks (at least 1)."""
        return self.num_threads_per_rank or max(1, (cores or os.cpu_count() or 1) // self.world_size)


LORA_SYNCS = ("merged", "adapter")
# LoRA's learning rate over full fine-tuning's when trainer.lora.lr is null (published practice: LoRA's optimum
# lr is about 10x full fine-tuning's; Schulman et al. 2025, "LoRA Without Regret"; Biderman et al. 2024).
LORA_LR_SCALE = 10.0


@dataclass
class LoRAConfig:
    """LoRA on the policy (policy/lora.py, on peft): only the adapter trains and holds optimizer state; the KL
    reference is the base with the adapter disabled. `sync`: what the engines receive at every sync, the merged full
    weights (merged) or the adapter alone, loaded by version (adapter; docs/lora.md)."""

    # train a LoRA adapter instead of every weight (trainer.lora.*; sft.lora: the warm start; docs/lora.md)
    enabled: bool = False
    rank: int = 8  # r
    alpha: float = 16.0  # the update is scaled by alpha / rank
    # Module names (or name suffixes, as in peft) of the linear layers inside the decoder layers to adapt;
    # "all-linear": every one of them (the attention and MLP projections; never the embeddings or the LM head).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # The engines never apply dropout (policy/dropout.py): non-zero needs trainer.keep_dropout=true.
    dropout: float = 0.0
    # merged: every sync sends W + alpha/rank x B @ A under the base's names (engines unchanged). adapter: only the
    # adapter (peft format, megabytes); the engines serve LoRA, each policy version as its own adapter.
    sync: str = "merged"
    # The adapter's learning rate. null: LORA_LR_SCALE (10) x the full-weight lr (trainer.optim.lr in RL, SFT's
    # chosen lr in the warm start): LoRA's optimum sits near 10x full fine-tuning's, and at the full-weight lr an
    # adapter barely moves (issue 59: a LoRA SFT at 5e-5 left the eval at 0). A number: exactly that lr.
    lr: float | None = None

    def optimizer_lr(self, full_lr: float) -> float:
        """The lr the adapter's AdamW uses, given the full-weight lr of the same phase (see `lr`)."""
        return self.lr if self.lr is not None else LORA_LR_SCALE * full_lr

    def describe_lr(self, full_lr: float, full_key: str = "trainer.optim.lr", own_key: str = "trainer.lora.lr") -> str:
        """The adapter's lr and where it came from, for the console."""
        if self.lr is not None:
            return f"lr {self.lr:g} ({own_key})"
        return f"lr {self.optimizer_lr(full_lr):g} ({LORA_LR_SCALE:g} x {full_key}={full_lr:g}; {own_key} sets it)"

    def validate(self, prefix: str = "trainer.lora", keep_dropout: bool = False) -> None:
        """Rank, alpha and dropout before a model is loaded (target modules are checked against the model)."""
        if self.rank < 1:
            raise ValueError(f"{prefix}.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"{prefix}.alpha must be > 0, got {self.alpha}")
        if not self.target_modules:
            raise ValueError(f"{prefix}.target_modules is empty: name modules, or [all-linear]")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{prefix}.dropout must be in [0, 1), got {self.dropout}")
        if self.sync not in LORA_SYNCS:
            raise ValueError(f"{prefix}.sync must be one of {list(LORA_SYNCS)}, got {self.sync!r}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"{prefix}.lr must be > 0 (or null: {LORA_LR_SCALE:g} x the full-weight lr), got {self.lr}")
        if self.dropout > 0 and not keep_dropout:
            raise ValueError(f"{prefix}.dropout={self.dropout} but the engines sample without dropout, so the "
                             f"trainer's logprobs would not be theirs (policy/dropout.py): use 0, or set "
                             f"trainer.keep_dropout=true to keep dropout knowingly")


@dataclass
class TrainerConfig:
    """Everything the policy worker needs; the RL loop adds epochs, eval and logging on top."""

    model_path: str = "smollm2"  # a folder, a hub id, or "smollm2" for the embedded model
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # off by default: full fine-tuning
    # Prompts (instance_id groups) per optimizer step, so the number of steps does not depend on turns.
    policy_mini_batch_size: int = 4
    # Token budget of one packed micro-batch row (per rank); a longer sample gets a row of its own. With
    # packing=tree it counts trie nodes (each distinct prefix once) and also bounds the row's T x T mask.
    micro_batch_tokens: int = 4096
    # Attention kernel for packed rows. sdpa builds a dense [T, T] block-diagonal mask per packed row (fine on
    # CPU and short rows); flex_attention / flash_attention_* skip the masked blocks, which is what long packed
    # rows on GPUs need (benchmarks/fsdp_throughput.py measures the difference).
    attn_implementation: str = "sdpa"
    # How a micro-batch's samples become model input (policy/packing/). rows: each sample concatenated in full.
    # tree: one prefix trie per micro-batch, every distinct prefix (a group's prompt, the history a step re-reads,
    # a shared tool-schema system prompt) forwarded once, same per-sample loss and gradients. Needs an attention
    # that takes an arbitrary mask: sdpa / eager (dense T x T mask: CPU, short rows) or flex_attention (GPU);
    # flash_attention_* cannot express a tree. auto: tree wherever it is exact on the model, else rows.
    # Architectures whose layers carry a state along the row (Mamba, gated delta net, short conv: Qwen3.5/Next,
    # Granite 4, Nemotron-H, LFM2) get one sample per row and refuse tree. Either way the worker checks the packing
    # on the run's own model at start-up and refuses one that does not score packed samples as they were sampled.
    packing: str = "auto"
    # Async rollouts (loop/rollout_ahead.py): the engines generate the next steps' rollouts while this step
    # trains, with weights at most this many updates old; truncated IS corrects the staleness. 0: synchronous.
    max_staleness: int = 0
    # The agreement alarm (loop/agreement.py): stop the run when the mean |trainer - engine| logprob on the
    # tokens just trained exceeds this. Healthy runs sit near 1e-6 (fp32 on CPU) to 0.015 (bf16 engines, TRL
    # #5312) and 0.04 (SmolLM2-135M, bf16 engine vs this trainer, measured on CPU); a sync that never reached the
    # engine read 0.201 in TRL #5312. 0.1 leaves room for bf16 noise and stops such a sync within one step. Steps trained on rollouts of older weights (max_staleness > 0) are
    # logged, not judged: their gap is the policy's own drift. null: off.
    agreement_alarm_mean_diff: float | None = 0.1
    # Stop RL when an update diverges: grad norm or entropy far outside their start (loop/divergence.py).
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    # The sampling temperature, top-k and top-p (conf/config.yaml copies them from generator.sampling): the
    # trainer scores the truncated distribution the engines drew from, so on-policy TIS weights are exactly 1.
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0  # 1.0: off
    # Dropout is off in the trainer's forwards (RL and SFT alike; policy/dropout.py): the engines sample without
    # it, so logprobs computed with it would make every ratio and TIS weight wrong. true keeps the model's dropout.
    keep_dropout: bool = False
    # The engines' context (conf/config.yaml copies engine.max_model_len): a longrope model (Phi-3.5/4-mini) is
    # scored with the RoPE factors vLLM uses at that context for every token (policy/models/rope.py). null: the
    # trainer picks them per forward, as transformers does (a worker used without engines).
    engine_max_model_len: int | None = None
    seed: int = 42  # torch's seed before the model loads (random inits: LoRA's A) and the packing check
    ckpt_dir: str = "ckpts"  # where checkpoints (step_N/) are written and resumed from; the run dir's ckpts/ in a run
    ckpt_interval: int = 10  # optimizer steps between checkpoints; 0 disables
    max_ckpts_to_keep: int = 2  # -1 keeps all
    resume: str = "auto"  # auto (latest complete checkpoint, if any) | none | a step_N folder
    # resume=none refuses a ckpt_dir that already holds checkpoints (resume=auto would later mix the two
    # runs); true deletes them first.
    overwrite_ckpt_dir: bool = False
    # A launch into a run dir that already trained (its run_config.yaml) must have the same config, or it would
    # silently continue (or restart) a different job there; true accepts the differences (logged, and recorded in
    # run_config.launches.jsonl; the first launch's run_config.yaml and .hydra/ stay as they were).
    resume_allow_changes: bool = False

    def validate(self, prefix: str = "trainer") -> None:
        """Validate this config and its parts, naming the full key path of the first bad value."""
        self.algorithm.validate(f"{prefix}.algorithm")
        self.optim.validate(f"{prefix}.optim")
        self.fsdp.validate(f"{prefix}.fsdp")
        self.divergence.validate(f"{prefix}.divergence")
        if self.lora.enabled:
            self.lora.validate(f"{prefix}.lora", keep_dropout=self.keep_dropout)
        if self.agreement_alarm_mean_diff is not None and self.agreement_alarm_mean_diff <= 0:
            raise ValueError(f"{prefix}.agreement_alarm_mean_diff must be > 0 (or null: off), "
                             f"got {self.agreement_alarm_mean_diff}")
        if self.max_staleness < 0:
            raise ValueError(f"{prefix}.max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}")
        for key in ("policy_mini_batch_size", "micro_batch_tokens"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{prefix}.{key} must be > 0, got {getattr(self, key)}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"{prefix}.attn_implementation: {self.attn_implementation!r} is not one of "
                             f"{ATTN_IMPLEMENTATIONS}")
        if self.packing not in PACKINGS:
            raise ValueError(f"{prefix}.packing: {self.packing!r} is not one of {PACKINGS}")
        if self.packing == "tree" and self.attn_implementation.startswith("flash_attention"):
            raise ValueError(f"{prefix}.packing=tree needs an attention that takes a tree mask, but "
                             f"{prefix}.attn_implementation={self.attn_implementation} (varlen) cannot express one: "
                             f"use flex_attention (GPU), sdpa or eager, or {prefix}.packing=rows")
        if self.temperature <= 0:
            raise ValueError(f"{prefix}.temperature must be > 0, got {self.temperature}")
        if self.engine_max_model_len is not None and self.engine_max_model_len <= 0:
            raise ValueError(f"{prefix}.engine_max_model_len must be > 0 (or null), got {self.engine_max_model_len}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{prefix}.top_p must be in (0, 1], got {self.top_p}")
        if self.ckpt_interval < 0:
            raise ValueError(f"{prefix}.ckpt_interval must be >= 0 (0 disables), got {self.ckpt_interval}")
        if self.max_ckpts_to_keep == 0 or self.max_ckpts_to_keep < -1:
            raise ValueError(f"{prefix}.max_ckpts_to_keep must be >= 1 or -1 (keep all), "
                             f"got {self.max_ckpts_to_keep}")
