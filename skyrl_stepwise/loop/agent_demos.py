"""Demonstrations for agent programs, recorded through the agent endpoint with a teacher in the model's place.

Why: a small model trained through the endpoint (gateway.enabled) may never call a tool for an agent program (the
embedded SmolLM2 answers every question in prose), so RL only ever sees one-call trajectories. Our own loop's fix is
an SFT warm start on demonstrations; for an agent program the demonstrations must be what *its* requests render
to (its system prompt, its tool schemas, its way of echoing history), which only the program itself can produce.

So each train row's agent program runs unchanged against an endpoint whose engine is a teacher: a Python callable
(`pkg.module:function`, given the messages of the request and the row) writes each assistant turn, and the engine
"samples" that turn's tokens exactly as SFT will train them (loop/sft.py `assistant_turn_ids`: the family's own
call format). Trajectories that fail or score below `min_reward` are dropped. Each kept trajectory is written as the
conversation the endpoint saw (the agent's last request + the reply it got) with the tools it sent, and is then
replayed through the SFT path (`conversation_samples`) and compared token for token with what the endpoint
recorded: a conversation whose SFT rendering differs (a chain break, a message our demo format cannot hold) is
refused, naming the trajectory and the first differing token, never trained on a prompt the endpoint never renders.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from skyrl_stepwise.data.dataset import PromptRow, write_parquet
from skyrl_stepwise.data.demonstrations import ROLES
from skyrl_stepwise.envs.base import EnvRegistry, Message
from skyrl_stepwise.gateway.config import GatewayConfig
from skyrl_stepwise.gateway.protocol import ChatRequest, parse_request
from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer
from skyrl_stepwise.gateway.service import Gateway
from skyrl_stepwise.generator import GeneratorConfig, GeneratorOutput, TrajectoryID
from skyrl_stepwise.generator.generator import steps_to_output
from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.loop.sft import assistant_turn_ids, conversation_samples, sft_renderer

logger = logging.getLogger(__name__)
# (the request's messages in SFT shape, the row) -> the assistant message: {"content", "tool_calls"} or a string
Teacher = Callable[[list[Message], dict[str, Any]], Any]


class UnrepresentableDemo(ValueError):
    """A recorded trajectory our SFT path cannot reproduce token for token (named with the reason)."""


# ------------------------------------------------------------------------------------------- messages

def demo_message(m: dict[str, Any], call_names: dict[str, str], developer_role: bool = False) -> Message:
    """A message as the agent sent (or got) it, in the shape an SFT conversation stores (data/demonstrations.py
    `load_conversations`): text content, OpenAI tool calls with JSON-text arguments, a tool result with the id and
    the name of the call it answers (the endpoint names it so before rendering). What the format cannot hold
    (content parts, reasoning_content, a role it lacks) is refused naming it."""
    role = m.get("role")
    if role == "developer" and not developer_role:
        role = "system"  # as the endpoint renders it for a template without a developer role
    if role not in ROLES:
        raise UnrepresentableDemo(f"a message with role {m.get('role')!r}: SFT conversations hold {list(ROLES)}")
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        raise UnrepresentableDemo(f"a {role} message whose content is {type(content).__name__}, not text")
    if m.get("reasoning_content"):
        raise UnrepresentableDemo("an assistant turn with reasoning_content: SFT conversations hold content and "
                                  "tool_calls only")
    out: Message = {"role": role, "content": content or ""}
    if role == "assistant" and m.get("tool_calls"):
        calls = []
        for k, call in enumerate(m["tool_calls"]):
            fn = call.get("function") or {}
            arguments = fn.get("arguments")
            calls.append({"id": call.get("id") or f"call{k:05d}", "type": "function",
                          "function": {"name": fn.get("name"), "arguments": arguments if isinstance(arguments, str)
                                       else json.dumps(arguments or {}, ensure_ascii=False)}})
        out["tool_calls"] = calls
    if role == "tool":
        if m.get("tool_call_id"):
            out["tool_call_id"] = m["tool_call_id"]
        name = m.get("name") or call_names.get(m.get("tool_call_id") or "")
        if name:
            out["name"] = name
    return out


def demo_conversation(messages: list[dict[str, Any]], developer_role: bool = False) -> list[Message]:
    """Messages in SFT shape; a tool result takes the name of the call (of the turn before it) it answers."""
    out, names = [], {}
    for m in messages:
        if m.get("role") == "assistant":
            names = {c.get("id"): (c.get("function") or {}).get("name") for c in m.get("tool_calls") or []}
        out.append(demo_message(m, names, developer_role))
    return out


def teacher_message(reply: Any) -> dict[str, Any]:
    """What a teacher returned as an assistant message: a string is its content; a dict may carry `tool_calls`
    (OpenAI shape; arguments an object or JSON text)."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    if not isinstance(reply, dict):
        raise TypeError(f"the teacher must return an assistant message (a dict with content and/or tool_calls, or a "
                        f"string), got {type(reply).__name__}: {str(reply)[:80]!r}")
    return {**reply, "role": "assistant"}


def load_teacher(path: str, where: str = "sft.agent_demos.teacher") -> Teacher:
    """The teacher callable a config or `--teacher` names (`pkg.module:function`), imported now."""
    from skyrl_stepwise.envs.builtin import import_object

    return import_object(path, where)


# --------------------------------------------------------------------------------------------- engine

class TeacherGateway(Gateway):
    """The endpoint with a teacher as its engine: each request's messages and its row go to the teacher, whose
    assistant message becomes the ids SFT will train for it (the family's call format); what each call was sent and
    answered is kept per trajectory (`transcripts`), with the content the teacher wrote for that answer: a parser
    may hand the agent a content that renders otherwise (hermes keeps the newline before `<tool_call>`, which the
    turn's rendering adds again), so the SFT conversation keeps the teacher's text, the one that made the ids."""

    def __init__(self, tokenizer, teacher: Teacher, rows: dict[str, dict[str, Any]], cfg: GeneratorConfig,
                 gateway: GatewayConfig | None = None) -> None:
        self.teacher, self.rows = teacher, rows
        self.pending: dict[str, ChatRequest] = {}  # trajectory key -> the request being answered
        self.transcripts: dict[str, list[tuple[list[dict], list[dict] | None, dict, str | None]]] = {}
        self.taught: dict[str, str | None] = {}  # trajectory key -> the content of the teacher's pending turn
        renderer = sft_renderer(tokenizer, cfg)  # the renderer SFT trains with: the same call format and ids
        super().__init__(tokenizer, ScriptedEngine(self._turn, tokenizer), cfg, gateway, renderer=renderer)

    def _turn(self, prompt_ids: list[int], key: str | None, index: int) -> list[int]:
        """The teacher's turn for the pending request of trajectory `key`, as the ids a model writing it samples."""
        request = self.pending[key]
        conversation = demo_conversation(request.messages, self.renderer.roles.developer)
        reply = self.teacher([dict(m) for m in conversation], dict(self.rows[key]))
        if inspect.isawaitable(reply):
            raise TypeError("the teacher must be a plain function (it answers inside the engine call)")
        message = demo_message(teacher_message(reply), {}, self.renderer.roles.developer)
        self.taught[key] = message.get("content")
        return assistant_turn_ids(self.renderer, [*conversation, message], len(conversation), request.tools or None)

    async def complete(self, session_id: str, body: Any):
        session = self.sessions.get(session_id)
        key = session.trajectory_id.key() if session is not None else None
        if key is not None:
            try:
                self.pending[key] = parse_request(body, self.cfg.sampling, self.model_names)
            except Exception:  # noqa: BLE001 - the endpoint refuses it below, with its own answer
                pass
        request, response = await super().complete(session_id, body)
        self.transcripts.setdefault(key, []).append((request.messages, request.tools,
                                                     response["choices"][0]["message"], self.taught.pop(key, None)))
        return request, response


# ------------------------------------------------------------------------------------------- recording

@dataclass
class AgentDemo:
    """One recorded trajectory: kept (an SFT conversation) or why not."""

    trajectory: str
    instance_id: str
    calls: int  # calls the agent made to the model
    reward: float | None
    dropped: str | None = None  # why it is not a demonstration (a failure cause, `low_reward`, `length`)
    messages: list[Message] = field(default_factory=list)
    tools: list[dict] | None = None
    # what the endpoint recorded for it, merged as training merges it: (prompt ids, response ids, loss mask)
    endpoint: list[tuple[list[int], list[int], list[int]]] = field(default_factory=list)


@dataclass
class AgentDemos:
    """What a recording gave: every trajectory, and the kept ones as SFT rows."""

    demos: list[AgentDemo]
    min_reward: float

    @property
    def kept(self) -> list[AgentDemo]:
        return [d for d in self.demos if d.dropped is None]

    def conversations(self) -> list[list[Message]]:
        return [d.messages for d in self.kept]

    def tools(self) -> list[list[dict] | None]:
        return [d.tools for d in self.kept]

    def rows(self) -> list[dict[str, Any]]:
        """The parquet rows `sft.data` reads: `messages`, `tools` (JSON text of the schemas the agent sent)."""
        return [{"messages": d.messages, "tools": json.dumps(d.tools) if d.tools else None,
                 "instance_id": d.instance_id, "reward": d.reward, "calls": d.calls} for d in self.kept]

    def summary(self) -> dict[str, Any]:
        """Counts and calls per trajectory (kept and all), and why trajectories were dropped."""
        def calls(demos: list[AgentDemo]) -> dict[str, float]:
            n = max(len(demos), 1)
            return {"mean": sum(d.calls for d in demos) / n, "multi_call_share": sum(d.calls >= 2 for d in demos) / n,
                    "histogram": {str(c): sum(d.calls == c for d in demos) for c in sorted({d.calls for d in demos})}}
        dropped: dict[str, int] = {}
        for d in self.demos:
            if d.dropped is not None:
                dropped[d.dropped] = dropped.get(d.dropped, 0) + 1
        return {"recorded": len(self.demos), "kept": len(self.kept), "dropped": dropped,
                "calls_per_trajectory_kept": calls(self.kept), "calls_per_trajectory_all": calls(self.demos)}

    def describe(self) -> str:
        s = self.summary()
        kept, every = s["calls_per_trajectory_kept"], s["calls_per_trajectory_all"]
        why = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items())) or "none"
        return (f"agent demos: {s['recorded']} trajectories recorded, {s['kept']} kept (reward >= {self.min_reward:g});"
                f" dropped: {why}; calls per trajectory: kept {kept['mean']:.2f} ({100 * kept['multi_call_share']:.0f}%"
                f" with >= 2, histogram {kept['histogram']}), all {every['mean']:.2f}")


def row_for_teacher(row: PromptRow) -> dict[str, Any]:
    """What the teacher gets for a row: its prompt, env class and extras (reward_spec with the ground truth,
    extra_info), as the dataset holds them."""
    return {"prompt": [dict(m) for m in row.prompt], "env_class": row.env_class, **row.env_extras()}


def final_conversation(transcript: list[tuple[list[dict], list[dict] | None, dict, str | None]],
                       developer_role: bool = False) -> tuple[list[Message], list[dict] | None]:
    """The conversation a trajectory's calls make: the last request's messages + the reply it got, with the tools it
    sent. Every earlier call must be a prefix of it (with the same tools): an agent that edited its history between
    calls made a chain break, which one SFT conversation cannot replay. Each answer's content is the teacher's own
    text (the transcript's last field, where recorded), the one whose rendering the engine sampled."""
    last_messages, tools, reply, _ = transcript[-1]
    conversation = demo_conversation([*last_messages, reply], developer_role)
    for k, (messages, call_tools, answer, _) in enumerate(transcript[:-1]):
        seen = demo_conversation([*messages, answer], developer_role)
        if conversation[:len(seen)] != seen:
            raise UnrepresentableDemo(f"call {k} is not a prefix of the last call's conversation (the agent changed "
                                      "its history: a chain break); one SFT conversation replays one chain")
        if (call_tools or None) != (tools or None):
            raise UnrepresentableDemo(f"call {k} sent other tools than the last call; one SFT conversation renders "
                                      "one set of tools")
    for messages, _, _, taught in transcript:
        if taught is not None and conversation[len(messages)]["content"].strip() == taught.strip():
            conversation[len(messages)] = {**conversation[len(messages)], "content": taught}
    return conversation, (list(tools) if tools else None)


def endpoint_samples(result) -> list[tuple[list[int], list[int], list[int]]]:
    """What the endpoint recorded for one trajectory, merged as training merges it: (prompt, response, mask)."""
    out = merge_stepwise_output(steps_to_output([result]))
    return list(zip(out.prompt_token_ids, out.response_ids, out.loss_masks))


def sft_samples(output: GeneratorOutput, index: int) -> list[tuple[list[int], list[int], list[int]]]:
    """The SFT path's samples of conversation `index` (conversation_samples' instance ids are the indices)."""
    return [(p, r, m) for p, r, m, t in zip(output.prompt_token_ids, output.response_ids, output.loss_masks,
                                             output.trajectory_ids) if t.instance_id == str(index)]


def first_difference(a: list[tuple], b: list[tuple], decode: Callable[[list[int]], str]) -> str:
    """Where the SFT path's samples (a) part from the endpoint's (b), in words."""
    if len(a) != len(b):
        return f"{len(a)} SFT samples against {len(b)} recorded (a chain break?)"
    for i, ((pa, ra, ma), (pb, rb, mb)) in enumerate(zip(a, b)):
        for what, x, y in (("prompt", pa, pb), ("response", ra, rb), ("loss mask", ma, mb)):
            if x != y:
                k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                shown = "" if what == "loss mask" else f": SFT {decode(x[k:k + 12])!r} vs endpoint {decode(y[k:k + 12])!r}"
                return f"sample {i}, {what} token {k} of {len(x)}/{len(y)}{shown}"
    return "identical"


def record_agent_demos(tokenizer, rows: list[PromptRow], teacher: Teacher, gen_cfg: GeneratorConfig,
                       gateway_cfg: GatewayConfig | None = None, samples_per_row: int = 1,
                       min_reward: float = 1.0, env_registry: EnvRegistry | None = None,
                       concurrency: int = 16, log: Callable[[str], None] = print) -> AgentDemos:
    """Run every row's agent `samples_per_row` times against the teacher endpoint; keep the trajectories that
    finished with reward >= `min_reward` and every turn whole, as SFT conversations checked token for token against
    what the endpoint recorded (UnrepresentableDemo names the first one that is not). Runs its own event loop (the
    SFT replay does too): call it outside one."""
    demos = asyncio.run(_record(tokenizer, rows, teacher, gen_cfg, gateway_cfg, samples_per_row, min_reward,
                                env_registry, concurrency, log))
    check_representable(tokenizer, gen_cfg, demos)
    return demos


async def _record(tokenizer, rows, teacher, gen_cfg, gateway_cfg, samples_per_row, min_reward, env_registry,
                  concurrency, log) -> AgentDemos:
    gateway_cfg = dataclasses.replace(gateway_cfg or GatewayConfig(), enabled=True, port=0)  # a free port of its own
    items = [(row, TrajectoryID(f"demo/{row.instance_id or k}/{k}", rep))
             for k, row in enumerate(rows) for rep in range(samples_per_row)]
    gateway = TeacherGateway(tokenizer, teacher, {t.key(): row_for_teacher(r) for r, t in items}, gen_cfg,
                             gateway_cfg)
    developer = gateway.renderer.roles.developer
    demos: list[AgentDemo] = []
    results = []
    async with AgentServer(gateway) as url:
        generator = AgentProgramGenerator(gateway, url, env_registry)
        for start in range(0, len(items), concurrency):
            chunk = items[start:start + concurrency]
            results += await generator.run_agents([r.prompt for r, _ in chunk], [r.env_class for r, _ in chunk],
                                                  [r.env_extras() for r, _ in chunk], [t for _, t in chunk])
            log(f"agent demos: {len(results)}/{len(items)} trajectories recorded")
    for (row, tid), result in zip(items, results):
        steps = result.steps if result.failure is None else result.partial_steps
        reward = result.steps[-1].reward if result.failure is None else None
        demo = AgentDemo(tid.key(), row.instance_id, len(steps), reward)
        if result.failure is not None:
            demo.dropped = result.failure
        elif any(s.stop_reason == "length" for s in steps):
            demo.dropped = "length"  # a teacher turn longer than generator.sampling.max_generate_length was cut
        elif reward < min_reward:
            demo.dropped = "low_reward"
        else:
            try:
                demo.messages, demo.tools = final_conversation(gateway.transcripts[tid.key()], developer)
            except UnrepresentableDemo as e:
                raise UnrepresentableDemo(f"trajectory {tid.key()}: {e}") from None
            demo.endpoint = endpoint_samples(result)
        demos.append(demo)
    return AgentDemos(demos, min_reward)


def check_representable(tokenizer, gen_cfg: GeneratorConfig, demos: AgentDemos) -> None:
    """Replay the kept conversations through the SFT path and refuse, naming the trajectory and the first differing
    token, any whose samples are not exactly what the endpoint recorded for it: SFT must train the tokens the
    agent's requests render to."""
    kept = demos.kept
    if not kept:
        return
    try:
        output = conversation_samples(tokenizer, demos.conversations(), gen_cfg, None, demos.tools())
    except ValueError as e:
        raise UnrepresentableDemo(f"the recorded conversations cannot be rendered by the SFT path: {e}") from e
    for i, demo in enumerate(kept):
        mine, theirs = sft_samples(output, i), demo.endpoint
        if mine != theirs:
            raise UnrepresentableDemo(
                f"trajectory {demo.trajectory}: its SFT rendering differs from what the endpoint sampled ("
                f"{first_difference(mine, theirs, tokenizer.decode)}); SFT would train a prompt the endpoint never "
                "renders, so it is refused")


def write_agent_demos(demos: AgentDemos, out: str | Path) -> Path:
    """The kept conversations as the parquet `sft.data` reads (refused when none was kept: nothing to train)."""
    if not demos.kept:
        raise ValueError(f"no trajectory reached reward >= {demos.min_reward:g}; nothing to write ("
                         f"{demos.describe()})")
    write_parquet(demos.rows(), out)
    return Path(out)


def record_for_config(cfg, log: Callable[[str], None] = print, tokenizer=None) -> AgentDemos:
    """`sft.agent_demos` over the run's train rows (data.train_path), with its generator and gateway settings."""
    from transformers import AutoTokenizer

    from skyrl_stepwise.data.dataset import load_prompt_dataset
    from skyrl_stepwise.envs.builtin import build_env_registry
    from skyrl_stepwise.gateway.rollout import check_agent_rows

    spec = cfg.sft.agent_demos
    if not spec.teacher:
        raise ValueError("sft.agent_demos.teacher is not set: name the teacher ('pkg.module:function')")
    rows = load_prompt_dataset(cfg.data.train_path)[: spec.max_rows]
    check_agent_rows([r.env_extras() for r in rows], str(cfg.data.train_path))
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(cfg.trainer.model_path)
    demos = record_agent_demos(tokenizer, rows, load_teacher(spec.teacher), cfg.generator, cfg.gateway,
                               spec.samples_per_row, spec.min_reward, build_env_registry(cfg.environment), log=log)
    log(demos.describe())
    if not demos.kept:
        raise ValueError(f"sft.data=agent_demos: no trajectory of the teacher {spec.teacher} reached reward >= "
                         f"{spec.min_reward:g} (sft.agent_demos.min_reward): {demos.describe()}")
    return demos
