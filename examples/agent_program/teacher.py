"""A teacher for the example agent's task: writes the calls a good model would make, for the demonstrations the warm
start records through the endpoint (`sft.data=agent_demos`, `skyrl-stepwise data agent-demos`).

`teach(messages, row)` gets the agent's request (messages in SFT shape) and the dataset row (its prompt and
reward_spec) and returns the assistant message: first the tool call the question asks for (the calculator on the
question's arithmetic, the search tool on the fact's keywords), then, once a tool result is back, an answer that
states the row's ground truth.
"""

from __future__ import annotations

import re

from examples.agent_program.agent import FACTS

_ARITHMETIC = re.compile(r"What is ([-+*/ .\d()]+)\?")


def _question(row: dict) -> str:
    return next(m["content"] for m in reversed(row["prompt"]) if m["role"] == "user")


def _call(question: str) -> tuple[str, dict]:
    """The call the question asks for: (tool name, arguments)."""
    arithmetic = _ARITHMETIC.search(question)
    if "calculator" in question and arithmetic:
        return "calculator", {"expression": arithmetic.group(1).strip()}
    words = question.lower()
    for key in FACTS:  # the fact whose words the question names, searched by those words only
        keywords = [w for w in key.split() if len(w) > 2]
        if all(w in words for w in keywords):
            return "search", {"query": " ".join(keywords)}
    raise ValueError(f"the teacher knows no call for {question!r}")


def teach(messages: list[dict], row: dict) -> dict:
    """The next assistant turn: a tool call, then (after its result) the answer with the ground truth."""
    if messages[-1]["role"] == "tool":
        truth = str((row.get("reward_spec") or {}).get("ground_truth", ""))
        return {"role": "assistant", "content": f"The answer is {truth}."}
    name, arguments = _call(_question(row))
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": arguments}}]}
