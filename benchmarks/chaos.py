"""Chaos run: faults injected at random times through a whole training run, each with a witness line, compared
with the same run without faults.

    python benchmarks/chaos.py [--steps 8] [--seed 0] [--out /tmp/chaos] [--lora-adapter]

With --lora-adapter both runs train a LoRA adapter synced to the engine by version (trainer.lora.sync=adapter).

CPU only, a few minutes: a random 1-layer Llama over SmolLM2's tokenizer, a transformers engine, a 1-rank policy
worker, the real RLTrainer (checkpoint every step, seeded per-(trajectory, turn) sampling) and a retrieval server in
its own process. Every trajectory searches the retriever and calls a tool, then answers. Injected (a seeded plan,
at random steps and moments; the injection lives here, the package only recovers):

  tool_exception, tool_timeout, tool_blocking  the tool raises / sleeps past its timeout / blocks its loop
  env_exception                                the env's step raises: the trajectory is dropped and counted
  retriever_killed                             the retrieval server is SIGKILLed, restarted ~2 s later
  engine_killed                                the engine dies mid-rollout: restarted, synced, probed, step retried
  sigkill_mid_update                           the training process is SIGKILLed right after an optimizer step
  sigkill_during_save                          ... while writing a checkpoint (before its COMPLETE marker)
  sigterm_mid_step                             ... SIGTERMed at a random moment
  stale_adapter (--lora-adapter)               the engine keeps serving the previous LoRA adapter at one sync: the
                                               probe must stop the run naming the version (then it resumes)

A fault that kills the process is recovered by resuming from the latest complete checkpoint (the harness relaunches
the same command, as a scheduler would). Each fault writes a witness line (witness.jsonl) when it fires; the summary
says per kind how many were injected, witnessed and recovered, the steps completed, and the final metrics against
the fault-free run. A fault-free run and a run recovered from process kills or an engine restart are identical
(bitwise resume, seeded sampling, whole-step retry); faults inside rollouts change what those trajectories saw, so
there the tolerance is the run-to-run spread of a mean over 8 trajectories of 0/1 rewards: +-0.35 (2 standard
errors at p=0.5) on reward/mean, and the loss within 0.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

# What a fault inside rollouts may move (see the module docstring); process and engine faults must move nothing.
TOLERANCE = {"reward/mean": 0.35, "policy/loss": 0.5}
ONE_SHOT = ("engine_killed", "sigkill_mid_update", "sigkill_during_save")
KINDS = ("tool_exception", "tool_timeout", "tool_blocking", "env_exception", "retriever_killed", "engine_killed",
         "sigkill_mid_update", "sigkill_during_save", "sigterm_mid_step", "stale_adapter")


# ------------------------------------------------------------------------------------------ witness lines

def witness(out: Path, kind: str, event: str = "fired", **detail) -> None:
    """One line per fault event, appended as it happens (a process about to be killed writes it first)."""
    detail.setdefault("launch", int(os.environ.get("CHAOS_LAUNCH", "0")))
    with open(out / "witness.jsonl", "a") as f:
        f.write(json.dumps({"kind": kind, "event": event, "time": time.time(), **detail}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def witnessed(out: Path) -> list[dict]:
    path = out / "witness.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ------------------------------------------------------------------------------------------ the retriever

def serve_retriever(port: int) -> None:
    """A stand-in retrieval server with Search-R1's /retrieve protocol (its own process: the harness kills it)."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/retrieve")
    def retrieve(body: dict):
        return {"result": [[{"document": {"contents": f'"Doc"\nabout {q[:20]}'}}] for q in body["queries"]]}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ------------------------------------------------------------------------------------------ the worker

def _draw(plan: dict, kind: str, key: str) -> bool:
    """Whether `kind` fires for this rollout event: a pure function of the plan's seed and the event's text, so a
    resumed or retried step injects the same faults as the first attempt."""
    return zlib.crc32(f"{plan['seed']}:{kind}:{key}".encode()) % 1000 < plan["rates"].get(kind, 0) * 1000


def worker(out: Path, model_dir: Path, plan: dict) -> None:
    """The training process, with the plan's in-process faults wired into a tool, an env, the engine and saves."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.envs.base import EnvRegistry, StepResult
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
    from skyrl_stepwise.inference import EngineConfig, HFEngine
    from skyrl_stepwise.retrieval.client import RetrievalClient, RetrievalClientConfig
    from skyrl_stepwise.tools import Tool, ToolExecutor
    from skyrl_stepwise.checkpoint import store as checkpoint
    from skyrl_stepwise.policy.config import FSDPConfig, LoRAConfig, TrainerConfig
    from skyrl_stepwise.policy.weight_sync import AdapterNotApplied
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    fired = {(w["kind"], w.get("step")) for w in witnessed(out) if w["event"] == "fired"}
    state = {"step": 0}

    def once(kind: str) -> bool:
        """A one-shot fault planned for this step that has not fired yet (a resumed run must get past it)."""
        return plan["once"].get(kind) == state["step"] and (kind, state["step"]) not in fired

    class ChaosTool(Tool):
        default_schema = {"type": "function", "function": {"name": "lookup", "description": "look up a word",
                                                          "parameters": {"type": "object", "properties": {
                                                              "key": {"type": "string"}}}}}
        injected: dict[str, str] = {}  # call key -> the fault injected into it

        async def call(self, arguments):
            key = arguments["key"]
            if _draw(plan, "tool_exception", key):
                self.injected[key] = "tool_exception"
                witness(out, "tool_exception", step=state["step"])
                raise RuntimeError("chaos: the tool crashed")
            if _draw(plan, "tool_timeout", key):
                self.injected[key] = "tool_timeout"
                witness(out, "tool_timeout", step=state["step"])
                await asyncio.sleep(5)
            if _draw(plan, "tool_blocking", key):
                self.injected[key] = "tool_blocking"
                witness(out, "tool_blocking", step=state["step"])
                time.sleep(0.6)  # blocks the tool's loop past the 0.3 s timeout
            return "looked up"

    tool = ChaosTool()
    client = RetrievalClient(RetrievalClientConfig(url=plan["retriever_url"], timeout_s=1.0, max_retries=2,
                                                   backoff_s=0.2))

    class ChaosEnv:
        """Turn 1: search the retriever with the reply and call the tool; turn 2: reward = even-length reply."""

        async def reset(self, prompt_messages, extras):
            self.turn = 0
            return list(prompt_messages)

        async def step(self, action_text):
            from skyrl_stepwise.chat.base import ToolCallRequest

            self.turn += 1
            key = f"{state['step']}:{action_text}"
            if _draw(plan, "env_exception", key):
                witness(out, "env_exception", step=state["step"])
                raise RuntimeError("chaos: the env crashed")
            if self.turn >= 2:
                return StepResult([], reward=float(len(action_text) % 2 == 0), done=True)
            docs = (await client.search([action_text or "empty"], 1))[0]  # down after retries: the trajectory fails
            ex = ToolExecutor({"lookup": tool}, timeout_s=0.3)
            [result] = await ex.execute([ToolCallRequest("lookup", {"key": key})])
            if key in tool.injected:  # the model reads an answer of the right kind; the episode goes on
                witness(out, tool.injected.pop(key), event="answered", step=state["step"], error_kind=result.error_kind,
                        ok=result.ok)
            text = f"{docs[0]['contents']}\n{result.content}"
            return StepResult([{"role": "user", "content": text}], reward=0.0, done=False,
                              metrics={"tool_failed": float(not result.ok)})

    class KillableEngine:
        """The transformers engine behind a switch: dead, every request fails and health is false; `restart`
        builds a fresh engine from the checkpoint (initial weights), as a restarted actor would."""

        def __init__(self, cfg) -> None:
            self.cfg, self.inner, self.alive, self.requests = cfg, HFEngine(cfg), True, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def generate(self, prompt_ids, sampling, session_id=None):
            if session_id and session_id.startswith("train"):
                self.requests += 1
                if self.alive and once("engine_killed") and self.requests % 8 == plan["kill_request"]:
                    witness(out, "engine_killed", step=state["step"])
                    fired.add(("engine_killed", state["step"]))
                    self.alive = False
            if not self.alive:
                raise RuntimeError("ActorDiedError: the engine died")
            return await self.inner.generate(prompt_ids, sampling, session_id)

        async def load_adapter(self, path, version):
            """The stale_adapter fault: this sync's adapter is never loaded; the engine serves the previous one."""
            if once("stale_adapter"):
                witness(out, "stale_adapter", step=state["step"], version=version)
                fired.add(("stale_adapter", state["step"]))
                return list(self.inner.adapters)
            return await self.inner.load_adapter(path, version)

        async def health(self) -> bool:
            return self.alive

        async def restart(self) -> None:
            self.inner, self.alive = HFEngine(self.cfg), True
            witness(out, "engine_killed", event="restarted", step=state["step"])

    class Policy:
        def __init__(self, worker_) -> None:
            self.worker = worker_

        def call(self, method, *args):
            result = getattr(self.worker, method)(*args)
            if method == "train_step" and once("sigkill_mid_update"):
                witness(out, "sigkill_mid_update", step=state["step"])
                os.kill(os.getpid(), signal.SIGKILL)
            return result

    mark_complete = checkpoint._mark_complete

    def killing_mark_complete(path):
        if once("sigkill_during_save"):
            witness(out, "sigkill_during_save", step=state["step"])
            os.kill(os.getpid(), signal.SIGKILL)
        mark_complete(path)

    checkpoint._mark_complete = killing_mark_complete

    cfg = RunConfig(total_steps=plan["steps"])
    cfg.generator = GeneratorConfig(max_turns=2, max_input_length=512, n_samples_per_prompt=4, show_progress=False,
                                    sampling=GeneratorSamplingConfig(max_generate_length=6, seed=7))
    cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed = 2, True, 3
    cfg.engine.backend = "transformers"
    cfg.trainer = TrainerConfig(model_path=str(model_dir), fsdp=FSDPConfig(world_size=1, mixed_precision=False,
                                                                           num_threads_per_rank=1),
                                ckpt_interval=1, max_ckpts_to_keep=2, ckpt_dir=str(out / "ckpts"), resume="auto",
                                seed=5)
    cfg.trainer.algorithm.use_kl_loss = False
    cfg.trainer.optim.lr = 1e-2
    if plan.get("lora"):  # the adapter alone reaches the engine, one version per sync
        cfg.trainer.lora = LoRAConfig(enabled=True, rank=4, alpha=8.0, sync="adapter", lr=1e-2)
    cfg.validate()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    registry = EnvRegistry()
    registry.register("chaos", ChaosEnv)
    engine = KillableEngine(EngineConfig(backend="transformers", model_path=str(model_dir), dtype="float32",
                                         max_model_len=512, seed=0, max_lora_rank=cfg.engine.max_lora_rank,
                                         max_loras=cfg.engine.max_loras))
    rows = [PromptRow(prompt=[{"role": "user", "content": f"Say something ({i})."}], env_class="chaos",
                      reward_spec={}, data_source="toy", instance_id=f"r{i}") for i in range(4)]
    trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                        StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine,
                        Policy(PolicyWorker(cfg.trainer)), None, Tracker(out, "p", "r", "disabled", {}), rows, [],
                        tokenizer.encode("Hello", add_special_tokens=False))
    step = trainer.train_step

    async def counted_step():
        state["step"] = trainer.step + 1
        print(f"chaos: step {state['step']} starts", flush=True)
        return await step()

    trainer.train_step = counted_step
    try:
        asyncio.run(trainer.fit())
    except AdapterNotApplied as e:  # the probe caught the stale adapter: the evidence, then the process exits
        witness(out, "stale_adapter", event="stopped", step=state["step"], message=str(e))
        raise
    trainer.tracker.finish()


# ------------------------------------------------------------------------------------------ the harness

def tiny_model(path: Path) -> Path:
    """A random 1-layer Llama over SmolLM2's tokenizer (built once)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from skyrl_stepwise.models.prepare import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                     ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_retriever(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--retriever", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import httpx

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["x"], "topk": 1}, timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the retriever did not start")


def run(out: Path, model: Path, plan: dict, rng: random.Random | None, max_launches: int = 8) -> dict:
    """Launch the worker until every step is done; with `rng`, also kill the retriever and SIGTERM the worker at
    random moments (the faults from outside the process)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan))
    port = int(plan["retriever_url"].split(":")[2].split("/")[0])
    retriever = start_retriever(port)
    launches, resumed, sigterm_left, outage_left = 0, 0, plan["sigterms"], plan["retriever_kills"]
    resumed_launches: list[int] = []
    try:
        while launches < max_launches:
            launches += 1
            log = open(out / f"launch{launches}.log", "w")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
                       CHAOS_LAUNCH=str(launches))
            proc = subprocess.Popen([sys.executable, __file__, "--worker", str(out), str(model)], stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
            while proc.poll() is None:
                time.sleep(rng.uniform(1.0, 4.0) if rng else 0.5)
                text = (out / f"launch{launches}.log").read_text()
                started = text.count("chaos: step ")
                if rng and proc.poll() is None and started and outage_left and rng.random() < 0.3:
                    outage_left -= 1
                    retriever.kill()
                    retriever.wait()
                    witness(out, "retriever_killed", step=None)
                    time.sleep(2.0)
                    retriever = start_retriever(port)
                    witness(out, "retriever_killed", event="restarted", step=None)
                elif rng and proc.poll() is None and started and sigterm_left and rng.random() < 0.2:
                    sigterm_left -= 1
                    witness(out, "sigterm_mid_step", step=None, launch=launches)
                    proc.send_signal(signal.SIGTERM)
            log.close()
            text = (out / f"launch{launches}.log").read_text()
            resumed += "resumed from" in text
            if "resumed from" in text:
                resumed_launches.append(launches)
            if proc.returncode == 0:
                break
    finally:
        retriever.kill()
    records = {}
    path = out / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        record = json.loads(line)
        records[record["step"]] = record
    return {"launches": launches, "resumed": resumed, "records": records, "finished": proc.returncode == 0,
            "resumed_launches": resumed_launches}


def summarise(base: dict, chaos: dict, out: Path, plan: dict, rerun: dict | None = None) -> str:
    """The table: faults per kind (injected = witnessed firing, recovered = the recovery's own evidence)."""
    events = witnessed(out)
    recs = chaos["records"]
    fired = {k: sum(1 for e in events if e["kind"] == k and e["event"] == "fired") for k in KINDS}
    expected = {"tool_exception": "tool_error", "tool_timeout": "timeout", "tool_blocking": "timeout"}
    answered = {k: sum(1 for e in events if e["kind"] == k and e["event"] == "answered"
                       and e.get("error_kind") == expected.get(k)) for k in KINDS}
    sum_metric = lambda key: sum(r.get(key, 0.0) for r in recs.values())  # noqa: E731
    recovered = {
        # the call was answered with an error of that kind, the model read it and the episode went on (a call
        # whose trajectory crashed elsewhere first is not answered: fired may exceed recovered by those)
        "tool_exception": answered["tool_exception"], "tool_timeout": answered["tool_timeout"],
        "tool_blocking": answered["tool_blocking"],
        # dropped and counted, never trained on
        "env_exception": int(sum_metric("generate/failed_trajectories/env_step")),
        "retriever_killed": sum(1 for e in events if e["kind"] == "retriever_killed" and e["event"] == "restarted"),
        "engine_killed": int(sum_metric("recovery/engine_restarts")),
    }
    # the probe stopped the run naming the version the engine did not load, and the next launch resumed
    recovered["stale_adapter"] = sum(
        1 for e in events if e["kind"] == "stale_adapter" and e["event"] == "fired"
        and any(s["event"] == "stopped" and f"adapter v{e['version']}" in s["message"] and s["launch"] == e["launch"]
                for s in events if s["kind"] == "stale_adapter") and e["launch"] + 1 in chaos["resumed_launches"])
    for kind in ("sigkill_mid_update", "sigkill_during_save", "sigterm_mid_step"):  # the next launch resumed
        recovered[kind] = sum(1 for e in events if e["kind"] == kind and e["event"] == "fired"
                              and e["launch"] + 1 in chaos["resumed_launches"])
    lines = ["| fault | injected (witnessed) | recovered | how |", "|---|---|---|---|"]
    how = {"tool_exception": "model read the tool error", "tool_timeout": "timeout answered (blocked tools too)",
           "tool_blocking": "timeout held off the rollout loop",
           "env_exception": "dropped and counted in the logged steps (a firing in an attempt killed before its "
                            "metrics were logged fired again when the step was re-run)",
           "retriever_killed": "server restarted; a search in the outage fails only its trajectory (retried first)",
           "engine_killed": "restarted, synced, probed, step retried",
           "sigkill_mid_update": "resumed from the latest checkpoint",
           "sigkill_during_save": "resumed from the previous complete checkpoint",
           "sigterm_mid_step": "resumed from the latest checkpoint",
           "stale_adapter": "the probe stopped the run naming the version; resumed from the latest checkpoint"}
    for k in KINDS:
        lines.append(f"| {k} | {fired[k]} | {recovered[k] if fired[k] else '-'} | {how[k]} |")
    steps = plan["steps"]
    last_b, last_c = base["records"].get(steps, {}), recs.get(steps, {})
    lines += ["", f"steps completed: {len(recs)}/{steps} (fault-free: {len(base['records'])}/{steps}); launches: "
              f"{chaos['launches']} ({chaos['resumed']} resumed)",
              f"trajectories dropped: {int(sum_metric('generate/failed_trajectories'))}; engine restarts: "
              f"{int(sum_metric('recovery/engine_restarts'))}; step retries: {int(sum_metric('recovery/step_retries'))}",
              "", "| metric (mean over steps) | fault-free | chaos | delta | fault-free rerun - fault-free (noise) |",
              "|---|---|---|---|---|"]
    for key in ("reward/mean", "policy/loss", "train/grad_norm", "agreement/logprob_abs_diff_mean"):
        b = [r[key] for r in base["records"].values() if key in r]
        c = [r[key] for r in recs.values() if key in r]
        if b and c:
            mb, mc = sum(b) / len(b), sum(c) / len(c)
            tolerance = TOLERANCE.get(key)
            verdict = "" if tolerance is None else (" (within noise)" if abs(mc - mb) <= tolerance
                                                    else f" (PAST +-{tolerance})")
            r = [x[key] for x in (rerun or {}).get("records", {}).values() if key in x]
            noise = f"{sum(r) / len(r) - mb:+.3g}" if r else "-"
            lines.append(f"| {key} | {mb:.4g} | {mc:.4g} | {mc - mb:+.3g}{verdict} | {noise} |")
    ckpts = sorted(p.name for p in (out / "ckpts").iterdir() if (p / "COMPLETE").exists())
    lines.append(f"\nlatest complete checkpoint: {ckpts[-1] if ckpts else None}; last step logged: fault-free "
                 f"{last_b.get('step')}, chaos {last_c.get('step')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/skyrl_chaos"))
    parser.add_argument("--process-faults-only", action="store_true",
                        help="only the faults that kill the process or the engine: the run must equal the fault-free "
                             "one exactly (every metric delta 0)")
    parser.add_argument("--noise-run", action="store_true",
                        help="run the fault-free run twice: how far two runs without faults differ (the transformers "
                             "engine batches requests as they arrive, and padding changes float sums)")
    parser.add_argument("--lora-adapter", action="store_true",
                        help="train a LoRA adapter synced by version (trainer.lora.sync=adapter) and add the "
                             "stale_adapter fault: the engine keeps the previous adapter at one sync")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--retriever", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.retriever:
        return serve_retriever(args.retriever)
    if args.worker:
        out = Path(args.worker[0])
        return worker(out, Path(args.worker[1]), json.loads((out / "plan.json").read_text()))
    import shutil

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    model = tiny_model(args.out / "model")
    rng = random.Random(args.seed)
    one_shot_steps = rng.sample(range(2, args.steps + 1), 3)
    chaos_plan = {"seed": args.seed, "steps": args.steps, "retriever_url": f"http://127.0.0.1:{free_port()}/retrieve",
                  "rates": {"tool_exception": 0.08, "tool_timeout": 0.05, "tool_blocking": 0.05, "env_exception": 0.05},
                  "once": dict(zip(ONE_SHOT, one_shot_steps)), "kill_request": rng.randrange(1, 8),
                  "sigterms": 1, "retriever_kills": 1}
    if args.lora_adapter:
        chaos_plan.update(lora=True, once={**chaos_plan["once"], "stale_adapter": rng.randrange(2, args.steps + 1)})
    if args.process_faults_only:
        chaos_plan.update(rates={}, retriever_kills=0)
    base_plan = dict(chaos_plan, rates={}, once={}, sigterms=0, retriever_kills=0,
                     retriever_url=f"http://127.0.0.1:{free_port()}/retrieve")
    t0 = time.perf_counter()
    base = run(args.out / "fault_free", model, base_plan, None)
    rerun = run(args.out / "fault_free_rerun", model, base_plan, None) if args.noise_run else None
    chaos = run(args.out / "chaos", model, chaos_plan, rng)
    table = summarise(base, chaos, args.out / "chaos", chaos_plan, rerun)
    print(f"chaos run: seed {args.seed}, {args.steps} steps, plan {chaos_plan['once']}, "
          f"{time.perf_counter() - t0:.0f} s\n\n{table}")
    (args.out / "summary.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
