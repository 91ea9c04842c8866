"""FSDP2 policy-update throughput and MFU of the real PolicyWorker, step-wise vs merged samples.

The batch has the shape of Search-R1 rollouts: every trajectory is `--turns` steps; step k's prompt is the
first prompt plus every earlier response and observation. The same rollouts are trained twice: as
step-wise samples (one per turn, prompts re-read every turn) and merged (one per trajectory,
observations masked). Both give the same loss (tests/test_fsdp_worker.py); this prints what each costs.

MFU counts the model FLOPs of the tokens the forward actually ran (dense matmuls 6*N per token, causal
attention 6*L*d*S^2 per packed sample, LM head only on response positions) over the GPU's peak dense
bf16 FLOP/s. Weights are random (no model hub): throughput does not depend on their values.

    python benchmarks/fsdp_throughput.py --model qwen2.5-1.5b   # on a GPU
    python benchmarks/fsdp_throughput.py --model smollm2-135m --trajectories 4 --steps 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

# name -> (config class, config kwargs); the published shapes of these models.
MODELS = {
    "smollm2-135m": ("LlamaConfig", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                                         tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                         tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                         tie_word_embeddings=True)),
    "qwen2.5-3b": ("Qwen2Config", dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                                       num_key_value_heads=2, intermediate_size=11008, vocab_size=151936,
                                       tie_word_embeddings=True)),
}
# Peak dense bf16 tensor FLOP/s (no sparsity), from the vendors' data sheets.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def write_random_model(name: str, folder: str) -> None:
    """A random-init model with the named shapes, saved as an HF folder the PolicyWorker can load."""
    import transformers

    cls_name, kwargs = MODELS[name]
    config = getattr(transformers, cls_name)(**kwargs, max_position_embeddings=32768)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def search_r1_rollouts(trajectories: int, turns: int, prompt_len: int, response_len: int, obs_len: int,
                       vocab: int, seed: int = 0):
    """Step-wise samples of `trajectories` synthetic multi-turn rollouts (2 per prompt), with advantages."""
    from skyrl_stepwise.policy.batching import TrainBatch

    rng = random.Random(seed)
    batch = TrainBatch([], [], [], [], advantages=[])
    for t in range(trajectories):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        advantage = rng.choice([-1.0, 1.0])
        for k in range(turns):
            response = [rng.randrange(vocab) for _ in range(response_len)]
            batch.prompt_ids.append(list(prompt))
            batch.response_ids.append(response)
            batch.loss_masks.append([1] * response_len)
            batch.instance_ids.append(f"q{t // 2}")
            batch.advantages.append([advantage] * response_len)
            prompt += response + [rng.randrange(vocab) for _ in range(obs_len)]
    return batch


def merged(batch, turns: int):
    """The same rollouts as one sample per trajectory: observations join the response, masked out."""
    from skyrl_stepwise.policy.batching import TrainBatch

    out = TrainBatch([], [], [], [], advantages=[])
    for s in range(0, len(batch), turns):
        last = s + turns - 1
        prompt = batch.prompt_ids[s]
        full = batch.prompt_ids[last] + batch.response_ids[last]
        mask, adv = [], []
        pos = len(prompt)
        for k in range(s, s + turns):
            gap = len(batch.prompt_ids[k]) - pos  # observation tokens before this step's response
            mask += [0] * gap + batch.loss_masks[k]
            adv += [0.0] * gap + batch.advantages[k]
            pos = len(batch.prompt_ids[k]) + len(batch.response_ids[k])
        out.prompt_ids.append(prompt)
        out.response_ids.append(full[len(prompt):])
        out.loss_masks.append(mask)
        out.instance_ids.append(batch.instance_ids[s])
        out.advantages.append(adv)
    return out


def model_flops(batch, micro_batches, n_params_dense: int, layers: int, hidden: int, vocab: int,
                packing: str = "rows") -> float:
    """Forward+backward FLOPs of what the model ran: packed rows through the trunk, responses through the head.

    packing=tree: the trunk runs each trie node once and a node attends to its ancestors (depth + 1 keys, what
    flex_attention's block mask computes up to block granularity), vs (q + 1) keys at position q of a causal row.
    """
    head = 6 * hidden * vocab * sum(len(r) for r in batch.response_ids)
    if packing == "tree":
        from skyrl_stepwise.policy.tree import build_trie

        tries = [build_trie([batch.prompt_ids[i] + batch.response_ids[i] for i in mb]) for mb in micro_batches]
        tokens = sum(max(1, len(t)) for t in tries)
        attention = sum(12 * layers * hidden * (d + 1) for t in tries for d in t.depths)
        return 6 * n_params_dense * tokens + attention + head
    lens = batch.seq_lens()
    tokens = sum(max(1, sum(lens[i] for i in mb)) for mb in micro_batches)
    attention = sum(6 * layers * hidden * lens[i] ** 2 for mb in micro_batches for i in mb)
    return 6 * n_params_dense * tokens + attention + head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # defaults: the GPU measurement on a GPU; a CPU smoke run (minutes, not hours) elsewhere, e.g. `make bench`
    cuda = torch.cuda.is_available()
    parser.add_argument("--model", default="qwen2.5-1.5b" if cuda else "smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--trajectories", type=int, default=32 if cuda else 4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=160)
    parser.add_argument("--obs-len", type=int, default=384)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384 if cuda else 1024)
    parser.add_argument("--steps", type=int, default=3 if cuda else 1,
                        help="timed optimizer steps per mode (after 1 warm-up)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--attn", default="sdpa", help="trainer.attn_implementation: sdpa | flex_attention | ...")
    parser.add_argument("--tree", action="store_true",
                        help="also train the step-wise samples with trainer.packing=tree (a worker of its own: with "
                             "flex_attention the tree loads its own attention; measured on an H200, README)")
    args = parser.parse_args()

    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.batching import rank_micro_batches

    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in device_name), None)
    with tempfile.TemporaryDirectory() as folder:
        write_random_model(args.model, folder)
        cfg = TrainerConfig(model_path=folder, micro_batch_tokens=args.micro_batch_tokens, ckpt_interval=0,
                            policy_mini_batch_size=args.trajectories, attn_implementation=args.attn)
        cfg.algorithm.use_kl_loss = False
        cfg.algorithm.tis_ratio_clip_high = None
        cfg.fsdp.gradient_checkpointing = args.gradient_checkpointing
        worker = PolicyWorker(cfg)
    mcfg = worker.model.config
    n_total = sum(p.numel() for p in worker.model.parameters())
    n_dense = n_total - mcfg.vocab_size * mcfg.hidden_size  # the embedding lookup is not a matmul

    stepwise = search_r1_rollouts(args.trajectories, args.turns, args.prompt_len, args.response_len, args.obs_len,
                                  mcfg.vocab_size)
    print(f"model {args.model} ({n_total / 1e9:.2f} B params, random init), {device_name}, FSDP2 world 1, "
          f"bf16 params / fp32 reduce, grad ckpt {args.gradient_checkpointing}, attention {args.attn}, micro-batch "
          f"{args.micro_batch_tokens} tokens; {args.trajectories} trajectories x "
          f"{args.turns} turns (prompt {args.prompt_len}, response {args.response_len}, observation {args.obs_len})\n")
    print("| samples | n | forward tokens | loss tokens | step s | forward tok/s | TFLOP/s | MFU | peak GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    arms = [("step-wise", stepwise, "rows"), ("merged", merged(stepwise, args.turns), "rows")]
    if args.tree:
        arms.append(("step-wise tree", stepwise, "tree"))
    for label, batch, packing in arms:
        if packing != worker.cfg.packing and args.attn == "flex_attention":  # tree loads its own flex attention
            del worker
            with tempfile.TemporaryDirectory() as folder:
                write_random_model(args.model, folder)
                cfg.model_path, cfg.packing = folder, packing
                worker = PolicyWorker(cfg)  # joins the process group the first worker started
        worker.set_packing(packing)
        micro = rank_micro_batches(batch, 0, 1, args.micro_batch_tokens, packing)
        flops = model_flops(batch, micro, n_dense, mcfg.num_hidden_layers, mcfg.hidden_size, mcfg.vocab_size,
                            packing)
        worker.train_step(batch)  # warm-up: allocator, kernels
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            metrics = worker.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        tflops = flops / seconds / 1e12
        mfu = f"{flops / seconds / peak:.1%}" if peak else "n/a"
        mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        print(f"| {label} | {len(batch)} | {metrics['train/forward_tokens']:.0f} | {batch.num_loss_tokens()} | "
              f"{seconds:.2f} | {metrics['train/forward_tokens'] / seconds:,.0f} | {tflops:.1f} | {mfu} | {mem:.1f} |")
    worker.shutdown()


if __name__ == "__main__":
    main()
