"""The update step with LoRA vs full fine-tuning, side by side on the embedded SmolLM2-135M (one FSDP2 gloo rank).

Both arms are built in one process from the same weights and take their train_steps alternately (full, LoRA, full,
...) on the same batch, shaped like the tiny Search-R1 run's rollouts (merged: one sample per trajectory), so the
host's load falls on both alike. Printed: seconds per train_step (median after one warm-up step), the weight export
for the engines (LoRA merges the adapter into full weights first), and the bytes each arm holds between steps
(parameters, AdamW state), with LoRA / full ratios.

    python benchmarks/lora_vs_full.py                     # 4 trajectories x 3 turns, rank 16, 3 timed steps
    python benchmarks/lora_vs_full.py --trajectories 16 --steps 5 --rank 8

No numbers yet: on the 2-core box, under other jobs' load, neither the default shape (17 min) nor
--trajectories 2 --turns 1 --steps 1 (4 min) finished; run it on an idle host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_throughput import merged, search_r1_rollouts  # noqa: E402

MIB = 2**20


def held_bytes(worker) -> tuple[int, int, int]:
    """(all parameters, trainable parameters, AdamW state) bytes on this rank."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * local(p).element_size() for p in worker.model.parameters())
    trainable = sum(local(p).numel() * local(p).element_size() for p in worker.model.parameters() if p.requires_grad)
    optim = sum(local(v).numel() * local(v).element_size() for s in worker.optimizer.state.values()
                for v in s.values() if torch.is_tensor(v))
    return params, trainable, optim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm, after one warm-up step")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from skyrl_stepwise.inference.weights import weights_file
    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.config import LoRAConfig

    with tempfile.TemporaryDirectory() as tmp:
        def config(lora: bool) -> TrainerConfig:
            cfg = TrainerConfig(model_path=resolve_model_path("smollm2"), micro_batch_tokens=args.micro_batch_tokens,
                                policy_mini_batch_size=args.trajectories, ckpt_dir=os.path.join(tmp, "ckpts"))
            cfg.algorithm.use_kl_loss = False
            cfg.algorithm.tis_ratio_clip_high = None  # synthetic rollouts carry no sampler logprobs
            cfg.lora = LoRAConfig(enabled=lora, rank=args.rank, alpha=2.0 * args.rank)
            return cfg

        arms = {"full": PolicyWorker(config(False)), "lora": PolicyWorker(config(True))}
        vocab = arms["full"].model.config.vocab_size
        batch = merged(search_r1_rollouts(args.trajectories, args.turns, 330, 96, 300, vocab), args.turns)
        times: dict[str, list[float]] = {name: [] for name in arms}
        for step in range(args.steps + 1):
            for name, worker in arms.items():
                start = time.perf_counter()
                worker.train_step(batch)
                if step:  # the first step of each arm is a warm-up
                    times[name].append(time.perf_counter() - start)
        export = {}
        for name, worker in arms.items():
            with weights_file() as path:
                start = time.perf_counter()
                worker.export_weights(str(path), "float32")
                export[name] = time.perf_counter() - start
        held = {name: held_bytes(worker) for name, worker in arms.items()}
        for worker in arms.values():
            worker.shutdown()

    step = {name: statistics.median(t) for name, t in times.items()}
    print(f"SmolLM2-135M, 1 FSDP2 gloo rank, torch threads {torch.get_num_threads()}, LoRA rank {args.rank} "
          f"(all-linear), {len(batch)} samples, {batch.num_loss_tokens()} loss tokens, "
          f"{sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))} tokens, "
          f"median of {args.steps} steps after a warm-up\n")
    print("| | full | LoRA | LoRA / full |")
    print("|---|---:|---:|---:|")
    print(f"| train_step s | {step['full']:.2f} | {step['lora']:.2f} | {step['lora'] / step['full']:.2f} |")
    print(f"| export_weights s (fp32 file) | {export['full']:.2f} | {export['lora']:.2f} | "
          f"{export['lora'] / export['full']:.2f} |")
    for i, label in enumerate(("parameters MiB", "trainable MiB", "AdamW state MiB")):
        f, lo = held["full"][i] / MIB, held["lora"][i] / MIB
        print(f"| {label} | {f:.1f} | {lo:.1f} | {lo / f:.3f} |")
    print("\nsteps s: " + "; ".join(f"{n} {', '.join(f'{t:.2f}' for t in ts)}" for n, ts in times.items()))


if __name__ == "__main__":
    main()
