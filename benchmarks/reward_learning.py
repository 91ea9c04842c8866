"""Can the loop learn? A toy reward SmolLM2-135M can pick up on CPU: answer with the word "blue".

Trains the real stack (vLLM engine, FSDP2 workers on Ray, GRPO) on KeywordEnv prompts and prints
the reward per step; the reward should rise clearly over the run.

    python benchmarks/reward_learning.py [--steps 12] [extra hydra overrides...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

PROMPTS = ["Name a color.", "What color is the sky on a clear day?", "Tell me your favourite colour.",
           "Pick a color for a new car.", "Which color do you like?", "Say a color, any color."]


def write_dataset(path: Path) -> Path:
    from skyrl_stepwise.data.dataset import write_parquet

    rows = [{"prompt": [{"role": "user", "content": p + " Answer in one word."}], "env_class": "keyword",
             "reward_spec": {"ground_truth": {"target": ["blue"]}}, "data_source": "toy", "extra_info": {},
             "instance_id": f"color-{i}"} for i, p in enumerate(PROMPTS)]
    write_parquet(rows, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args, overrides = parser.parse_known_args()
    from skyrl_stepwise.cli.train import load_config, run

    out = Path(tempfile.mkdtemp(prefix="reward_learning_"))
    cfg = load_config(["experiment=search_r1_tiny", f"total_steps={args.steps}",
                       f"data.train_path={write_dataset(out / 'train.parquet')}", "data.val_path=", "sft.enabled=false",
                       "data.train_batch_size=3", "generator.n_samples_per_prompt=8", "generator.max_turns=1",
                       "generator.sampling.max_generate_length=16", "generator.sampling.stop=[]",
                       "trainer.optim.lr=2e-5", "trainer.ckpt_interval=0", "trainer.policy_mini_batch_size=3",
                       f"logging.output_dir={out}", "logging.wandb_mode=disabled", *overrides])
    import json

    run(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print("\n| step | reward (mean of 24 samples) | pass@8 | train s |\n|---:|---:|---:|---:|")
    for r in records:
        print(f"| {r['step']} | {r['reward/mean']:.3f} | {r['reward/pass_at_n']:.2f} | {r['timing/train_s']:.1f} |")
    k = max(1, len(records) // 3)
    first = sum(r["reward/mean"] for r in records[:k]) / k
    last = sum(r["reward/mean"] for r in records[-k:]) / k
    print(f"\nmean reward, first {k} steps: {first:.3f}; last {k} steps: {last:.3f}; ratio {last / max(first, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
