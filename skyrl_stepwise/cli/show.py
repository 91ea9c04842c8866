"""`skyrl-stepwise show <run dir> [--step N] [--eval]`: print the decoded trajectories a run saved.

What the model wrote at a step (its turns, tool calls, what the env and tools answered, the reward and why the
trajectory stopped) is the first thing to read when a reward curve is flat; this prints <run dir>/rollouts.jsonl
without opening wandb or parsing JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Print the samples of one step (default: the last step that has any), training and eval alike."""
    from skyrl_stepwise.loop.rollout_samples import FILE, format_sample, load_rollouts

    parser = argparse.ArgumentParser(prog="skyrl-stepwise show", description=__doc__.split("\n\n")[1])
    parser.add_argument("run_dir", type=Path, help="a run directory (logging.output_dir)")
    parser.add_argument("--step", type=int, default=None, help="this training step (default: the last one logged)")
    parser.add_argument("--stage", choices=("all", "train", "eval"), default="all",
                        help="training rollouts, eval rollouts, or both (default)")
    parser.add_argument("--failed", action="store_true",
                        help="only failed trajectories (env or engine errors, never trained), up to their failure: "
                             "of every step unless --step is given")
    parser.add_argument("--max-chars", type=int, default=4000, help="shorten longer texts in the middle")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    samples = load_rollouts(args.run_dir)
    if not samples:
        print(f"{args.run_dir / FILE}: no rollout samples (logging.num_rollout_samples=0, or no step ran)",
              file=sys.stderr)
        return 1
    if args.stage != "all":
        samples = [s for s in samples if (s["stage"] == "train") == (args.stage == "train")]
    if args.failed:
        samples = [s for s in samples if s.get("pick") == "failed"]
        if not samples:
            print(f"{args.run_dir / FILE}: no failed trajectory was recorded", file=sys.stderr)
            return 1
    steps = sorted({s["step"] for s in samples})
    step = steps[-1] if args.step is None else args.step
    chosen = [s for s in samples if s["step"] == step or (args.failed and args.step is None)]
    if not chosen:
        print(f"no samples for step {step}; steps with samples: {steps}", file=sys.stderr)
        return 1
    print("\n\n".join(format_sample(s, args.max_chars) for s in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
