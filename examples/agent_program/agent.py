"""A plain `openai`-client tool loop (search + calculator), trained unchanged through the agent endpoint.

Point a dataset row at it with `extra_info.agent: "examples.agent_program.agent:run"`; the rollout calls
`run(task)` with the session's base URL and key, and trains on exactly what the endpoint sampled.
"""

from __future__ import annotations

import ast
import json
import operator

import httpx
from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {"name": "search", "description": "Look a fact up.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
]
FACTS = {"moons of mars": "Mars has 2 moons: Phobos and Deimos.", "legs of a spider": "Spiders have 8 legs."}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Arithmetic only (no eval of arbitrary code): numbers and + - * /."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


def search(query: str) -> str:
    """A toy corpus lookup; a real agent would call its search API here."""
    hits = [text for key, text in FACTS.items() if any(w in key for w in query.lower().split())]
    return "\n".join(hits) or "no results"


# One HTTP connection pool for every session's client: building a client's own (an SSL context) costs ~16 ms of
# GIL-held time, which 32 concurrent sessions pay one after another before their first call; with a shared pool
# OpenAI(...) costs ~0.1 ms. httpx.Client is thread-safe, and each session still has its own base URL.
HTTP = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), limits=httpx.Limits(max_connections=256))


def client_for(task) -> OpenAI:
    """The session's OpenAI client (its base URL and key) over the shared connection pool."""
    return OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0, http_client=HTTP)


def run(task, max_turns: int = 6) -> dict:
    """The agent: chat, run the tools the model calls, send results back, until it answers; the reward is whether
    the answer contains the row's ground truth (`reward_spec.ground_truth`)."""
    client = client_for(task)
    messages = list(task.messages)
    answer, calls = "", 0
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))  # echoed as the client spells it
        if not reply.tool_calls:
            answer = reply.content or ""
            break
        for call in reply.tool_calls:
            calls += 1
            args = json.loads(call.function.arguments or "{}")
            result = calculate(args.get("expression", "")) if call.function.name == "calculator" \
                else search(args.get("query", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    truth = str((task.extras.get("reward_spec") or {}).get("ground_truth", ""))
    return {"reward": float(bool(truth) and truth in answer), "metrics": {"tool_calls": calls}}
