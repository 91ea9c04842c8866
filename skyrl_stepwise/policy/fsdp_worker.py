"""One FSDP2 rank of the policy (or reference) model: logprobs, PPO train steps, weights, checkpoints, snapshots.

The worker reads its rank from the usual env vars (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), so the
same class runs as one Ray actor per rank or under torch.multiprocessing.spawn. Every public method is a
collective: all ranks call it with the same whole batch, each rank takes its own token-balanced shard, and
the results are reduced/gathered so every rank returns the same answer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from collections import defaultdict
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from skyrl_stepwise.checkpoint import store as checkpoint
from skyrl_stepwise.policy.batching import (PackedMicroBatch, TrainBatch, forward_logprobs, pack_micro_batch,
                                             packing_stats, rank_micro_batches)
from skyrl_stepwise.policy.config import AlgorithmConfig, FSDPConfig, OptimConfig, TrainerConfig
from skyrl_stepwise.policy.dropout import disable_dropout, dropout_note
from skyrl_stepwise.policy.lora import (adapted_layers, adapter_disabled, adapter_recipe, adapter_state, apply_lora,
                                        base_weights_checksum, check_adapter_recipe, is_adapter_key, merged_items,
                                        merged_shapes, save_adapter, LowRankSum)
from skyrl_stepwise.algorithms.losses import no_gradient, policy_loss
from skyrl_stepwise.policy.packing import attention_layout, refuse_inexact_attention, resolve_packing
from skyrl_stepwise.models.rope import pin_longrope
from skyrl_stepwise.policy.packing.selfcheck import PackingCheck, check_packing_precisely, refusal


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(fsdp: FSDPConfig) -> tuple[int, int, torch.device]:
    """Join (or reuse) the process group from env vars; nccl for GPUs, gloo for CPUs (and CPU collectives).

    A single process needs no env vars: it gets a private 1-rank group.
    """
    use_cuda = torch.cuda.is_available() and fsdp.backend != "gloo"
    timeout = {} if fsdp.collective_timeout_s is None else {"timeout": timedelta(seconds=fsdp.collective_timeout_s)}
    if fsdp.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("trainer.fsdp.backend=nccl but no CUDA device is visible; use auto or gloo")
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) == 1 \
            and "MASTER_PORT" not in os.environ:
        # a private 1-rank group: an in-memory store, so no port to pick and race for (a free port found first can be
        # taken by another process before the store binds it: EADDRINUSE, seen under a loaded CI host)
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, **timeout)
    if not dist.is_initialized():
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise RuntimeError(f"PolicyWorker needs env vars {missing} to join a {os.environ['WORLD_SIZE']}-rank "
                               f"process group (set them per rank / per Ray actor)")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", **timeout)
    world = dist.get_world_size()
    if world != fsdp.world_size:
        raise ValueError(f"trainer.fsdp.world_size is {fsdp.world_size} but the process group has {world} ranks "
                         f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')})")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return dist.get_rank(), world, device


def bf16_supported(device: torch.device) -> bool:
    """bf16 compute where the hardware has it: GPUs from Ampere on, CPUs with AVX512-BF16/AMX (on AVX2-only CPUs
    torch emulates bf16 matmuls, ~80x slower than float32: trainer.fsdp.mixed_precision then computes in fp32)."""
    from skyrl_stepwise.host.hardware import cpu_bf16_is_native

    return cpu_bf16_is_native() if device.type == "cpu" else torch.cuda.is_bf16_supported()


def mixed_precision_on(fsdp: FSDPConfig, device: torch.device) -> bool:
    """True when the sharded model computes in bf16 (asked for, and the hardware has it)."""
    return fsdp.mixed_precision and bf16_supported(device)


def shard_model(model: torch.nn.Module, fsdp: FSDPConfig, device: torch.device) -> torch.nn.Module:
    """fully_shard each decoder layer (the classes HF lists in `_no_split_modules`), then the root."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision_on(fsdp, device) else MixedPrecisionPolicy()
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} lists no decoder layer classes in _no_split_modules; "
                         f"cannot shard it per layer")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward)
    return model


def release_host_memory(device: torch.device, collect: bool = True) -> None:
    """Hand freed heap pages back to the OS after a phase (update, weight export, checkpoint).

    glibc keeps what a phase freed (activations, gathered weights, staging copies) in its arenas, so an idle
    CPU rank sat at the peak of its last update: 3.8 GiB where its tensors need 2 (benchmarks/policy_memory.py).
    malloc_trim(0) returns it (milliseconds); on CUDA the caching allocator is the one to ask. `collect=False`
    skips the full garbage collection (0.3-0.5 s over a worker's heap) after a phase that leaves no reference
    cycles holding tensors: the weight export, whose tensors refcounting frees.
    """
    import ctypes
    import ctypes.util
    import gc

    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


def weights_checksum(named_parameters) -> str:
    """First 16 hex digits of the sha256 of (name, full fp32 values) of every parameter, in the given order.

    The same digest for a plain HF model and an FSDP-sharded copy of the same weights (each DTensor is gathered,
    so with DTensors this is a collective), which lets a report prove that runs meant to start from the same
    weights did.
    """
    digest = hashlib.sha256()
    for name, param in named_parameters:
        full = param.full_tensor() if isinstance(param, DTensor) else param
        digest.update(name.encode())
        digest.update(memoryview(full.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()))
    return digest.hexdigest()[:16]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter (a collective all-gather when it is sharded). On a one-rank mesh the local
    shard is the whole tensor: returned as is, without DTensor's redistribute (milliseconds per tensor, which a
    LoRA model's 2 x 210 adapter factors multiply into seconds)."""
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device_mesh.size() == 1 and tuple(tensor.to_local().shape) == tuple(tensor.shape):
        return tensor.to_local()
    return tensor.full_tensor()


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter as a plain tensor that writes through to it (the parameter itself when
    it is not sharded)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _cloned(state):
    """A copy of a (nested) state dict whose tensors share no storage with the original: the optimizer
    updates its state in place, and Optimizer.load_state_dict keeps tensors that already have the right
    dtype and device, so without copies a restored snapshot would be changed by the next step."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cloned(v) for v in state)
    return state


def _saved_identity(path: Path) -> dict | None:
    """The `model` record of a checkpoint's trainer_state.json: {} for checkpoints written before it existed (they
    hold the full model, also with LoRA), None when the file cannot be read (checkpoint.load_checkpoint then raises
    CorruptCheckpoint naming it, which resume=auto knows how to handle)."""
    try:
        return dict(json.loads((path / "trainer_state.json").read_text()).get("model") or {})
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def micro_batch_loss(model: torch.nn.Module, mb: PackedMicroBatch, cfg: AlgorithmConfig, num_tokens: float,
                     temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward one packed row and return its share of the mini-batch token-mean loss (see losses.py).

    Without old_logprobs the update is on-policy: the detached current logprobs are the old ones
    (ratio 1), which saves a forward pass when each batch is a single mini-batch.
    """
    return scored_micro_batch_loss(model, mb, cfg, num_tokens, temperature, top_k, top_p)[:2]


def scored_micro_batch_loss(model: torch.nn.Module, mb: PackedMicroBatch, cfg: AlgorithmConfig, num_tokens: float,
                            temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0
                            ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """micro_batch_loss, and the row's logprobs under the weights before the update (detached), which its forward
    computed anyway."""
    if mb.advantages is None:
        raise ValueError("train_step needs TrainBatch.advantages (got None): compute them with compute_advantages")
    logprobs, entropy = forward_logprobs(model, mb, temperature, with_entropy=True, top_k=top_k, top_p=top_p)
    old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
    loss, metrics = policy_loss(logprobs, old, mb.advantages, mb.loss_mask, cfg, num_tokens,
                                rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs, entropy=entropy,
                                loss_weights=mb.loss_weights)
    return loss, metrics, logprobs.detach()


def sft_micro_batch_loss(model: torch.nn.Module, mb: PackedMicroBatch, num_tokens: float,
                         temperature: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on the loss-masked tokens, as this row's share of the mini-batch token mean.

    Same packing, sharding and scaling as the RL loss, so SFT and RL train on identical token layouts.
    """
    logprobs, entropy = forward_logprobs(model, mb, temperature, with_entropy=True)
    denom = max(float(num_tokens), 1.0)
    loss = -(logprobs * mb.loss_mask).sum() / denom
    # the token-mean entropy on the trained tokens: what the divergence guard watches (loop/divergence.py)
    return loss, {"sft/loss": loss.item(), "sft/entropy": (entropy.detach() * mb.loss_mask).sum().item() / denom}


def load_sharded_model(cfg: TrainerConfig, device: torch.device, trainable: bool
                       ) -> tuple[torch.nn.Module, list[str]]:
    """The checkpoint at cfg.model_path in fp32, sharded per layer over this process group, computing what the
    engines compute: dropout off (unless trainer.keep_dropout) and a longrope RoPE fixed to the factors the engines
    use at trainer.engine_max_model_len; with trainer.lora.enabled a trainable model gets a LoRA adapter
    (policy/lora.py), the only parameters that then require grad (a frozen model is the base). Returns the model
    and the start-up log lines saying what was changed."""
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.models import resolve_model_path

    attn = cfg.attn_implementation
    if attn == "flex_attention":  # compiled with dynamic=True, the packed row's BlockMask (policy/packing/flex.py)
        from skyrl_stepwise.policy.packing.flex import register_packed_flex_attention

        attn = register_packed_flex_attention()
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model_path), dtype=torch.float32,
                                                 attn_implementation=attn)
    model.config.use_cache = False
    notes = [] if cfg.keep_dropout else [dropout_note(disable_dropout(model))]
    if cfg.engine_max_model_len is not None:  # before sharding: the pinned RoPE buffers move with the model
        notes.append(pin_longrope(model, cfg.engine_max_model_len))
    if cfg.lora.enabled and trainable:  # before sharding: FSDP2 shards the adapter with its layer
        notes.append(apply_lora(model, cfg.lora))
    if cfg.fsdp.gradient_checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = shard_model(model, cfg.fsdp, device)
    if not trainable:
        model.requires_grad_(False)
    return model, [n for n in notes if n]


def refuse_untrainable_attention(cfg: TrainerConfig, device: torch.device) -> None:
    """flex_attention scores on a CPU (uncompiled, forward only) but PyTorch's FlexAttention has no CPU backward:
    a trainable policy (full or LoRA: the adapters on q/k/v and on earlier layers make attention's inputs require
    grad either way) would fail at its first update, so it is refused at start-up, naming the key."""
    if cfg.attn_implementation == "flex_attention" and device.type == "cpu":
        what = "a LoRA adapter" if cfg.lora.enabled else "the policy"
        raise ValueError(f"trainer.attn_implementation=flex_attention cannot train {what} on CPU: PyTorch's "
                         "FlexAttention has no CPU backward (it scores only: frozen and reference models); use "
                         "trainer.attn_implementation=sdpa or eager on CPU, flex_attention on a GPU")


class PolicyWorker:
    """A causal LM sharded with FSDP2 on this rank; `trainable=False` makes a frozen model (no optimizer).

    `with_reference=True` also keeps a frozen copy of the starting weights, sharded over the same ranks, for
    the KL loss: the reference lives on the policy's GPUs and process group instead of in a second group of
    actors (one process, one CUDA context and one NCCL communicator per GPU fewer). With LoRA the reference is
    the policy's own base (the adapter switched off): no second copy at all.
    """

    def __init__(self, cfg: TrainerConfig, trainable: bool = True, with_reference: bool = False):
        cfg.validate()
        self.cfg = cfg
        self.rank, self.world_size, self.device = init_distributed(cfg.fsdp)
        if trainable:
            refuse_untrainable_attention(cfg, self.device)
        torch.manual_seed(cfg.seed)
        self.model, self.notes = load_sharded_model(cfg, self.device, trainable)
        # what keeps packed samples apart on this architecture, the packing it allows, and the proof on this model
        self.layout = attention_layout(self.model, row_tokens=cfg.micro_batch_tokens)
        refuse_inexact_attention(self.layout)
        self._packing_checks: dict[str, PackingCheck] = {}  # every packing this worker may train, checked once
        self.cfg = cfg = replace(cfg, packing=self._checked_packing(cfg.packing))
        self.reference = None
        self.lora_layers = adapted_layers(self.model) if cfg.lora.enabled and trainable else {}
        self._base_reference = with_reference and bool(self.lora_layers)
        if with_reference and not self._base_reference:
            with torch.random.fork_rng(devices=[]):  # the policy's RNG stream is the same with or without it
                self.reference, _ = load_sharded_model(cfg, self.device, trainable=False)
        self.optimizer = self.scheduler = None
        if trainable:
            self._build_optimizer()
        self._snapshot: dict | None = None

    def _build_optimizer(self) -> None:
        """AdamW and its transformers LR schedule from cfg.optim, over the parameters that train (with LoRA: the
        adapter's alone, so the frozen base has neither gradients nor AdamW moments, at trainer.lora.lr, by default
        10x cfg.optim.lr: LoRAConfig.optimizer_lr)."""
        from transformers import get_scheduler

        o = self.cfg.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        lr = self.cfg.lora.optimizer_lr(o.lr) if self.lora_layers else o.lr  # LoRA: 10x unless trainer.lora.lr
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = get_scheduler(o.scheduler, self.optimizer, num_warmup_steps=o.num_warmup_steps,
                                       num_training_steps=o.num_training_steps if o.num_training_steps > 0 else None)

    def set_optim(self, optim: OptimConfig) -> None:
        """New optimizer settings before the first step: the SFT warm start picks its lr and warm-up from the
        model's own loss on the demonstrations, which only this worker can measure. Refused once a step was
        taken (AdamW's moments and the schedule's position would be thrown away)."""
        if self.optimizer is None:
            raise RuntimeError("set_optim called on a PolicyWorker built with trainable=False")
        if self.optimizer.state or self.scheduler.last_epoch > 0:
            raise RuntimeError("set_optim after an optimizer step: the settings must be chosen before training")
        optim.validate()
        self.cfg = replace(self.cfg, optim=optim)
        self._build_optimizer()

    def _self_check(self, packing: str) -> PackingCheck:
        """The start-up packing self-check for `packing` on this model, run once per packing and kept (a collective
        on a sharded model: every rank asks for the same packing at the same call); a model that cannot even run
        our packed inputs is refused the same way as one that scores them wrong, loudly."""
        if packing in self._packing_checks:
            return self._packing_checks[packing]
        try:
            dtype = torch.bfloat16 if mixed_precision_on(self.cfg.fsdp, self.device) else torch.float32
            check = check_packing_precisely(self.model, self.layout, packing, self.device, dtype, seed=self.cfg.seed)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"trainer.packing={packing} with trainer.attn_implementation="
                             f"{self.cfg.attn_implementation} failed the packing self-check on "
                             f"{self.layout.describe()}: {type(e).__name__}: {e}") from e
        self._packing_checks[packing] = check
        return check

    def _checked_packing(self, requested: str) -> str:
        """The packing `requested` (auto | rows | tree) trains on this model, proven by the self-check before it
        first trains, wherever it is chosen (start-up or `set_packing`); sets `packing_check` to its check.

        auto means "tree wherever it is exact": a model whose positional terms follow the row index (ALiBi, GPT-Neo's
        local band) fails the tree's check but may still pack exactly as rows; the check decides. A packing that
        fails its check raises, naming the model type and why (packing/selfcheck.refusal)."""
        packing = resolve_packing(requested, self.layout)
        check = self._self_check(packing)
        if not check.passed and requested == "auto" and packing == "tree":
            packing = "rows"
            check = replace(self._self_check("rows"), fallback_from=check)
        if not check.passed:
            raise ValueError(refusal(check, self.layout))
        self.packing_check = check
        return packing

    def _micro_batches(self, batch: TrainBatch) -> tuple[list[list[int]], list[list[list[int]]]]:
        """This rank's micro-batches, padded with empty ones to the count of the busiest rank (FSDP needs
        every rank to run the same number of passes), and every rank's, for stats. No communication:
        every rank derives every shard from the same batch."""
        per_rank = [rank_micro_batches(batch, r, self.world_size, self.cfg.micro_batch_tokens, self.cfg.packing,
                                       self.layout.one_sample_per_row) for r in range(self.world_size)]
        n = max(1, max(len(m) for m in per_rank))
        per_rank = [m + [[] for _ in range(n - len(m))] for m in per_rank]
        return per_rank[self.rank], per_rank

    def set_packing(self, packing: str) -> str:
        """Switch trainer.packing (auto | rows | tree) for the next calls; returns the previous value. The ablation
        trains the same rollouts both ways from one worker. Every packing passes the same self-check as at start-up
        before it first trains (auto falls back to rows as there); one that is not exact here is refused, and the
        worker keeps its packing."""
        cfg = replace(self.cfg, packing=packing)
        cfg.validate()
        cfg.packing = self._checked_packing(packing)  # raises before anything changes
        previous, self.cfg = self.cfg.packing, cfg
        return previous

    def packing_summary(self) -> dict[str, str | float]:
        """The packing this worker trains with, the architecture's layout and the start-up self-check, for the log,
        and `notes`: what was changed in the model so it computes what the engines do (dropout, longrope)."""
        return {"packing": self.cfg.packing, "layout": self.layout.describe(),
                "check": self.packing_check.describe(), "max_abs_error": self.packing_check.max_abs_error,
                "notes": list(self.notes)}

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Logprobs of every response token of every sample under the current weights, on every rank."""
        return self._logprobs(self.model, batch)

    def compute_base_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The same with the LoRA adapter switched off (the policy's frozen base; without LoRA the policy itself):
        the adapter probe's no-adapter control, what an engine that never loaded the adapter scores."""
        if not self.lora_layers:
            return self._logprobs(self.model, batch)
        with adapter_disabled(self.model):
            return self._logprobs(self.model, batch)

    def compute_ref_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The same under the reference (the starting weights), for the KL loss."""
        if self._base_reference:  # LoRA: the base is the policy with its adapter switched off
            with adapter_disabled(self.model):
                return self._logprobs(self.model, batch)
        if self.reference is None:
            raise RuntimeError("compute_ref_logprobs on a PolicyWorker built without with_reference=True")
        return self._logprobs(self.reference, batch)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> list[list[float]]:
        batch.validate()
        model.eval()
        mine, _ = self._micro_batches(batch)
        local: dict[int, list[float]] = {}
        for idx in mine:
            mb = pack_micro_batch(batch, idx, self.cfg.packing).to(self.device)
            logprobs, _ = forward_logprobs(model, mb, self.cfg.temperature, top_k=self.cfg.top_k,
                                           top_p=self.cfg.top_p, layout=self.layout)
            local.update(zip(idx, mb.split(logprobs)))
        gathered: list[dict[int, list[float]]] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        merged = {i: lp for part in gathered for i, lp in part.items()}
        return [merged[i] for i in range(len(batch))]

    def train_step(self, batch: TrainBatch, objective: str = "ppo") -> dict[str, float]:
        """One optimizer step on one mini-batch: token-mean loss over all its loss-masked tokens on all ranks.

        objective: `ppo` (the RL loss, losses.py) or `sft` (cross-entropy on the loss-masked tokens: the
        warm start on demonstrations, built by the same generator path as rollouts).

        FSDP averages gradients over ranks, so each rank's loss (its token sum / the global token count) is
        scaled by world_size before backward; the result is exactly the gradient of the global token mean.
        A step whose gradient norm is not finite is skipped (train/skipped_step = 1).
        """
        return self._train_step(batch, objective, None)[0]

    def train_step_scored(self, batch: TrainBatch, rows: list[int]
                          ) -> tuple[dict[str, float], dict[int, list[float]]]:
        """A PPO train_step that also returns the logprobs its forward computed for the samples `rows` of `batch`,
        under the weights before the update, on every rank: what the viewer shows as the trainer's logprobs, without
        a second forward of those samples. The loop asks only where that forward is the scoring pass: one
        on-policy mini-batch with a gradient to compute, dropout off (a zero-gradient step runs no forward and
        returns no scores)."""
        return self._train_step(batch, "ppo", set(rows))

    def _train_step(self, batch: TrainBatch, objective: str, rows: set[int] | None
                    ) -> tuple[dict[str, float], dict[int, list[float]]]:
        if self.optimizer is None:
            raise RuntimeError("train_step called on a PolicyWorker built with trainable=False")
        if objective not in ("ppo", "sft"):
            raise ValueError(f"train_step objective must be 'ppo' or 'sft', got {objective!r}")
        start = time.perf_counter()
        batch.validate()
        if objective == "ppo" and no_gradient(batch, self.cfg.algorithm):
            return self._zero_gradient_step(batch, start), {}
        self.model.train()
        scored: dict[int, list[float]] = {}
        mine, per_rank = self._micro_batches(batch)
        num_tokens = batch.num_loss_tokens()
        denominator = batch.loss_denominator()  # = num_tokens unless trajectory weights are set
        totals: dict[str, float] = defaultdict(float)
        for i, idx in enumerate(mine):
            if self.cfg.fsdp.accumulate_unsharded:
                self._hold_unsharded(last=i == len(mine) - 1)
            mb = pack_micro_batch(batch, idx, self.cfg.packing).to(self.device)
            if objective == "sft":
                loss, metrics = sft_micro_batch_loss(self.model, mb, num_tokens)
            else:
                loss, metrics, logprobs = scored_micro_batch_loss(
                    self.model, mb, self.cfg.algorithm, denominator, self.cfg.temperature, self.cfg.top_k,
                    self.cfg.top_p)
                if rows:
                    scored.update((i, lp) for i, lp in zip(idx, mb.split(logprobs)) if i in rows)
            (loss * self.world_size).backward()
            for k, v in metrics.items():  # `*_max` metrics are maxima (over micro-batches, then ranks)
                totals[k] = max(totals[k], v) if k.endswith("_max") else totals[k] + v
        if self.cfg.fsdp.accumulate_unsharded:
            self.model.set_reshard_after_forward(self.cfg.fsdp.reshard_after_forward)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        grad_norm = grad_norm.item()
        skipped = not math.isfinite(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
            # only a step taken is a step of the schedule: skipped ones must not eat the warm-up or the decay
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        keys = sorted(k for k in totals if not k.endswith("_max"))
        summed = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(summed)
        out = dict(zip(keys, summed.tolist()))
        max_keys = sorted(k for k in totals if k.endswith("_max"))
        if max_keys:
            maxed = torch.tensor([totals[k] for k in max_keys], dtype=torch.float64)
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
            out.update(zip(max_keys, maxed.tolist()))
        out.update(packing_stats(batch, [mb for m in per_rank for mb in m], self.cfg.packing,
                                 self.cfg.micro_batch_tokens))
        if rows:  # each rank scored the samples of its own micro-batches
            gathered: list[dict[int, list[float]]] = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(gathered, scored)
            scored = {i: lp for part in gathered for i, lp in part.items()}
        out.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_step": float(skipped),
                    "train/loss_tokens": num_tokens, "train/step_time_s": time.perf_counter() - start})
        release_host_memory(self.device)
        return out, scored

    def _hold_unsharded(self, last: bool) -> None:
        """Through a step's micro-batches (trainer.fsdp.accumulate_unsharded) keep every layer gathered and sum its
        gradients whole; the last micro-batch's backward reduces them once and reshards. FSDP2 sums an unsharded
        gradient in its reduce dtype (fp32), as it sums the sharded one, in the same micro-batch order."""
        self.model.set_reshard_after_forward(False)
        self.model.set_requires_gradient_sync(last)
        self.model.set_reshard_after_backward(last)

    def _zero_gradient_step(self, batch: TrainBatch, start: float) -> dict[str, float]:
        """The update of a mini-batch whose gradient is exactly 0 (no_gradient), without the forward and backward
        that would compute it: AdamW steps on zero gradients, so momentum and weight decay move the weights
        exactly as after the full pass (bitwise), and the schedule advances as for any step taken."""
        for param in self.model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = {"train/grad_norm": 0.0, "train/lr": lr, "train/skipped_step": 0.0, "train/forward_skipped": 1.0,
               "train/loss_tokens": batch.num_loss_tokens(), "policy/loss": 0.0, "policy/pg_loss": 0.0,
               "train/step_time_s": time.perf_counter() - start}
        if batch.old_logprobs is None:  # on-policy: ratio 1, nothing clipped, no movement (entropy: not computed)
            out.update({"policy/clip_frac": 0.0, "policy/ppo_kl": 0.0})
        return out

    def full_state_dict(self, base_only: bool = False) -> dict[str, torch.Tensor]:
        """Full (unsharded) fp32 weights on CPU under their HF names, for weight sync; collective.

        Rank 0 receives every tensor; the other ranks get an empty dict (cpu_offload keeps memory bounded).
        With LoRA the adapter is merged in (W + scaling * B @ A) under the base model's names: what the engines load.
        `base_only` (LoRA): the frozen base alone under those names, never the adapter: what an engine serving
        adapters by version (trainer.lora.sync=adapter) holds under them, e.g. the SFT warm start.
        """
        if self.lora_layers:
            return self._merged_state_dict(base_only)
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _merged_state_dict(self, base_only: bool, deferred: bool = False) -> dict[str, torch.Tensor]:
        """full_state_dict with LoRA: each base weight and the factors of its adapter gathered once (`_full`, every
        rank in the same order) and merged as they arrive (merge_factors); rank 0 keeps them on CPU. Not through
        get_model_state_dict: its per-entry work over the adapter's 2 x 210 extra entries cost seconds (docs/lora.md).
        `deferred` (a CPU rank writing the weights file): each merged weight stays a LowRankSum, computed as it is
        written, so no merged copy of the model is ever held."""
        merged: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            layers = {} if base_only else self.lora_layers
            for name, tensor in merged_items(self.model.state_dict(), layers, _full, deferred=deferred):
                if self.rank == 0:
                    merged[name] = tensor if isinstance(tensor, LowRankSum) else tensor.to("cpu")
        return merged

    def export_adapter(self) -> dict:
        """trainer.lora.sync=adapter: the adapter alone, as the bytes of peft's folder (policy/lora.py save_adapter,
        written into a temp folder of rank 0's own and read back); collective (every rank takes part in gathering the
        adapter's shards, nothing else: the base weights are never gathered). The bytes travel to the engines through
        Ray, so an engine on any node loads them (inference/adapter_files.py). Returns rank 0's
        {"adapter": AdapterFiles (None on the other ranks), "bytes", "seconds", "params"}."""
        import tempfile

        from skyrl_stepwise.inference.adapter_files import AdapterFiles
        from skyrl_stepwise.inference.weights import shared_memory_dir

        if not self.lora_layers:
            raise RuntimeError("export_adapter: trainer.lora.sync=adapter needs trainer.lora.enabled=true")
        start = time.perf_counter()
        with torch.no_grad():
            adapter = {n: _full(p).cpu() for n, p in self.model.named_parameters() if ".lora_" in n}
        out = {"adapter": None, "bytes": 0, "seconds": 0.0, "params": sum(t.numel() for t in adapter.values())}
        if self.rank == 0:
            with tempfile.TemporaryDirectory(prefix="skyrl_stepwise_export_", dir=shared_memory_dir()) as folder:
                save_adapter(self.model, folder, adapter_state(self.model, adapter))
                out["adapter"] = AdapterFiles.read(folder)
            out["bytes"] = out["adapter"].nbytes
        out["seconds"] = time.perf_counter() - start
        return out

    def weights_checksum(self) -> str:
        """Digest of the full fp32 weights (see `weights_checksum`), the same on every rank; collective. With LoRA,
        of the merged weights the engines receive (before any step: the base model's own digest)."""
        if self.lora_layers:
            return weights_checksum(merged_items(dict(self.model.named_parameters()), self.lora_layers, _full))
        return weights_checksum(self.model.named_parameters())

    def snapshot(self) -> None:
        """Keep an in-memory copy of this rank's weight shards, optimizer and scheduler state and RNG.

        `restore_snapshot` then starts any number of updates from exactly this point: the ablation times one
        update per mode and runs one short training per mode, and none may inherit another's weights or AdamW
        moments. Local shards only, no communication. The weights are kept in host memory (on a GPU, device
        memory is what the model, its gradients and AdamW already fill); the optimizer state stays where it is,
        which costs nothing for a snapshot taken before the first step.
        """
        self._snapshot = {"params": [_local(p).detach().to("cpu", copy=True) for p in self.model.parameters()],
                          "optimizer": _cloned(self.optimizer.state_dict()) if self.optimizer else None,
                          "scheduler": _cloned(self.scheduler.state_dict()) if self.scheduler else None,
                          "rng": checkpoint._rng_state()}

    def restore_snapshot(self) -> None:
        """Put back what `snapshot` kept; the snapshot itself stays intact for the next restore.

        Optimizer.load_state_dict replaces the whole state, so a snapshot taken before the first step restores
        an empty optimizer (no AdamW moments, step counts from zero), as in a fresh worker.
        """
        if self._snapshot is None:
            raise RuntimeError("restore_snapshot called on a PolicyWorker that has no snapshot; call snapshot() first")
        with torch.no_grad():
            for param, saved in zip(self.model.parameters(), self._snapshot["params"], strict=True):
                _local(param).copy_(saved)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer.load_state_dict(_cloned(self._snapshot["optimizer"]))
            self.scheduler.load_state_dict(_cloned(self._snapshot["scheduler"]))
        checkpoint._set_rng_state(self._snapshot["rng"])

    def export_weights(self, path: str, dtype: str, nodes: list[str] | None = None, base_only: bool = False) -> dict:
        """Write the full weights as safetensors in the engines' dtype at `path` on every node in `nodes` (the
        nodes whose engines read them; default rank 0's); collective. No weights go through the driver or Ray.

        The first policy rank on each of those nodes writes the file there; rank 0, which gathers the full state,
        sends it to the other writers over the trainer's own process group (one rank per GPU, so nothing NCCL
        refuses, unlike a group with the engines colocated on the same GPUs). Where `path`'s filesystem
        (/dev/shm) lacks room, a writer uses the temp dir and says so. `base_only`: the LoRA base without the
        adapter (full_state_dict). Returns the parameter count, the bytes written and `paths`: node -> the file
        there."""
        from skyrl_stepwise.inference.weights import current_node_id, weights_target, write_weights_file

        engine_dtype = getattr(torch, dtype)
        if self.lora_layers:  # on CPU the adapter is merged as each weight is written (LowRankSum), not before
            state = self._merged_state_dict(base_only, deferred=self.device.type == "cpu")
        else:
            state = self.full_state_dict()
        rank_nodes: list[str] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(rank_nodes, current_node_id())
        wanted = list(nodes or [rank_nodes[0]])
        missing = [n for n in wanted if n not in rank_nodes]
        if missing:
            raise ValueError(f"export_weights: no policy rank on node(s) {missing} to write the weights file there")
        writers = sorted({rank_nodes.index(n) for n in wanted})
        if any(w != 0 for w in writers):
            state = {name: value.tensor() if isinstance(value, LowRankSum) else value for name, value in state.items()}
            state = self._send_state_to(sorted({0, *writers}), state)
        written = None
        if self.rank in writers:
            nbytes = sum(t.numel() for t in state.values()) * torch.empty(0, dtype=engine_dtype).element_size()
            target, warning = weights_target(path, nbytes)
            written = (rank_nodes[self.rank], str(target), write_weights_file(state.items(), engine_dtype, target),
                       warning)
            self._weights_file = target
        params = sum(t.numel() for t in state.values())
        del state
        release_host_memory(self.device, collect=False)
        results: list = [None] * self.world_size
        dist.all_gather_object(results, written)
        done = [r for r in results if r is not None]
        return {"params": params, "bytes": sum(r[2] for r in done), "paths": {r[0]: r[1] for r in done},
                "warning": next((r[3] for r in done if r[3]), None)}

    def _send_state_to(self, members: list[int], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's full state broadcast to `members` (a group of their own; every rank takes part in creating
        it), tensor by tensor: the members return the full state on CPU, the others what they had."""
        group = dist.new_group(members)
        try:
            if self.rank not in members:
                return state
            specs = [[(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]]
            dist.broadcast_object_list(specs, src=0, group=group)
            comm_device = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            received = {}
            for name, shape, dtype in specs[0]:
                tensor = state[name].to(comm_device) if self.rank == 0 else \
                    torch.empty(shape, dtype=getattr(torch, dtype), device=comm_device)
                dist.broadcast(tensor, src=0, group=group)
                received[name] = tensor.cpu()
            return state if self.rank == 0 else received
        finally:
            dist.destroy_process_group(group)

    def remove_weights_file(self, paths: list[str]) -> None:
        """Delete the weights file this rank last wrote if it is one of `paths` (an update the engines have read):
        every node's copy, not only the driver's; a file exported to keep (SFT's model) is never named here."""
        path = getattr(self, "_weights_file", None)
        if path is not None and str(path) in paths:
            Path(path).unlink(missing_ok=True)
            self._weights_file = None

    def offload_to_host(self) -> int:
        """GPU: move this rank's weights, gradients, AdamW state and reference shard to host memory so the engines
        on the same GPU can generate in it; returns the device bytes freed. A no-op on CPU (and when already off).

        FSDP2 modules move with `.to()` and keep their sharding; the optimizer's state tensors are moved by hand.
        """
        if self.device.type != "cuda" or getattr(self, "_offloaded", False):
            return 0
        free_before = torch.cuda.mem_get_info()[0]
        self._move_to(torch.device("cpu"))
        self._offloaded = True
        return max(0, torch.cuda.mem_get_info()[0] - free_before)

    def load_to_device(self) -> None:
        """Undo `offload_to_host` before the next forward or update (a no-op when nothing is offloaded)."""
        if getattr(self, "_offloaded", False):
            self._move_to(self.device)
            self._offloaded = False

    def _move_to(self, device: torch.device) -> None:
        for model in (self.model, self.reference):
            if model is not None:
                model.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":  # AdamW keeps `step` on the host
                        state[key] = value.to(device, non_blocking=True)
        if device.type == "cpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def weight_manifest(self, dtype: str, bucket_bytes: int) -> list:
        """The broadcast's plan (names, full shapes, the engines' dtype, bucket boundaries) in state-dict order;
        the same on every rank, no communication. The driver passes it to the engines: a few KB, no weights."""
        from skyrl_stepwise.inference.weight_broadcast import manifest_to_wire, plan_buckets

        shapes = ((name, tuple(t.shape)) for name, t in self.model.state_dict().items())
        if self.lora_layers:  # the engines receive merged weights under the base model's names
            shapes = merged_shapes(shapes)
        return manifest_to_wire(plan_buckets(shapes, dtype, bucket_bytes))

    def open_weight_broadcast(self, num_engine_ranks: int, timeout_s: float) -> tuple[str, int, str] | None:
        """Rank 0 opens the rendezvous of a new group of itself + `num_engine_ranks` engine workers and returns
        (host, port, backend) for them: NCCL when this rank computes on a GPU, else gloo. Other ranks: None."""
        from skyrl_stepwise.inference.weight_broadcast import node_ip, open_store

        self.close_weight_broadcast()
        if self.rank != 0:
            return None
        host, world = node_ip(), 1 + num_engine_ranks
        store, port = open_store(host, world, timeout_s)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._weight_rendezvous = (host, port, world, backend, timeout_s, store)
        return host, port, backend

    def join_weight_broadcast(self) -> bool:
        """Rank 0 joins the group opened above; blocks until every engine worker has joined too."""
        from skyrl_stepwise.inference.weight_broadcast import WeightBroadcastGroup

        if self.rank == 0:
            host, port, world, backend, timeout_s, store = self._weight_rendezvous
            self._weight_group = WeightBroadcastGroup(host, port, 0, world, backend, timeout_s, store=store)
        return True

    def broadcast_weights(self, manifest: list, base_only: bool = False) -> dict[str, int]:
        """Gather each parameter in turn (every rank: FSDP all-gathers are collectives) and let rank 0 broadcast
        it, bucket by bucket in the engines' dtype, to the engine workers; collective. `base_only`: the LoRA base
        without the adapter, under the same names (full_state_dict).

        Rank 0 holds one full tensor and one bucket at a time, not the whole model, and nothing reaches the driver
        but two counts. The manifest is checked on every rank before the first collective, so a mismatch fails
        everywhere at once instead of leaving the engines waiting.
        """
        from skyrl_stepwise.inference.weight_broadcast import manifest_from_wire

        buckets = manifest_from_wire(manifest)
        state = self.model.state_dict()
        expected = [(s.name, s.shape) for bucket in buckets for s in bucket]
        actual = [(name, tuple(t.shape)) for name, t in state.items()]
        if self.lora_layers:
            actual = list(merged_shapes(actual))
        if expected != actual:
            missing = sorted(set(expected) ^ set(actual))[:5]
            raise ValueError(f"broadcast_weights: the manifest does not match this model's state dict: {missing}")
        full = merged_items(state, {} if base_only else self.lora_layers, _full) if self.lora_layers else \
            ((name, _full(t)) for name, t in state.items())
        sent = 0
        with torch.no_grad():
            if self.rank == 0:
                if getattr(self, "_weight_group", None) is None:
                    raise RuntimeError("broadcast_weights before open_weight_broadcast/join_weight_broadcast")
                sent = self._weight_group.send(buckets, full)
            else:
                for _ in full:  # take part in every all-gather rank 0 makes
                    pass
        del state
        release_host_memory(self.device)
        return {"params": sum(math.prod(shape) for _, shape in expected), "bytes": sent}

    def close_weight_broadcast(self) -> None:
        """Leave the engines' group (before a new one, and at shutdown)."""
        group = getattr(self, "_weight_group", None)
        if group is not None:
            group.close()
        self._weight_group = None

    def save_checkpoint(self, step: int, trainer_state: dict | None = None,
                        files: dict[str, bytes] | None = None) -> Path:
        """Atomic checkpoint of model, optimizer, scheduler, RNG, trainer_state and the driver's `files`.

        With LoRA the checkpoint holds the adapter alone (and its AdamW state), not the frozen base: the base is
        re-read from trainer.model_path at resume, and its checksum recorded here (`model` in trainer_state,
        with the adapter's recipe that `model export` rebuilds it from) makes a resume on other weights fail."""
        state = dict(trainer_state or {}, model=self.checkpoint_identity())
        path = checkpoint.save_checkpoint(self.cfg.ckpt_dir, step, self.model, self.optimizer, self.scheduler,
                                          state, self.cfg.max_ckpts_to_keep, files,
                                          model_keys=is_adapter_key if self.lora_layers else None)
        release_host_memory(self.device)
        return path

    def checkpoint_identity(self) -> dict:
        """What a checkpoint records about the model: the base folder, and with LoRA the adapter's recipe and the
        frozen base's checksum (computed once: the base never changes); collective with LoRA."""
        from skyrl_stepwise.models import resolve_model_path

        identity = {"model_path": str(resolve_model_path(self.cfg.model_path)), "adapter_only": False, "lora": None}
        if self.lora_layers:
            if getattr(self, "_base_checksum", None) is None:
                self._base_checksum = base_weights_checksum(self.model.named_parameters(), weights_checksum)
            identity.update(adapter_only=True, lora=adapter_recipe(self.model, self.cfg.lora),
                            base_weights=self._base_checksum)
        return identity

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore a complete checkpoint in place; returns its trainer_state (with `step`). Before any tensor
        loads, a checkpoint whose adapter recipe (trainer.lora.enabled, rank, alpha, target_modules) differs from
        this run's is refused naming the key and both values (AdapterRecipeMismatch, a configuration error, never
        CorruptCheckpoint), and an adapter-only checkpoint, naming trainer.model_path, when the base weights here are
        not the ones it was trained on (its recorded checksum)."""
        saved = _saved_identity(Path(path))  # None: unreadable, left to checkpoint.load_checkpoint to name
        adapter_only = bool(saved and saved.get("adapter_only"))
        if saved:  # {}: written before checkpoints recorded the model
            check_adapter_recipe(saved.get("lora"), adapter_recipe(self.model, self.cfg.lora) if self.lora_layers
                                 else None, str(path))
        if adapter_only:
            here = self.checkpoint_identity()
            if here["base_weights"] != saved.get("base_weights"):
                raise ValueError(
                    f"trainer.model_path={self.cfg.model_path!r} ({here['model_path']}): its weights (checksum "
                    f"{here['base_weights']}) are not the base the LoRA checkpoint {path} was trained on "
                    f"({saved.get('model_path')}, checksum {saved.get('base_weights')}); resume with that base")
        return checkpoint.load_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                          model_keys=is_adapter_key if adapter_only else None)

    def shutdown(self) -> None:
        """Leave the process groups (the last call of a Ray actor or spawned rank)."""
        self.close_weight_broadcast()
        if dist.is_initialized():
            dist.destroy_process_group()
