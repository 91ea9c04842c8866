"""LoRA vs full fine-tuning on the main job's shape: the update step side by side, and what each arm learns.

Two parts, one command each:

    python benchmarks/lora_vs_full.py                     # the update step: 4 trajectories x 3 turns, 3 timed steps
    python benchmarks/lora_vs_full.py --learning          # the main job twice: full RL and LoRA RL
    python benchmarks/lora_vs_full.py --export-only       # the weight export for the engines alone, 3 turns each

The update step (default): both arms are built in one process from the same weights (SmolLM2-135M, one FSDP2 gloo
rank) and take their train_steps alternately (full, LoRA, full, ...) on the same batch, shaped like the tiny
Search-R1 run's rollouts (merged: one sample per trajectory), so the host's load falls on both alike. Printed:
seconds per train_step (median after one warm-up step), the weight export for the engines (LoRA merges the adapter
into full weights first), and the bytes each arm holds between steps (parameters, AdamW state), LoRA / full ratios.

The learning (--learning): the main job (`experiment=search_r1_tiny`) as `make run` runs it, and again with
`trainer.lora.enabled=true sft.lora=false trainer.lora.lr=<--lora-lr>`: both arms RL from the same cached SFT warm
start (sft.lora=false: the LoRA arm's SFT is the full arm's, one cache key) and are evaluated greedily on the same
128 prompts. Printed per arm: the paired RL - SFT interval, RL step / update / weight-sync seconds (medians over the
steps), and the paired LoRA - full difference after RL. `--full-run DIR` / `--lora-run DIR` read finished runs
(e.g. a `make run` output folder) instead of running that arm. About 40 min per arm on a 2-core CPU without bf16
(the first arm pays the SFT; the base-model eval is skipped in both).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_throughput import merged, search_r1_rollouts  # noqa: E402

MIB = 2**20


def export_times(arms: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each arm's export_weights (the fp32 file the engines load; LoRA merges W + scaling * B @ A first),
    the arms taking turns `repeats` times, so the host's load falls on both alike."""
    from skyrl_stepwise.inference.weights import weights_file

    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, worker in arms.items():
            with weights_file() as path:
                start = time.perf_counter()
                worker.export_weights(str(path), "float32")
                times[name].append(time.perf_counter() - start)
    return times


def held_bytes(worker) -> tuple[int, int, int]:
    """(all parameters, trainable parameters, AdamW state) bytes on this rank."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * local(p).element_size() for p in worker.model.parameters())
    trainable = sum(local(p).numel() * local(p).element_size() for p in worker.model.parameters() if p.requires_grad)
    optim = sum(local(v).numel() * local(v).element_size() for s in worker.optimizer.state.values()
                for v in s.values() if torch.is_tensor(v))
    return params, trainable, optim


REPO = Path(__file__).resolve().parent.parent
MAIN_JOB = ["experiment=search_r1_tiny", "data.max_base_eval_prompts=0"]  # the base model's eval is not compared


def arm_overrides(arm: str, lora_lr: float, rank: int | None) -> list[str]:
    """The main job's overrides for one arm: LoRA RL starts from the full arm's SFT warm start (sft.lora=false)."""
    if arm == "full":
        return list(MAIN_JOB)
    lora = MAIN_JOB + ["trainer.lora.enabled=true", "sft.lora=false", f"trainer.lora.lr={lora_lr}"]
    return lora + ([f"trainer.lora.rank={rank}", f"trainer.lora.alpha={2.0 * rank}"] if rank else [])


def run_arm(arm: str, out: Path, overrides: list[str]) -> Path:
    """Run the main job for one arm into out/<arm> (its console passes through) and return the run dir."""
    import subprocess

    run_dir = out / arm
    command = [sys.executable, "-m", "skyrl_stepwise.cli.train", *overrides, f"hydra.run.dir={run_dir}",
               f"logging.run_name=lora_vs_full_{arm}"]
    print(f"\n== {arm}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    (run_dir / "wall_seconds.txt").write_text(f"{time.perf_counter() - start:.0f}\n")
    return run_dir


def arm_summary(run_dir: Path) -> dict:
    """What one finished main-job run says: its evals, RL step timings and the paired RL - SFT line."""
    import json

    from skyrl_stepwise.loop.evaluation import load_evals, paired_bootstrap

    evals = load_evals(run_dir)
    sft = next((r for r in evals if r.stage == "after SFT"), None)
    rl = next((r for r in reversed(evals) if r.stage.startswith("after RL")), None)
    if sft is None or rl is None:
        raise SystemExit(f"{run_dir}: evals.json has no 'after SFT' and 'after RL' stages "
                         f"(found {[r.stage for r in evals]}): the run did not finish")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]

    def median(key: str) -> float:
        values = [m[key] for m in steps if isinstance(m.get(key), (int, float))]
        return statistics.median(values) if values else float("nan")

    wall = run_dir / "wall_seconds.txt"
    return {"sft": sft, "rl": rl, "paired": paired_bootstrap(rl.scores, sft.scores), "steps": len(steps),
            "step_s": median("timing/step_s"), "train_s": median("timing/train_s"),
            "sync_s": median("timing/weight_sync_s"), "generate_s": median("timing/generate_s"),
            "rl_s": sum(m.get("timing/step_s", 0.0) for m in steps),
            "wall_s": float(wall.read_text()) if wall.is_file() else float("nan")}


def learning(args) -> None:
    """Both arms of the main job (or finished runs of them), then one table."""
    from skyrl_stepwise.loop.evaluation import paired_bootstrap, transitions

    out = Path(args.out or tempfile.mkdtemp(prefix="lora_vs_full_"))
    dirs = {"full": args.full_run, "lora": args.lora_run}
    for arm in ("full", "lora"):
        if dirs[arm] is None:
            dirs[arm] = run_arm(arm, out, arm_overrides(arm, args.lora_lr, args.rank))
    runs = {arm: arm_summary(Path(d)) for arm, d in dirs.items()}
    full, lora = runs["full"], runs["lora"]
    if full["sft"].scores != lora["sft"].scores:
        print("note: the arms' after-SFT evals differ: they did not start from the same warm start, or the "
              "engine's greedy decoding is not deterministic across runs")
    print(f"\nThe main job (experiment=search_r1_tiny), full RL vs LoRA RL (rank {args.rank or 8}, lr "
          f"{args.lora_lr:g}) from one SFT warm start; runs: full {dirs['full']}, LoRA {dirs['lora']}\n")
    print("| | full | LoRA | LoRA / full |")
    print("|---|---:|---:|---:|")
    for label, key in (("RL step s (median)", "step_s"), ("update s (median)", "train_s"),
                       ("weight sync s (median)", "sync_s"), ("generation s (median)", "generate_s"),
                       ("RL steps s (sum)", "rl_s"), ("whole run s", "wall_s")):
        print(f"| {label} | {full[key]:.1f} | {lora[key]:.1f} | {lora[key] / full[key]:.2f} |")
    for arm, r in runs.items():
        diff, low, high = r["paired"]
        print(f"\n{arm}: after SFT {r['sft'].mean:.3f}, {r['rl'].stage} {r['rl'].mean:.3f}; RL - SFT (paired, "
              f"{len(r['rl'].scores)} prompts): {diff:+.3f} [{low:+.3f}, {high:+.3f}]")
    if len(full["rl"].scores) == len(lora["rl"].scores):
        diff, low, high = paired_bootstrap(lora["rl"].scores, full["rl"].scores)
        fixed, broken = transitions(lora["rl"].scores, full["rl"].scores)
        print(f"LoRA - full after RL (paired): {diff:+.3f} [{low:+.3f}, {high:+.3f}]; LoRA right where full was "
              f"wrong on {fixed} prompts, wrong where full was right on {broken}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learning", action="store_true", help="run the main job's two arms (about 80 min)")
    parser.add_argument("--lora-lr", type=float, default=1e-4,
                        help="LoRA arm's RL lr (--learning; the full arm's is the recipe's 1e-5)")
    parser.add_argument("--full-run", default=None, help="--learning: a finished full run dir instead of running it")
    parser.add_argument("--lora-run", default=None, help="--learning: a finished LoRA run dir instead of running it")
    parser.add_argument("--out", default=None, help="--learning: where the arms' run dirs go (default: a temp dir)")
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm, after one warm-up step")
    parser.add_argument("--rank", type=int, default=None,
                        help="LoRA rank (default: 16 for the update step, trainer.lora's 8 for --learning)")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--export-only", action="store_true",
                        help="time only the weight export for the engines (no train_step): `--export-repeats` turns")
    parser.add_argument("--export-repeats", type=int, default=3, help="export_weights timings per arm (median)")
    args = parser.parse_args()
    if args.learning:
        learning(args)
        return
    args.rank = args.rank or 16

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.config import LoRAConfig

    with tempfile.TemporaryDirectory() as tmp:
        def config(lora: bool) -> TrainerConfig:
            cfg = TrainerConfig(model_path=resolve_model_path("smollm2"), micro_batch_tokens=args.micro_batch_tokens,
                                policy_mini_batch_size=args.trajectories, ckpt_dir=os.path.join(tmp, "ckpts"))
            cfg.algorithm.use_kl_loss = False
            cfg.algorithm.tis_ratio_clip_high = None  # synthetic rollouts carry no sampler logprobs
            cfg.lora = LoRAConfig(enabled=lora, rank=args.rank, alpha=2.0 * args.rank)
            return cfg

        arms = {"full": PolicyWorker(config(False)), "lora": PolicyWorker(config(True))}
        vocab = arms["full"].model.config.vocab_size
        batch = merged(search_r1_rollouts(args.trajectories, args.turns, 330, 96, 300, vocab), args.turns)
        times: dict[str, list[float]] = {name: [] for name in arms}
        for step in range(0 if args.export_only else args.steps + 1):
            for name, worker in arms.items():
                start = time.perf_counter()
                worker.train_step(batch)
                if step:  # the first step of each arm is a warm-up
                    times[name].append(time.perf_counter() - start)
        exports = export_times(arms, args.export_repeats)
        export = {name: statistics.median(t) for name, t in exports.items()}
        held = {name: held_bytes(worker) for name, worker in arms.items()}
        for worker in arms.values():
            worker.shutdown()

    if args.export_only:
        print(f"SmolLM2-135M, 1 FSDP2 gloo rank, torch threads {torch.get_num_threads()}, LoRA rank {args.rank} "
              f"(all-linear): export_weights (fp32 file) s, median of {args.export_repeats}: full "
              f"{export['full']:.2f}, LoRA {export['lora']:.2f} (LoRA / full {export['lora'] / export['full']:.2f}); "
              "each: " + "; ".join(f"{n} {', '.join(f'{t:.2f}' for t in ts)}" for n, ts in exports.items()))
        return
    step = {name: statistics.median(t) for name, t in times.items()}
    print(f"SmolLM2-135M, 1 FSDP2 gloo rank, torch threads {torch.get_num_threads()}, LoRA rank {args.rank} "
          f"(all-linear), {len(batch)} samples, {batch.num_loss_tokens()} loss tokens, "
          f"{sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))} tokens, "
          f"median of {args.steps} steps after a warm-up\n")
    print("| | full | LoRA | LoRA / full |")
    print("|---|---:|---:|---:|")
    print(f"| train_step s | {step['full']:.2f} | {step['lora']:.2f} | {step['lora'] / step['full']:.2f} |")
    print(f"| export_weights s (fp32 file) | {export['full']:.2f} | {export['lora']:.2f} | "
          f"{export['lora'] / export['full']:.2f} |")
    for i, label in enumerate(("parameters MiB", "trainable MiB", "AdamW state MiB")):
        f, lo = held["full"][i] / MIB, held["lora"][i] / MIB
        print(f"| {label} | {f:.1f} | {lo:.1f} | {lo / f:.3f} |")
    print("\nsteps s: " + "; ".join(f"{n} {', '.join(f'{t:.2f}' for t in ts)}" for n, ts in times.items()))


if __name__ == "__main__":
    main()
