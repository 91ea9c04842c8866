"""Generated tokens/s of each engine at 1, 8 and 32 concurrent requests, as a markdown table.

Each request samples (temperature 1, its own seed) up to --max-tokens tokens from a chat prompt;
tokens/s = all generated tokens / wall time of the concurrent batch, after a small warm-up batch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

import torch
from tqdm import tqdm

from skyrl_stepwise.inference import EngineConfig, SamplingParams, create_engine
from skyrl_stepwise.models.prepare import resolve_model_path

QUESTIONS = [  # open-ended, so most answers run to max_tokens and tokens/s measures decoding, not setup
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle works, step by step.",
    "Describe your ideal city in detail.", "Write a letter to a friend about a trip to the mountains.",
    "Explain recursion to a child with several examples.", "Describe the water cycle in detail.",
    "Write a poem about the ocean with at least four stanzas.", "Give a detailed recipe for pancakes.",
]


async def _measure(engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[int, float]:
    requests = [engine.generate(prompts[i % len(prompts)], SamplingParams(max_tokens=max_tokens, seed=i))
                for i in range(concurrency)]
    start = time.perf_counter()
    results = await asyncio.gather(*requests)
    return sum(len(r.token_ids) for r in results), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Print one table row per (engine, concurrency); engines run one after the other, never together."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", nargs="+", default=["vllm", "transformers"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    model_path = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in QUESTIONS]
    rows = []
    for backend in args.backends:
        engine = create_engine(EngineConfig(backend=backend, model_path=model_path, dtype=args.dtype,
                                            max_model_len=2048, max_batch_size=max(args.concurrency)))
        try:
            asyncio.run(_measure(engine, prompts, 2, 16))  # warm-up: first-request setup is not throughput
            for concurrency in tqdm(args.concurrency, desc=backend):
                tokens, seconds = asyncio.run(_measure(engine, prompts, concurrency, args.max_tokens))
                rows.append((backend, concurrency, tokens, seconds))
        finally:
            if hasattr(engine, "shutdown"):
                engine.shutdown()

    try:
        import vllm
        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "not installed"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU x{os.cpu_count()} ({platform.machine()})"
    print(f"\nmodel: SmolLM2-135M-Instruct (embedded), dtype {args.dtype}, max_tokens {args.max_tokens}, "
          f"machine: {device}, torch {torch.__version__}, vllm {vllm_version}, "
          f"1-min load average at the end {os.getloadavg()[0]:.1f} (other processes share these cores)\n")
    print("| engine | concurrent requests | generated tokens | wall s | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for backend, concurrency, tokens, seconds in rows:
        print(f"| {backend} | {concurrency} | {tokens} | {seconds:.2f} | {tokens / seconds:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
