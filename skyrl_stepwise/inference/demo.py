"""`skyrl-stepwise demo`: the smallest end-to-end proof that the stack works on this machine.

Prepares the model (the embedded one, a folder, or a .gguf file converted once), starts an engine, sends chat
prompts as token ids, prints the replies and the generated tokens/s. Library output (vLLM's start-up and
weight-loading lines) goes to `<log dir>/run.log`, as in `train`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from skyrl_stepwise.inference import EngineConfig, SamplingParams, create_engine
from skyrl_stepwise.models.prepare import resolve_model_path

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Write a haiku about rain.",
    "Explain what a token is in one sentence.",
]


async def _run(engine, tokenizer, max_tokens: int, temperature: float) -> None:
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         return_dict=False) for p in PROMPTS]
    await engine.generate(ids[0], SamplingParams(max_tokens=1))  # warm-up: first-request setup is not throughput
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, sampling, session_id=str(i)) for i, p in enumerate(ids)))
    elapsed = time.perf_counter() - start
    for question, result in zip(PROMPTS, results):
        answer = tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
        print(f"\n> {question}\n{answer}\n[{len(result.token_ids)} tokens, finish_reason={result.finish_reason}]")
    generated = sum(len(r.token_ids) for r in results)
    print(f"\n{generated} tokens for {len(results)} concurrent requests in {elapsed:.2f} s: "
          f"{generated / elapsed:.1f} generated tokens/s")


def _demo(args: argparse.Namespace) -> None:
    """Resolve the model, start the engine, generate; the chat format line says how the template was adapted."""
    from transformers import AutoTokenizer

    from skyrl_stepwise.chat import create_renderer
    from skyrl_stepwise.chat.adaptation import describe_chat_adaptation

    model_path = resolve_model_path(args.model)
    print(f"model: {model_path}")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    print(describe_chat_adaptation(create_renderer(tokenizer)))
    cfg = EngineConfig(backend=args.backend, model_path=model_path, dtype=args.dtype, max_model_len=2048)
    start = time.perf_counter()
    engine = create_engine(cfg)
    print(f"{args.backend} engine ready in {time.perf_counter() - start:.1f} s")
    try:
        asyncio.run(_run(engine, tokenizer, args.max_tokens, args.temperature))
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run the demo; `--backend transformers` shows the same flow without vLLM."""
    parser = argparse.ArgumentParser(prog="skyrl-stepwise demo", description=__doc__)
    parser.add_argument("--backend", choices=["vllm", "transformers"], default="vllm")
    parser.add_argument("--model", default=None,
                        help="model folder, .gguf file (converted once, cached) or hub id (default: embedded SmolLM2)")
    parser.add_argument("--log-dir", default=None, help="where run.log goes (default: <cache>/demo)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args(argv)

    from skyrl_stepwise.host.logs import run_logging
    from skyrl_stepwise.models.prepare import cache_root

    log_dir = Path(args.log_dir) if args.log_dir else cache_root() / "demo"
    with run_logging(log_dir) as run_log:
        print(f"library output: {run_log}")
        _demo(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
