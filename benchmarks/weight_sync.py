"""Weight sync per carrier, side by side: seconds per sync and what the driver process holds meanwhile.

One vLLM engine (the tiny recipe's bf16) and one FSDP2 policy rank (a Ray actor, gloo, as in `make run`) on the
embedded SmolLM2-135M. Each repeat runs every arm once, in a rotating order (a host whose speed drifts cannot
charge one arm), and after each sync a probe checks that the engine scores like the trainer (bf16 engine vs the
trainer's mixed precision: differences of ~0.1 are the bf16 rounding, a stale engine shows > 1).

Arms (`weight_sync.method`): file (rank 0 writes /dev/shm, the engine reads), broadcast (gloo group of rank 0 and
the engine worker; bucket sizes from --bucket-mb), driver (the full fp32 state dict through this process).

    python benchmarks/weight_sync.py                     # 5 repeats, buckets of 256 and 16 MB
    python benchmarks/weight_sync.py --repeats 3 --arms file broadcast

About 3 minutes on 2 cores. Measured (2-core AVX2 host, median of 5): file 0.79 s, broadcast 0.91 s (256 MB
buckets) / 1.09 s (16 MB), driver 7.05 s with +1094 MB in the driver process; the other arms add nothing there.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import psutil

MB = 2**20


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from skyrl_stepwise.inference.config import EngineConfig
    from skyrl_stepwise.inference.vllm_engine import VLLMEngine, ensure_ray
    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.weight_sync import WeightSync, WeightSyncConfig, probe_logprobs
    from skyrl_stepwise.policy.worker_group import PolicyGroup

    model = str(resolve_model_path("smollm2"))
    ensure_ray()
    engine = VLLMEngine(EngineConfig(model_path=model, dtype="bfloat16", cpu_kvcache_gib=0.25, max_model_len=1024))
    policy = PolicyGroup(TrainerConfig(model_path=model, ckpt_dir="/tmp/unused"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    probe = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                    tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    arms: dict[str, WeightSync] = {}
    for arm in args.arms:
        if arm == "broadcast":
            for mb in args.bucket_mb:
                arms[f"broadcast {mb:g} MB"] = WeightSync(WeightSyncConfig(method="broadcast", bucket_mb=mb),
                                                          policy, engine)
        else:
            arms[arm] = WeightSync(WeightSyncConfig(method=arm), policy, engine)
    driver = psutil.Process()
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    driver_growth: dict[str, float] = {name: 0.0 for name in arms}
    probe_diff: dict[str, float] = {name: 0.0 for name in arms}
    names = list(arms)
    try:
        for _ in range(args.warmup):  # the first broadcast of each arm forms its group: not a steady-state sync
            for name in names:
                await arms[name].sync()
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                rss = driver.memory_info().rss
                start = time.perf_counter()
                await arms[name].sync()
                seconds[name].append(time.perf_counter() - start)
                driver_growth[name] = max(driver_growth[name], (driver.memory_info().rss - rss) / MB)
                result = await probe_logprobs(policy, engine, probe)
                probe_diff[name] = max(probe_diff[name], result.max_abs_diff)
    finally:
        policy.shutdown()
        engine.shutdown()
    base = statistics.median(seconds[names[0]])
    print(f"\nweight sync, SmolLM2-135M, bf16 engine, 1 gloo policy rank; {args.repeats} repeats, "
          f"median [min, max]\n")
    print(f"| arm | seconds per sync | vs {names[0]} | driver RSS growth (MB, max) | probe max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        s = seconds[name]
        print(f"| {name} | {statistics.median(s):.2f} [{min(s):.2f}, {max(s):.2f}] | "
              f"{statistics.median(s) / base:.2f} | {driver_growth[name]:.0f} | {probe_diff[name]:.3f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["file", "broadcast", "driver"],
                        choices=["file", "broadcast", "driver"])
    parser.add_argument("--bucket-mb", nargs="+", type=float, default=[256, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
