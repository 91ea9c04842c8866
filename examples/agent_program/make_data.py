"""Rows that name the example agent (`extra_info.agent`), written as the JSON-lines files the recipe
`experiment=agent_program_tiny` trains and evaluates on: `python examples/agent_program/make_data.py [out_dir]`.

The agent (agent.py) scores itself (the ground truth in its final answer), so `env_class` only names a
registered env for rows whose agent returns no reward; `keyword` needs no retriever.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

AGENT = "examples.agent_program.agent:run"
HERE = Path(__file__).resolve().parent
# (question, ground truth): each answerable with the agent's two tools (search + calculator)
QUESTIONS = [
    ("How many moons does Mars have? Use the search tool.", "2"),
    ("What is 17 * 3? Use the calculator tool.", "51"),
    ("How many legs does a spider have? Use the search tool.", "8"),
    ("What is 120 / 4? Use the calculator tool.", "30"),
]


def row(i: int, question: str, truth: str, split: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "env_class": "keyword",
            "reward_spec": {"ground_truth": truth}, "data_source": "agent_program",
            "extra_info": {"agent": AGENT, "split": split}, "instance_id": f"{split}-{i}"}


def main(out: Path = HERE / "data") -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    train, val = out / "train.jsonl", out / "val.jsonl"
    for path, rows in ((train, [row(i, q, t, "train") for i, (q, t) in enumerate(QUESTIONS)]),
                       (val, [row(i, q, t, "val") for i, (q, t) in enumerate(QUESTIONS[:2])])):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train, val


if __name__ == "__main__":
    print(*main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "data"), sep="\n")
