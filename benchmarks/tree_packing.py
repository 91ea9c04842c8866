"""Prefix-tree packing vs plain rows: the real PolicyWorker on the same rollouts, arms interleaved.

Arms, each a `train_step` from one snapshot (same weights, fresh AdamW, same RNG):
  rows/step_wise   the step-wise samples packed as rows (every sample's prompt and history forwarded again)
  rows/merged      the same rollouts merged into one sample per chain (generator.merge_stepwise_output)
  tree/step_wise   the step-wise samples packed as prefix tries (trainer.packing=tree)
Arms run round-robin (rep 1: a b c, rep 2: a b c, ...) so a load change on a shared machine hits every arm alike.

Shapes (token-exact prompts from this repo's renderers and the embedded SmolLM2 tokenizer; response and observation
ids are random tokens of the recipes' lengths, since rollouts need an engine):
  search_r1_tiny        the Search-R1 instruction prompt + a question; `<search>` turns, <information> observations
  search_r1_tools_tiny  the tool recipe's system prompt + the OpenAI schemas of search and calculator, rendered by
                        the chat template (the long shared prompt), then the question
Each prompt gets `--samples` trajectories of 1..`--max-turns` turns with exact history (step k+1 extends step k).

    python benchmarks/tree_packing.py                      # CPU: SmolLM2-135M fp32, sdpa, a few minutes
    python benchmarks/tree_packing.py --prompts 4 --reps 3 # closer to the tiny recipe's batch (slow on 2 cores)
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

import torch


def rollouts(shape: str, tokenizer, prompts: int, samples: int, max_turns: int, response_len: int, obs_len: int,
             seed: int = 0):
    """Step-wise GeneratorOutput of synthetic rollouts on real rendered prompts, with outcome rewards."""
    from skyrl_stepwise.chat import create_renderer
    from skyrl_stepwise.data import search_r1_prompt
    from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
    from skyrl_stepwise.tools.builtin import CalculatorTool, SearchTool

    rng = random.Random(seed)
    renderer = create_renderer(tokenizer)
    questions = ["who wrote the play hamlet", "what is the capital of australia", "when did the berlin wall fall",
                 "which planet has the most moons", "who painted the mona lisa", "what is the boiling point of water"]
    cols: dict[str, list] = {k: [] for k in ("p", "r", "rw", "m", "lp", "tid", "last")}
    vocab = [t for t in range(tokenizer.vocab_size) if t not in tokenizer.all_special_ids]
    for q in range(prompts):
        question = questions[q % len(questions)]
        if shape == "search_r1_tiny":
            prompt = renderer.prompt_ids(search_r1_prompt(question))
        else:
            system = ("You answer questions. When you need a fact, call the search tool; you may search several "
                      "times. When you know the answer, reply with just the answer inside <answer> and </answer>, "
                      "with no tool call.")
            prompt = renderer.prompt_ids([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                         [SearchTool().schema, CalculatorTool().schema])
        for s in range(samples):
            history, turns = list(prompt), rng.randint(1, max_turns)
            reward = float(rng.random() < 0.5)
            for k in range(turns):
                response = rng.choices(vocab, k=rng.randint(response_len // 2, response_len))
                last = k == turns - 1
                rewards = [0.0] * (len(response) - 1) + [reward if last else 0.0]
                for key, v in zip(cols, (list(history), response, rewards, [1] * len(response),
                                         [-1.0] * len(response), TrajectoryID(f"q{q}", s), last)):
                    cols[key].append(v)
                history += response + rng.choices(vocab, k=obs_len)
    return GeneratorOutput(prompt_token_ids=cols["p"], response_ids=cols["r"], rewards=cols["rw"],
                           loss_masks=cols["m"], rollout_logprobs=cols["lp"], trajectory_ids=cols["tid"],
                           is_last_step=cols["last"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["search_r1_tiny", "search_r1_tools_tiny"])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt (n_samples_per_prompt)")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--obs-len", type=int, default=96)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024, help="the tiny recipe's budget")
    parser.add_argument("--reps", type=int, default=2, help="timed updates per arm, interleaved (after 1 warm-up)")
    parser.add_argument("--attn", default="sdpa")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from skyrl_stepwise.cli.ablate import measure
    from skyrl_stepwise.generator.merge import merge_stepwise_output
    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.algorithms.credit import compute_advantages
    from skyrl_stepwise.policy.batching import TrainBatch

    path = resolve_model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as ckpt:
        cfg = TrainerConfig(model_path=str(path), micro_batch_tokens=args.micro_batch_tokens, ckpt_interval=0,
                            ckpt_dir=ckpt, attn_implementation=args.attn, packing="rows")
        cfg.algorithm.use_kl_loss = False
        cfg.algorithm.tis_ratio_clip_high = None
        cfg.fsdp.mixed_precision = False  # fp32: the CPU's bf16 is emulated (and the acceptance tests are fp32)
        worker = PolicyWorker(cfg)
    worker.snapshot()
    print(f"SmolLM2-135M fp32, {'cuda' if cuda else 'cpu'} ({torch.get_num_threads()} threads), attention {args.attn}, "
          f"micro-batch {args.micro_batch_tokens} tokens; {args.prompts} prompts x {args.samples} samples, 1-"
          f"{args.max_turns} turns (response <= {args.response_len}, observation {args.obs_len} tokens); "
          f"median of {args.reps} interleaved updates per arm after one warm-up each\n")
    print("| shape | arm | samples | real tokens | forward tokens | unique tokens | rows | update s | peak MiB | "
          "fwd vs merged | time vs merged |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes:
        stepwise = rollouts(shape, tokenizer, args.prompts, args.samples, args.max_turns, args.response_len,
                            args.obs_len)
        algo = cfg.algorithm
        arms = {}
        for name, samples, packing in (("rows/step_wise", stepwise, "rows"),
                                       ("rows/merged", merge_stepwise_output(stepwise), "rows"),
                                       ("tree/step_wise", stepwise, "tree")):
            arms[name] = (TrainBatch.from_output(samples, compute_advantages(samples, algo)), packing)
        results: dict[str, list] = {name: [] for name in arms}
        for rep in range(args.reps + 1):
            for name, (batch, packing) in arms.items():
                worker.restore_snapshot()
                worker.set_packing(packing)
                metrics, seconds, peak = measure(lambda: worker.train_step(batch))
                if rep:  # rep 0 warms each arm up (allocator, thread pools, the mask path)
                    results[name].append((metrics, seconds, peak))
        base = results["rows/merged"]
        base_fwd, base_s = base[0][0]["train/forward_tokens"], statistics.median(r[1] for r in base)
        for name, runs in results.items():
            m = runs[0][0]
            seconds = statistics.median(r[1] for r in runs)
            peak = max(r[2] for r in runs)
            print(f"| {shape} | {name} | {len(arms[name][0])} | {m['train/real_tokens']:.0f} | "
                  f"{m['train/forward_tokens']:.0f} | {m['train/unique_tokens']:.0f} | "
                  f"{m['train/num_micro_batches']:.0f} | {seconds:.1f} | {peak:.0f} | "
                  f"{m['train/forward_tokens'] / base_fwd:.2f}x | {seconds / base_s:.2f}x |", flush=True)
    worker.shutdown()


if __name__ == "__main__":
    main()
