"""Write the example task's data: `python examples/own_task/make_data.py OUT_DIR` -> OUT_DIR/{train,val,sft}.parquet.

train/val rows (one prompt each, the columns skyrl_stepwise.data.dataset documents):
  prompt       chat messages the episode starts from
  env_class    "guess" (guess.py, registered by config) or "tool" (the built-in tool env with tools.yaml)
  reward_spec  {"ground_truth": {"target": [...]}}: the number to guess, or the answer the tool env grades
  data_source, extra_info, instance_id
sft rows: `messages`, an OpenAI-style conversation; an assistant turn calls tools with `tool_calls`
({"type": "function", "id", "function": {"name", "arguments": JSON string}}) and each result is a `tool` message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from skyrl_stepwise.data.dataset import write_parquet

CONVERSIONS = [(3, "km", "m", "3000"), (2, "m", "cm", "200"), (5, "km", "m", "5000"), (12, "in", "ft", "1")]


def convert_prompt(value, source, target) -> list[dict]:
    return [{"role": "user", "content": f"How many {target} are {value} {source}? Call unit_convert, then answer "
                                        "with just the number inside <answer></answer>."}]


def guess_row(i: int, target: int) -> dict:
    return {"prompt": [{"role": "user", "content": "I am thinking of a number from 1 to 5. Reply with one number."}],
            "env_class": "guess", "reward_spec": {"ground_truth": {"target": [str(target)]}},
            "data_source": "guess", "extra_info": {"task": "guess"}, "instance_id": f"guess-{i}"}


def tool_row(i: int, value, source, target, answer) -> dict:
    return {"prompt": convert_prompt(value, source, target), "env_class": "tool",
            "reward_spec": {"ground_truth": {"target": [answer]}}, "data_source": "unit_convert",
            "extra_info": {"task": "unit_convert"}, "instance_id": f"convert-{i}"}


def demonstration(value, source, target, answer) -> dict:
    arguments = json.dumps({"value": value, "from_unit": source, "to_unit": target})
    return {"messages": [
        *convert_prompt(value, source, target),
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call_0", "function": {"name": "unit_convert", "arguments": arguments}}]},
        {"role": "tool", "content": f"{answer} {target}"},
        {"role": "assistant", "content": f"<answer>{answer}</answer>"}]}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train = [guess_row(0, 3), tool_row(0, *CONVERSIONS[0]), guess_row(1, 2), tool_row(1, *CONVERSIONS[1])]
    write_parquet(train, out / "train.parquet")
    # greedy evals: the model is told the exact call, so even the base model shows one (rollouts.jsonl, report)
    val = [dict(tool_row(9, 3, "km", "m", "3000"), prompt=[{"role": "user", "content": (
        'Say exactly this and nothing else:\n<tool_call>{"name": "unit_convert", "arguments": '
        '{"value": 3, "from_unit": "km", "to_unit": "m"}}</tool_call>')}])]
    write_parquet(val, out / "val.parquet")
    write_parquet([demonstration(*c) for c in CONVERSIONS], out / "sft.parquet")
    print(f"wrote {out}/train.parquet ({len(train)} rows), val.parquet ({len(val)}), sft.parquet ({len(CONVERSIONS)})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "own_task_data"))
