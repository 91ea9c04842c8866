"""One policy update with and without trainer.fsdp.accumulate_unsharded, arms alternated, ratio printed.

Why: at one FSDP2 rank every micro-batch used to gather each layer (a copy, and a bf16 cast under mixed precision),
gather it again for the backward and reduce its gradient (more copies): ~18% of a SmolLM2 update on the 2-core CPU.
With accumulate_unsharded a step gathers once and reduces once; the weights are the same to the bit
(tests/test_fsdp_worker.py). This measures what that is worth on this host, in fp32 (the path of a CPU without native
bf16) and, where the CPU has native bf16, in bf16 mixed precision.

The batch is shaped like the main job's update (4 prompts x 4 samples, a 180-token prompt, 1-3 turns of 30-70
sampled tokens with a 220-token observation between them, merged), packed as the job packs it (trainer.packing=auto).
Both arms live in one process, one after the other per round, so drift of the host hits both.

    python benchmarks/update_accumulation.py                 # 4 rounds, each arm 2 steps a round
    python benchmarks/update_accumulation.py --rounds 2 --dtypes fp32
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time


def main_job_batch(vocab: int, seed: int = 0):
    """4 groups of 4 merged trajectories with the main job's lengths (observations masked)."""
    from skyrl_stepwise.policy.batching import TrainBatch

    rng = random.Random(seed)
    batch = TrainBatch([], [], [], [], advantages=[])
    for group in range(4):
        prompt = [rng.randrange(vocab) for _ in range(180)]
        for _ in range(4):
            turns, response, mask = rng.choice([1, 2, 2, 2, 3]), [], []
            for k in range(turns):
                sampled = rng.randint(30, 70)
                response += [rng.randrange(vocab) for _ in range(sampled)]
                mask += [1] * sampled
                if k < turns - 1:
                    response += [rng.randrange(vocab) for _ in range(220)]
                    mask += [0] * 220
            advantage = rng.choice([-1.0, 1.0])
            batch.prompt_ids.append(prompt)
            batch.response_ids.append(response)
            batch.loss_masks.append(mask)
            batch.instance_ids.append(f"q{group}")
            batch.advantages.append([advantage * m for m in mask])
    return batch


def worker(accumulate: bool, bf16: bool, model_path: str):
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = TrainerConfig(model_path=model_path, micro_batch_tokens=1024, policy_mini_batch_size=16,
                        ckpt_dir=tempfile.mkdtemp())
    cfg.algorithm.use_kl_loss = False
    cfg.algorithm.tis_ratio_clip_high = None  # synthetic rollouts carry no sampler logprobs
    cfg.fsdp.mixed_precision, cfg.fsdp.accumulate_unsharded = bf16, accumulate
    return PolicyWorker(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="updates per arm per round")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import torch

    from skyrl_stepwise.host.hardware import cpu_bf16_is_native

    native = cpu_bf16_is_native()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"host: {cpu}, {os.cpu_count()} cores, native bf16: {native}; torch {torch.__version__}")
    for dtype in args.dtypes:
        if dtype == "bf16" and not native:
            print("bf16: skipped (this CPU has no native bf16; mixed precision would fall back to fp32)")
            continue
        arms = {False: worker(False, dtype == "bf16", args.model), True: worker(True, dtype == "bf16", args.model)}
        batch = main_job_batch(arms[False].model.config.vocab_size)
        for w in arms.values():  # warm-up: the first step allocates
            w.train_step(batch)
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for accumulate in ((False, True) if r % 2 == 0 else (True, False)):
                for _ in range(args.steps):
                    start = time.perf_counter()
                    arms[accumulate].train_step(batch)
                    times[accumulate].append(time.perf_counter() - start)
        for w in arms.values():
            w.shutdown()
        per_mb = arms[False].packing_summary()
        plain, held = statistics.median(times[False]), statistics.median(times[True])
        print(f"{dtype}: {len(times[False])} updates per arm, packing {per_mb.get('packing', '?')}; "
              f"per micro-batch {plain:.2f} s median [{min(times[False]):.2f}-{max(times[False]):.2f}], "
              f"accumulate_unsharded {held:.2f} s [{min(times[True]):.2f}-{max(times[True]):.2f}]: "
              f"ratio {held / plain:.3f}")
        print(f"  seconds per update, in order: per micro-batch {[round(t, 1) for t in times[False]]}, "
              f"accumulate_unsharded {[round(t, 1) for t in times[True]]}")


if __name__ == "__main__":
    main()
