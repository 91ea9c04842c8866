"""Repo-fixing rows that name mini-swe-agent (`extra_info.agent`), for `experiment=repo_fix_mini_swe_agent_tiny`:
`python examples/mini_swe_agent/make_data.py [--out DIR]` writes DIR/train.parquet and DIR/validation.parquet
(default DIR: repo_fix_mini_swe_agent).

The tasks are `skyrl-stepwise data repo-fix`'s own (skyrl_stepwise/data/repo_fix.py, same seed, same held-out bug
sites in validation): the package in reward_spec.files, the hidden cases in reward_spec.cases. Two changes per
row: extra_info names the agent (and its config, `extra_info.mini_swe_agent`, merged over mini-swe-agent's
mini.yaml), and the demonstration's fix is dropped from extra_info (an agent program gets the row's extras). No SFT
demonstrations: ours are in our loop's bash/view/edit format, not mini-swe-agent's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

AGENT = "examples.mini_swe_agent.agent:run"


def agent_row(task, step_limit: int = 8) -> dict[str, Any]:
    """The task's repo_fix row, naming mini-swe-agent and its step limit (model calls per trajectory)."""
    row = task.row()
    info = {k: v for k, v in row["extra_info"].items() if k != "fix"}
    row["extra_info"] = {**info, "agent": AGENT, "mini_swe_agent": {"agent": {"step_limit": step_limit}}}
    return row


def main(argv: list[str] | None = None) -> dict[str, Path]:
    from skyrl_stepwise.data.dataset import write_parquet
    from skyrl_stepwise.data.repo_fix import repo_fix_tasks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="repo_fix_mini_swe_agent", help="output folder")
    parser.add_argument("--train", type=int, default=96)
    parser.add_argument("--validation", type=int, default=48)
    parser.add_argument("--step-limit", type=int, default=8, help="mini-swe-agent's model calls per trajectory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    paths = {"train": out / "train.parquet", "validation": out / "validation.parquet"}
    for split, n in (("train", args.train), ("validation", args.validation)):
        write_parquet([agent_row(t, args.step_limit) for t in repo_fix_tasks(split, n, args.seed)], paths[split])
        print(f"{paths[split]}: {n} rows")
    return paths


if __name__ == "__main__":
    main()
