"""`skyrl-stepwise data agent-demos --out FILE [--teacher pkg.module:function] [hydra overrides]`: SFT demonstrations
for agent programs, recorded through the agent endpoint with a teacher writing the model's turns.

Each train row's agent program (data.train_path, `extra_info.agent`) runs unchanged against an endpoint whose
engine is the teacher; trajectories that reach `--min-reward` are written as the parquet `sft.data` reads
(`messages` + the `tools` the agent sent), checked token for token against what the endpoint rendered
(loop/agent_demos.py). The flags are `sft.agent_demos.*`; the rest are the run's overrides (experiment=..., data...).
Prints progress, then a summary: trajectories recorded / kept, why the others were dropped, calls per trajectory.
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skyrl-stepwise data agent-demos", description=__doc__.splitlines()[0],
                                epilog="Any other word is a Hydra override of the run's config, e.g. "
                                       "experiment=agent_program_tiny data.train_path=my/train.jsonl")
    p.add_argument("--out", required=True, help="the parquet to write (sft.data=<this file> trains on it)")
    p.add_argument("--teacher", help="pkg.module:function (messages, row) -> assistant message "
                                     "(default: sft.agent_demos.teacher)")
    p.add_argument("--samples-per-row", type=int, help="trajectories per train row (sft.agent_demos.samples_per_row)")
    p.add_argument("--min-reward", type=float, help="keep trajectories with reward >= this (sft.agent_demos.min_reward)")
    p.add_argument("--max-rows", type=int, help="only the first N train rows (sft.agent_demos.max_rows)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Record, write, summarise; nothing is written but `--out` (no run dir, no .hydra record)."""
    from skyrl_stepwise.run.app_config import hydra_entry

    args, overrides = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    for flag, key in (("teacher", "teacher"), ("samples_per_row", "samples_per_row"),
                      ("min_reward", "min_reward"), ("max_rows", "max_rows")):
        if getattr(args, flag) is not None:
            overrides.append(f"sft.agent_demos.{key}={getattr(args, flag)}")
    extra = [] if any(a.startswith(("hydra.run.dir=", "logging.output_dir=")) for a in overrides) \
        else ["hydra.run.dir=."]
    if not any(a.startswith("hydra.output_subdir=") for a in overrides):
        extra.append("hydra.output_subdir=null")

    def run(cfg) -> str:
        import logging

        from skyrl_stepwise.host.logs import CHATTY_LOGGERS
        from skyrl_stepwise.loop.agent_demos import record_for_config, write_agent_demos
        from skyrl_stepwise.models import resolve_model_path

        for name in CHATTY_LOGGERS:  # one httpx line per agent call would bury the progress lines
            logging.getLogger(name).setLevel(logging.WARNING)

        cfg.trainer.model_path = str(resolve_model_path(cfg.model_path))
        demos = record_for_config(cfg, lambda line: print(line, flush=True))
        path = write_agent_demos(demos, args.out)
        print(json.dumps({"out": str(path), **demos.summary()}, indent=1), flush=True)
        print(f"train on it: sft.enabled=true sft.data={path}", flush=True)
        return str(path)

    return hydra_entry(run, extra + overrides)


if __name__ == "__main__":
    sys.exit(main())
