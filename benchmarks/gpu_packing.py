"""The packed-row GPU path: flex_attention (compiled) rows and tree, exact per architecture, and what the tree saves.

Part 1, exactness: for tiny random models of the windowed and full-attention architectures in tests/arch_zoo.py, the
worker's flex_attention path (policy/packing/flex.py: a BlockMask per layer type, windows in depth) packs the
conformance batch as rows and as a tree; logprobs are compared with each sample forwarded alone (sdpa, the model's own
masks) and gradients with one sample per row. fp32.

Part 2, throughput: a ~0.5B Llama-shaped random model in bf16, GRPO groups whose samples share a long prompt, one
forward + backward per packing (rows/flex, tree/flex, tree/sdpa dense mask), median of 3 after a warm-up; tokens
forwarded and the time ratios are printed side by side.

    python benchmarks/gpu_packing.py            # on a CUDA machine (flex compiles there)
    python benchmarks/gpu_packing.py --device cpu --skip-throughput   # the CPU smoke test (flex forward only)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from arch_zoo import ARCHITECTURES, conformance_batch, tiny_model  # noqa: E402

from skyrl_stepwise.policy.batching import TrainBatch, forward_logprobs, pack_micro_batch  # noqa: E402
from skyrl_stepwise.policy.packing import attention_layout  # noqa: E402
from skyrl_stepwise.policy.packing.flex import register_packed_flex_attention  # noqa: E402

FLEX_ARCHS = ["llama", "qwen3", "mistral", "gemma3_text", "cohere2", "olmo3", "exaone4", "qwen3_moe"]


def packed_logprobs(model, batch, rows, packing, device):
    out = {}
    layout = attention_layout(model)
    for idx in rows:
        mb = pack_micro_batch(batch, idx, packing).to(device)
        out.update(zip(idx, forward_logprobs(model, mb, layout=layout)[0].split(mb.response_lens)))
    return torch.cat([out[i] for i in range(len(batch))])


def flex_packs(arch: str) -> str | None:
    """Why the trainer would not pack this zoo architecture with flex_attention (None: it would, so check it)."""
    from dataclasses import replace

    from skyrl_stepwise.policy.packing import refuse_inexact_attention

    layout = replace(attention_layout(tiny_model(arch, "sdpa")), attn_implementation="flex_attention")
    if layout.one_sample_per_row:
        return f"one sample per row ({layout.why_one_sample_per_row()}): nothing packed to check"
    try:
        refuse_inexact_attention(layout)
    except ValueError as e:
        return f"refused: {str(e)[:120]}"
    return None


def exactness(device: torch.device, with_grads: bool, archs: list[str]) -> list[str]:
    flex = register_packed_flex_attention()
    batch = conformance_batch()
    weights = torch.linspace(-1, 1, sum(map(len, batch.response_ids)), device=device)
    lines = []
    for arch in archs:
        if arch not in ARCHITECTURES:
            continue
        try:
            skip = flex_packs(arch)
            if skip is not None:
                lines.append(f"{arch:14s} flex  {skip}")
                print(lines[-1], flush=True)
                continue
            ref_model = tiny_model(arch, "sdpa").to(device)
            model = tiny_model(arch, "sdpa").to(device)
            model.set_attn_implementation(flex)
            singles = [[i] for i in range(len(batch))]
            with torch.no_grad():
                alone = packed_logprobs(ref_model, batch, singles, "rows", device)
            row = []
            for packing in ("rows", "tree"):
                with torch.set_grad_enabled(with_grads):
                    got = packed_logprobs(model, batch, [list(range(len(batch)))], packing, device)
                err = (got.detach() - alone).abs().max().item()
                grad = ""
                if with_grads:
                    model.zero_grad()
                    (got * weights).sum().backward()
                    g_packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                    ref_model.zero_grad()
                    (packed_logprobs(ref_model, batch, singles, "rows", device) * weights).sum().backward()
                    worst = max(((g_packed[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-12)).item()
                                for n, p in ref_model.named_parameters() if p.grad is not None)
                    grad = f", grad rel {worst:.1e}"
                row.append(f"{packing}: logprob {err:.1e}{grad}")
            lines.append(f"{arch:14s} flex  " + "; ".join(row))
        except Exception as e:  # noqa: BLE001  (a report line per architecture, whatever broke)
            lines.append(f"{arch:14s} flex  ERROR {type(e).__name__}: {str(e)[:200]}")
        print(lines[-1], flush=True)
    return lines


def throughput(device: torch.device, groups: int, per_group: int, prompt_len: int, response_len: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192)
    g = torch.Generator().manual_seed(1)
    prompts, responses, iids = [], [], []
    for k in range(groups):
        p = torch.randint(5, 32000, (prompt_len,), generator=g).tolist()
        for _ in range(per_group):
            prompts.append(p)
            responses.append(torch.randint(5, 32000, (response_len,), generator=g).tolist())
            iids.append(f"q{k}")
    batch = TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * response_len] * len(prompts),
                       instance_ids=iids)
    flex = register_packed_flex_attention()
    results = {}
    for name, packing, attn in (("rows/flex", "rows", flex), ("tree/flex", "tree", flex), ("tree/sdpa", "tree", "sdpa")):
        model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
        model.set_attn_implementation(attn)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mb = pack_micro_batch(batch, list(range(len(batch))), packing).to(device)
        times = []
        try:
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                lp, _ = forward_logprobs(model, mb)
                lp.sum().backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            results[name] = (mb.num_tokens, statistics.median(times[1:]), torch.cuda.max_memory_allocated() / 2**30)
        except Exception as e:  # noqa: BLE001
            results[name] = (mb.num_tokens, float("nan"), float("nan"))
            print(f"{name}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
        del model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = results["rows/flex"][1]
    print(f"\nthroughput: {groups} groups x {per_group} samples, prompt {prompt_len} + response {response_len} tokens, "
          f"~0.5B Llama bf16, forward+backward of one packed row, median of 3 after a warm-up")
    print(f"{'packing':10s} {'tokens':>8s} {'seconds':>8s} {'x rows':>7s} {'peak GiB':>9s}")
    for name, (tokens, sec, mem) in results.items():
        print(f"{name:10s} {tokens:8d} {sec:8.3f} {sec / base:7.2f} {mem:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--archs", nargs="+", default=FLEX_ARCHS,
                    help="zoo architectures to check (`all`: every one in tests/arch_zoo.py)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--response-len", type=int, default=512)
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    exactness(device, with_grads=device.type == "cuda",
              archs=list(ARCHITECTURES) if args.archs == ["all"] else args.archs)
    if not args.skip_throughput and device.type == "cuda":
        throughput(device, args.groups, args.per_group, args.prompt_len, args.response_len)


if __name__ == "__main__":
    main()
