"""Async rollouts (trainer.max_staleness=1) vs the synchronous loop, side by side: seconds per RL step.

The real main job (vLLM engine, one FSDP2 rank in a Ray actor, SmolLM2-135M) on keyword prompts, 4 prompts x 4
samples per step. Overlap only pays where generation and the update do not fight for the same hardware, so by
default the two cores of this box are split the way GPUs are split in `placement.mode=split`: the engine gets one
thread, the policy rank one (`--shared` gives both every core, the colocated case). Arms alternate per repeat;
step 1 is left out of the mean (neither arm has anything to overlap yet).

    python benchmarks/async_rollouts.py                 # 2 repeats x 2 arms x 5 steps, ~12 minutes on 2 cores
    python benchmarks/async_rollouts.py --shared --repeats 1

Measured (2-core AVX2 host, defaults): synchronous 36.6 s per step, async 27.8 s (0.76x); the trainer waited
0.0 s for rollouts async vs 10.6 s of generation synchronously (examples/search_r1/README.md, "Async rollouts").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ARMS = {"synchronous": ["trainer.max_staleness=0"], "async (max_staleness=1)": ["trainer.max_staleness=1"]}
PROMPT = [{"role": "user", "content": "Answer with one word, yes or no: is the sky blue?"}]


def run(arm: list[str], data: Path, out: Path, steps: int, shared: bool) -> list[dict]:
    """One training run through the CLI; its per-step records."""
    threads = [] if shared else ["engine.num_threads=1", "trainer.fsdp.num_threads_per_rank=1"]
    command = [sys.executable, "-m", "skyrl_stepwise.cli.train", "experiment=search_r1_tiny", f"total_steps={steps}",
               f"data.train_path={data}", "data.val_path=", "data.train_batch_size=4", "data.shuffle=false",
               "generator.n_samples_per_prompt=4", "generator.max_turns=2", "generator.sampling.max_generate_length=64",
               "trainer.algorithm.dynamic_sampling=false", "trainer.ckpt_interval=0", "sft.enabled=false",
               "generator.show_progress=false", f"logging.output_dir={out}", "logging.wandb_mode=disabled",
               *threads, *arm]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(arm)}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shared", action="store_true", help="engine and trainer both use every core")
    args = parser.parse_args()

    from skyrl_stepwise.data.dataset import write_parquet

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.parquet"
        write_parquet([{"prompt": PROMPT, "env_class": "keyword", "data_source": "toy", "extra_info": {},
                        "reward_spec": {"ground_truth": {"target": ["yes"]}}, "instance_id": f"yes-{i}"}
                       for i in range(4 * args.steps)], data)
        steps: dict[str, list[dict]] = {name: [] for name in ARMS}
        for repeat in range(args.repeats):
            for name in (list(ARMS) if repeat % 2 == 0 else list(ARMS)[::-1]):
                records = run(ARMS[name], data, Path(tmp) / f"{repeat}-{list(ARMS).index(name)}", args.steps,
                              args.shared)
                steps[name] += records[1:]
                print(f"repeat {repeat + 1} {name}: " + " ".join(f"{r['timing/step_s']:.1f}" for r in records)
                      + " s per step", flush=True)

    cores = "every core shared" if args.shared else "engine 1 thread, policy rank 1 thread"
    print(f"\nsteps 2..{args.steps}, {args.repeats} repeat(s), {cores}")
    print(f"{'arm':<26}{'step s':>8}{'vs sync':>9}{'generate s':>12}{'wait s':>8}{'train s':>9}{'staleness':>11}")
    base = statistics.mean(r["timing/step_s"] for r in steps["synchronous"])
    for name, records in steps.items():
        mean = {key: statistics.mean(r.get(key, 0.0) for r in records)
                for key in ("timing/step_s", "timing/generate_s", "timing/rollout_wait_s", "timing/train_s",
                            "async/staleness")}
        wait = mean["timing/rollout_wait_s"] if "async" in name else mean["timing/generate_s"]
        print(f"{name:<26}{mean['timing/step_s']:>8.1f}{mean['timing/step_s'] / base:>9.2f}"
              f"{mean['timing/generate_s']:>12.1f}{wait:>8.1f}{mean['timing/train_s']:>9.1f}"
              f"{mean['async/staleness']:>11.2f}")


if __name__ == "__main__":
    main()
