"""Where a policy rank's memory goes, phase by phase: load, optimizer, logprobs, update, weight export, checkpoint.

One PolicyWorker (FSDP2, one gloo rank, the tiny recipe's trainer settings) on the embedded SmolLM2-135M runs
the phases of an RL step on a batch shaped like the tiny Search-R1 run's rollouts. A thread samples this
process's RSS every 20 ms; the table shows RSS after each phase, the peak inside it, and what the tensors
account for (params, grads, AdamW moments: exact byte counts from the model), so the rest is visibly
activations, allocator slack, or staging copies of a save.

    python benchmarks/policy_memory.py                              # tiny recipe's settings
    python benchmarks/policy_memory.py --micro-batch-tokens 4096 --gradient-checkpointing

Runs in about 5 minutes on 2 cores (7 with gradient checkpointing). Measured: peak 4.4 GiB, idle after a step
2.0 GiB (3.8 before ranks called malloc_trim), 3.4 GiB peak with --gradient-checkpointing (update +50%).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_throughput import merged, search_r1_rollouts  # noqa: E402

GIB = 2**30


class PeakSampler:
    """Samples RSS on a thread; `phase()` reports the peak seen while its block ran."""

    def __init__(self, interval_s: float = 0.02):
        self.proc, self.interval_s, self.peak = psutil.Process(), interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.rows: list[tuple[str, float, float, float]] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval_s)

    @contextmanager
    def phase(self, name: str):
        self.peak = rss = self.proc.memory_info().rss
        start = time.perf_counter()
        yield
        after = self.proc.memory_info().rss
        self.peak = max(self.peak, after)
        self.rows.append((name, after / GIB, self.peak / GIB, time.perf_counter() - start))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def tensor_bytes(worker) -> dict[str, int]:
    """Bytes held by parameters, gradients and optimizer state on this rank (local shards)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * local(p).element_size() for p in worker.model.parameters())
    grads = sum(local(p.grad).numel() * local(p.grad).element_size()
                for p in worker.model.parameters() if p.grad is not None)
    optim = sum(local(v).numel() * local(v).element_size() for s in worker.optimizer.state.values()
                for v in s.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optimizer": optim}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--no-mixed-precision", action="store_true")
    parser.add_argument("--trajectories", type=int, default=16, help="4 prompts x 4 samples in the tiny run")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--stepwise", action="store_true",
                        help="one sample per turn (the tiny recipe merges: merge_stepwise_output=true)")
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from skyrl_stepwise.inference.weights import weights_file
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.policy.config import TrainerConfig

    sampler = PeakSampler()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainerConfig(model_path="smollm2", micro_batch_tokens=args.micro_batch_tokens, ckpt_interval=1,
                            policy_mini_batch_size=args.trajectories, ckpt_dir=os.path.join(tmp, "ckpts"))
        cfg.algorithm.use_kl_loss = False
        cfg.algorithm.tis_ratio_clip_high = None  # synthetic rollouts carry no sampler logprobs
        cfg.fsdp.gradient_checkpointing = args.gradient_checkpointing
        cfg.fsdp.mixed_precision = not args.no_mixed_precision
        with sampler.phase("import + load + shard + AdamW"):
            worker = PolicyWorker(cfg)
        vocab = worker.model.config.vocab_size
        # the tiny run's shape: ~330-token first prompt, <=128-token turns, ~3x100-token observations (topk 3)
        batch = search_r1_rollouts(args.trajectories, args.turns, 330, 96, 300, vocab)
        if not args.stepwise:
            batch = merged(batch, args.turns)
        with sampler.phase("old logprobs (no grad)"):
            worker.compute_logprobs(batch)
        for step in (1, 2):
            with sampler.phase(f"train_step {step} (forward, backward, AdamW)"):
                worker.train_step(batch)
        held = tensor_bytes(worker)
        with weights_file() as path, sampler.phase("export weights (bf16 file for the engines)"):
            worker.export_weights(str(path), "bfloat16")
        with sampler.phase("checkpoint (DCP model + optimizer)"):
            worker.save_checkpoint(1)
        worker.shutdown()
    sampler.close()

    print(f"SmolLM2-135M, 1 FSDP2 rank, mixed precision {cfg.fsdp.mixed_precision}, gradient checkpointing "
          f"{args.gradient_checkpointing}, micro-batch {args.micro_batch_tokens} tokens, {len(batch)} samples "
          f"({'step-wise' if args.stepwise else 'merged'}), {batch.num_loss_tokens()} loss tokens\n")
    print("| phase | RSS after GiB | peak in phase GiB | seconds |")
    print("|---|---:|---:|---:|")
    for name, after, peak, seconds in sampler.rows:
        print(f"| {name} | {after:.2f} | {peak:.2f} | {seconds:.1f} |")
    total = sum(held.values())
    print("\nheld between steps (exact tensor bytes): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in held.items())
          + f" = {total / GIB:.2f} GiB")
    peak = max(r[2] for r in sampler.rows)
    print(f"peak RSS {peak:.2f} GiB; above params + grads + AdamW: {peak - total / GIB:.2f} GiB "
          "(python, torch and its libraries, activations, staging copies)")


if __name__ == "__main__":
    main()
