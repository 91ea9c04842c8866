"""Supervised warm start on conversations, through exactly the token path rollouts take.

A demonstration is replayed through the real generator: a scripted engine "samples" each assistant turn
(its canonical tokens and the turn terminator) and a replay env hands back the conversation's observations.
The samples are therefore built by the same renderer, bridge, stop strings and merger as RL samples: the
tokens the model is trained on are exactly the tokens it will see when it generates, and only what the
assistant said is trained (loss mask 1), never the prompt or the observations.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass, field, replace
from typing import Any

from skyrl_stepwise.chat import create_renderer
from skyrl_stepwise.chat.base import RenderError
from skyrl_stepwise.envs.base import EnvRegistry, Message, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorOutput, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.generator.config import ContextConfig
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.policy.batching import TrainBatch
from skyrl_stepwise.loop.divergence import DivergenceConfig

logger = logging.getLogger(__name__)
AGENT_DEMOS = "agent_demos"  # sft.data: record demonstrations through the agent endpoint now (loop/agent_demos.py)


@dataclass
class AgentDemosConfig:
    """`sft.data=agent_demos`: demonstrations recorded now through the agent endpoint (loop/agent_demos.py): each
    train row's agent program runs against a teacher that writes the assistant turns, and the trajectories that reach
    `min_reward` are the SFT conversations, exactly as the endpoint rendered them."""

    teacher: str | None = None  # "pkg.module:function": (messages, row) -> the assistant message (content, tool_calls)
    samples_per_row: int = 1  # trajectories recorded per train row (a teacher may be stochastic)
    min_reward: float = 1.0  # keep trajectories whose reward is at least this (the top score of a 0/1 reward)
    max_rows: int | None = None  # record only the first N train rows (null: all)

    def validate(self, prefix: str = "sft.agent_demos") -> None:
        if self.teacher is not None and (not isinstance(self.teacher, str) or ":" not in self.teacher):
            raise ValueError(f"{prefix}.teacher must be 'pkg.module:function', got {self.teacher!r}")
        if self.samples_per_row <= 0:
            raise ValueError(f"{prefix}.samples_per_row must be > 0, got {self.samples_per_row}")
        if self.max_rows is not None and self.max_rows <= 0:
            raise ValueError(f"{prefix}.max_rows must be > 0 or null, got {self.max_rows}")


@dataclass
class SFTConfig:
    """The warm start: which conversations, how long, how fast; `skyrl-stepwise sft` and the main job use it."""

    enabled: bool = False  # the main job runs SFT before RL (cached: redone only when its inputs change)
    # "embedded" (Search-R1 demonstrations) or a parquet with a `messages` column (OpenAI-shaped chat messages; an
    # assistant message may carry `tool_calls`; an optional `tools` column, JSON, the schemas that conversation
    # renders); "agent_demos": recorded now through the agent endpoint (sft.agent_demos); python_tool:demos:SIZE:SEED:
    # the python-tool task's demonstrations, played through its env (data/python_tool_demos.py, cached); null: none
    # (the task-neutral recipe turns SFT on when it is set)
    data: str | None = "embedded"
    max_rows: int = 64  # demonstration conversations trained on: the first N
    epochs: int = 2  # passes over them, each in a fresh seeded order
    batch_size: int = 16  # conversations per optimizer step
    lr: float = 5.0e-5  # the full-weight SFT's peak learning rate (a LoRA SFT's: sft.lora_lr)
    # Linear warm-up to sft.lr over this many optimizer steps (null: a quarter of the run's steps, 1 to 50).
    # AdamW's first updates move every weight by about lr whatever its gradient (m/sqrt(v) is +-1 after one
    # step): at lr 5e-5 without warm-up that wrecked Gemma 3 270M in one step (entropy 2.9 -> 7.1 nats, grad norm
    # 448). transformers' schedule gives step 1 lr 0 (the moments see a gradient before any update), then rises.
    # Part of the SFT cache key: it changes the weights.
    num_warmup_steps: int | None = None
    # A model that has never produced the chat format's turn terminator (a base model: Gemma 3 270M pays 15-30
    # nats for `<end_of_turn>`) gets a gradient dominated by it, and with short answers half the trained tokens
    # are terminators: at lr 5e-5 after one warm-up step that SFT diverged (entropy 3.8 -> 8.5 nats by step 3).
    # Before the first step SFT measures the model's mean loss on the demonstrations' terminators; above this
    # many nats (10: a probability below 5e-5, under uniform over a 22k vocabulary) it trains at
    # `unseen_terminator_lr` (when lower than lr) with at least `unseen_terminator_warmup_steps` warm-up steps
    # (at most the run's steps), and says so. SmolLM2-135M-Instruct pays 1.0 nat. null: always lr / num_warmup_steps.
    unseen_terminator_nats: float | None = 10.0
    unseen_terminator_lr: float = 1.0e-5  # the lr SFT uses when the terminator is unseen (see above)
    unseen_terminator_warmup_steps: int = 8  # the fewest warm-up steps then (see above)
    seed: int = 0  # the conversations' order in each epoch
    # Whether SFT trains a LoRA adapter (trainer.lora's rank, alpha and modules; the warm start is the merged
    # model: true) or every weight (false, also under trainer.lora.enabled=true: full SFT, then LoRA RL on the
    # fully fine-tuned model, the same cached warm start a full RL run uses). Measured on the main job (docs/lora.md):
    # an adapter SFT at 10x the SFT lr left the eval after SFT at 0.008 on 128 prompts (loss 1.767 -> 0.721) and the
    # RL steps without signal, where full SFT reaches ~0.1 and LoRA RL from it resolves a gain.
    lora: bool = False
    # The adapter's lr when SFT trains one. null: 10 x the lr SFT chose (sft.lr, or sft.unseen_terminator_lr; see
    # trainer.lora.lr): a LoRA SFT at the full-weight lr left the eval at 0 (issue 59). Ignored for full SFT.
    lora_lr: float | None = None
    # optimizer steps between checkpoints (next to the cached model: <cache>/sft/<key>.ckpts); an interrupted SFT
    # continues from the last one, exactly. 0 disables (a save stages weights + AdamW: ~1.6 GiB for SmolLM2).
    ckpt_interval: int = 20
    # stop SFT when a step diverges (loop/divergence.py); only stops a run, so not in the SFT cache key
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    # sft.data=agent_demos: record the demonstrations through the agent endpoint with a teacher (gateway.enabled
    # runs). Not in the SFT cache key itself: what it records is, by content (the conversations and their tools)
    agent_demos: AgentDemosConfig = field(default_factory=AgentDemosConfig)

    def warmup_steps(self, total_steps: int) -> int:
        """The warm-up of a run of `total_steps` optimizer steps (num_warmup_steps, or its default)."""
        if self.num_warmup_steps is not None:
            return self.num_warmup_steps
        return min(max(-(-total_steps // 4), 1), 50)

    def validate(self, prefix: str = "sft") -> None:
        """Name the key of the first impossible value."""
        if self.enabled and not self.data:
            raise ValueError(f"{prefix}.enabled=true needs {prefix}.data (a parquet of `messages`, or 'embedded' "
                             "for the Search-R1 demonstrations)")
        if self.ckpt_interval < 0:
            raise ValueError(f"{prefix}.ckpt_interval must be >= 0 (0 disables), got {self.ckpt_interval}")
        for key in ("max_rows", "epochs", "batch_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{prefix}.{key} must be > 0, got {getattr(self, key)}")
        if self.lr <= 0:
            raise ValueError(f"{prefix}.lr must be > 0, got {self.lr}")
        if self.unseen_terminator_nats is not None and self.unseen_terminator_nats <= 0:
            raise ValueError(f"{prefix}.unseen_terminator_nats must be > 0 (or null: off), "
                             f"got {self.unseen_terminator_nats}")
        if self.lora_lr is not None and self.lora_lr <= 0:
            raise ValueError(f"{prefix}.lora_lr must be > 0 (or null: 10 x the SFT lr), got {self.lora_lr}")
        if self.unseen_terminator_lr <= 0:
            raise ValueError(f"{prefix}.unseen_terminator_lr must be > 0, got {self.unseen_terminator_lr}")
        if self.unseen_terminator_warmup_steps < 0:
            raise ValueError(f"{prefix}.unseen_terminator_warmup_steps must be >= 0, "
                             f"got {self.unseen_terminator_warmup_steps}")
        if self.num_warmup_steps is not None and self.num_warmup_steps < 0:
            raise ValueError(f"{prefix}.num_warmup_steps must be >= 0 (or null: a quarter of the steps), "
                             f"got {self.num_warmup_steps}")
        self.divergence.validate(f"{prefix}.divergence")
        self.agent_demos.validate(f"{prefix}.agent_demos")
        if self.data == AGENT_DEMOS and not self.agent_demos.teacher:
            raise ValueError(f"{prefix}.data={AGENT_DEMOS} records demonstrations with a teacher: set "
                             f"{prefix}.agent_demos.teacher='pkg.module:function' (docs/agent-programs.md)")


@dataclass
class WarmStartSettings:
    """The lr and warm-up SFT trains with, and why: the recipe's, or lowered for a terminator the model never
    produced (`terminator_nats`: the model's mean loss on the demonstrations' terminators, None: not measured)."""

    lr: float
    warmup_steps: int
    terminator: str
    terminator_nats: float | None
    adjusted: bool

    def describe(self, cfg: SFTConfig, default_warmup: int) -> str:
        """The one start-up line saying what SFT chose and from what it saw."""
        plural = "s" if self.warmup_steps != 1 else ""
        if self.terminator_nats is None:
            return f"sft: lr {self.lr:g}, warm-up {self.warmup_steps} step{plural} (sft.lr, sft.num_warmup_steps)"
        seen = f"terminator {self.terminator!r} costs {self.terminator_nats:.1f} nats"
        if not self.adjusted:
            return (f"sft: warm start: {seen} -> lr {self.lr:g}, warm-up {self.warmup_steps} step{plural} "
                    f"(sft.lr, sft.num_warmup_steps)")
        return (f"sft: warm start: base model ({seen}, above sft.unseen_terminator_nats="
                f"{cfg.unseen_terminator_nats:g}: it has never ended a turn this way) -> lr {self.lr:g}, warm-up "
                f"{self.warmup_steps} step{plural} (instead of sft.lr={cfg.lr:g} after {default_warmup}; "
                f"sft.unseen_terminator_lr / _warmup_steps; sft.unseen_terminator_nats=null keeps sft.lr)")


def terminator_nats(loss_masks: list[list[int]], response_ids: list[list[int]], logprobs: list[list[float]],
                    terminator_id: int) -> float | None:
    """The model's mean loss (nats) on the trained terminator tokens of the demonstrations; None without any."""
    costs = [-lp for mask, ids, lps in zip(loss_masks, response_ids, logprobs)
             for m, t, lp in zip(mask, ids, lps) if m and t == terminator_id]
    return sum(costs) / len(costs) if costs else None


def warm_start_settings(cfg: SFTConfig, total_steps: int, terminator: str, nats: float | None) -> WarmStartSettings:
    """sft.lr and the warm-up, or, for a model whose terminator costs more than sft.unseen_terminator_nats, the
    lower unseen-terminator lr with the longer warm-up (never beyond the run's steps: the lr would never arrive)."""
    warmup = cfg.warmup_steps(total_steps)
    limit = cfg.unseen_terminator_nats
    if limit is None or nats is None or nats <= limit:
        return WarmStartSettings(cfg.lr, warmup, terminator, nats, False)
    longer = max(warmup, min(cfg.unseen_terminator_warmup_steps, total_steps))
    return WarmStartSettings(min(cfg.lr, cfg.unseen_terminator_lr), longer, terminator, nats, True)


def split_turns(conversation: list[Message]) -> tuple[list[Message], list[Message], list[list[Message]]]:
    """(prompt, assistant turns, observations after each assistant turn but the last)."""
    first = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a conversation needs at least one assistant message to train on")
    prompt, assistants, observations = conversation[:first], [], []
    for m in conversation[first:]:
        if m["role"] == "assistant":
            assistants.append(m)
            observations.append([])
        else:
            observations[-1].append(m)
    return prompt, assistants, observations[:-1]


class _ReplayEnv:
    """Hands back a conversation's observations after each assistant turn; done after the last one. A conversation
    that calls tools is shown the run's tool schemas, as the `tool` env shows them in RL."""

    def __init__(self, conversations: list[list[Message]], tools: list[dict] | None = None,
                 own_tools: list[list[dict] | None] | None = None) -> None:
        self.conversations, self.observations, self.turn = conversations, [], 0
        self.tools, self.tool_schemas = tools or [], []
        self.own_tools = own_tools or [None] * len(conversations)

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        conversation = self.conversations[extras["conversation"]]
        _, _, self.observations = split_turns(conversation)
        own = self.own_tools[extras["conversation"]]
        # a conversation's own tools (what an agent sent the endpoint) are rendered whether or not it called one,
        # as the endpoint rendered them into every call's prompt
        self.tool_schemas = own if own is not None else self.tools if uses_tools(conversation) else []
        self.turn = 0
        return list(prompt_messages)

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        done = self.turn > len(self.observations)
        return StepResult([] if done else list(self.observations[self.turn - 1]), 0.0, done)


def uses_tools(conversation: list[Message]) -> bool:
    """A demonstration of tool use: an assistant message with `tool_calls`, or a `tool` message."""
    return any(m.get("tool_calls") or m["role"] == "tool" for m in conversation)


def demo_calls(message: Message) -> list[tuple[str, dict, str]]:
    """The OpenAI-shaped tool calls of a demonstration message (`{"type": "function", "id", "function": {"name",
    "arguments"}}`, arguments a JSON string or object) as (name, arguments, id); a call without an id gets a
    9-character one, the only shape every template accepts (Mistral's)."""
    calls = []
    for k, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"a tool call must be {{'type': 'function', 'function': {{'name', 'arguments'}}}} "
                             f"(OpenAI shape), got {str(call)[:120]!r}")
        arguments = function.get("arguments") or {}
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        calls.append((function["name"], arguments, call.get("id") or f"call{k:05d}"))
    return calls


def assistant_text(message: Message) -> str:
    """An assistant message in the hermes `<tool_call>` format: its content, then each call (the format SmolLM2,
    Qwen and Hermes models use, and the one our tools block teaches a template that renders no tools)."""
    parts = [message.get("content") or ""]
    for name, arguments, _ in demo_calls(message):
        parts.append("<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
                     + "\n</tool_call>")
    return "\n".join(p for p in parts if p)


def assistant_turn_ids(chat, conversation: list[Message], index: int, tools: list[dict] | None) -> list[int]:
    """What the model samples for the assistant message `conversation[index]`.

    A plain message: its content, tokenized canonically, closed by the turn terminator. A message with tool calls:
    the family's own rendering of that turn (`chat.turn_ids`), so the calls are trained in the format its parser
    reads (Llama JSON, Mistral [TOOL_CALLS], GLM XML, harmony, ...), accepted only when the parser reads back the
    demonstrated calls; a family whose template renders no calls falls back to the hermes text when hermes is what
    its parser reads, and is refused otherwise, naming the renderer."""
    from skyrl_stepwise.chat.tool_parsers import HERMES_FORMAT

    message = conversation[index]
    if not message.get("tool_calls"):
        return chat.encode(message["content"]) + [chat.close_id]
    calls = demo_calls(message)
    string_arguments = getattr(chat, "string_arguments", False)  # templates that print arguments as text
    rendered = {**message, "tool_calls": [
        {"type": "function", "id": call_id, "function": {
            "name": name, "arguments": json.dumps(arguments, ensure_ascii=False) if string_arguments else arguments}}
        for name, arguments, call_id in calls]}
    # some templates render calls only when content is null (DeepSeek R1 distills), others need a string
    contents = [rendered.get("content"), None] if rendered.get("content") == "" else [rendered.get("content")]
    why = "its rendering of the turn does not parse back into them"
    for content in contents:
        messages = [*conversation[:index], {**rendered, "content": content}, *conversation[index + 1:]]
        try:
            turn = turn_as_sampled(chat, messages, index, tools)
        except RenderError as e:  # e.g. a template that wants ids or roles the demonstration lacks
            why = why if content is None else str(e)  # the retry's failure says less than the first one's
            continue
        if turn is None:
            why = why if content is None else "the template rewrites the earlier messages when it renders the turn"
            continue
        parsed = chat.parse(turn.ids, chat.prompt_ids(conversation[:index], tools), tools)
        if parsed_calls(parsed) == [(name, arguments, None) for name, arguments, _ in calls]:
            if turn.prefill and chat.name not in _PREFILL_WARNED:
                _PREFILL_WARNED.add(chat.name)
                logger.warning(f"{chat.name}: the generation prompt adds {turn.prefill!r}, which the template's "
                               f"rendering of a tool-call turn lacks; SFT trains that turn's calls after it")
            return turn.ids
    hermes = getattr(getattr(chat, "tool_parser", None), "name", None) == "hermes" or \
        getattr(chat, "call_format", None) == HERMES_FORMAT
    if not hermes:
        raise ValueError(f"an SFT demonstration's tool calls {[c[0] for c in calls]} cannot be written in the call "
                         f"format of {chat.name}: {why}")
    return chat.encode(assistant_text(message)) + [chat.close_id]


def parsed_calls(parsed) -> list[tuple[str | None, Any, str | None]]:
    """(name, arguments as a dict, error) of each call of a parsed turn: what a demonstration's calls must read back
    as, arguments included (a reader that strips `    return x\n` to `return x` trains a call never made)."""
    from skyrl_stepwise.tools.executor import decode_arguments

    return [(c.name, decode_arguments(c.arguments)[0] if c.error is None else c.arguments, c.error)
            for c in parsed.tool_calls]


def keyed_to_parsed_calls(chat, conversation: list[Message], turn_ids: list[list[int]],
                          tools: list[dict] | None) -> list[Message]:
    """The conversation with the k-th `tool` message after each assistant turn answering that turn's k-th call as
    the parser reads the trained ids (its id, `call_0` where the format has none), as the tool env answers calls
    in RL: a demonstration's own ids (`toolu_01...`) would otherwise match no call, and templates that render a
    result only after its call (gpt-oss, Gemma 4) would get it as a user turn, a layout RL never produces."""
    out, turn, ids = [], -1, []
    for i, m in enumerate(conversation):
        if m["role"] == "assistant":
            turn, k = turn + 1, 0
            ids = chat.parse(turn_ids[turn], chat.prompt_ids(conversation[:i], tools), tools).call_ids() \
                if m.get("tool_calls") else []
        elif m["role"] == "tool" and turn >= 0:
            if k < len(ids):
                m = {**m, "tool_call_id": ids[k]}
            k += 1
        out.append(m)
    return out


def turn_as_sampled(chat, messages: list[Message], index: int, tools: list[dict] | None):
    """The family's rendering of turn `index`, closed as the message after it decides (GLM's `<|observation|>`
    before a tool result) only when that changes nothing but the closing token: a template that runs the next
    message into the turn without a stop token between (DeepSeek R1 distills) would otherwise have the model
    trained on the tool's output."""
    alone = chat.turn_ids(messages[:index + 1], index, tools)
    if alone is None or index + 1 >= len(messages):
        return alone
    followed = chat.turn_ids(messages, index, tools)
    if followed is not None and len(followed.ids) == len(alone.ids) and followed.ids[:-1] == alone.ids[:-1]:
        return followed
    return alone


def sft_renderer(tokenizer, gen_cfg: GeneratorConfig):
    """The run's renderer, as the generator builds it: its `close_id` is the turn terminator SFT trains."""
    return create_renderer(tokenizer, gen_cfg.renderer, dict(gen_cfg.chat_template_kwargs), gen_cfg.thinking_retention,
                           gen_cfg.tool_parser)


_PREFILL_WARNED: set[str] = set()  # renderers already warned about (once per process, not once per demonstration)


def conversation_samples(tokenizer, conversations: list[list[Message]], gen_cfg: GeneratorConfig,
                         tools: list[dict] | None = None,
                         own_tools: list[list[dict] | None] | None = None) -> GeneratorOutput:
    """One merged sample (or one per chain) per conversation, assistant tokens trained, built like rollouts.

    Each assistant turn is what a model writing it samples (assistant_turn_ids: canonical tokens closed by the
    turn terminator; a tool-call turn as the family's template renders it); `gen_cfg` (the run's generator
    config: renderer, stop strings, history mode) decides everything else, exactly as in RL. `tools`: the run's
    tool schemas, rendered into the prompt of every conversation that uses tools, so SFT prompts equal RL prompts.
    `own_tools`: per conversation, the tools it carries (an agent's, as recorded through the endpoint), rendered into
    every prompt of that conversation instead of `tools` (None: `tools`).
    """
    chat = sft_renderer(tokenizer, gen_cfg)
    own = own_tools or [None] * len(conversations)
    schemas = [o if o is not None else tools if uses_tools(c) else None for c, o in zip(conversations, own)]
    turns = [[assistant_turn_ids(chat, c, j, t) for j, m in enumerate(c) if m["role"] == "assistant"]
             for c, t in zip(conversations, schemas)]
    conversations = [keyed_to_parsed_calls(chat, c, ts, t) if uses_tools(c) else c
                     for c, ts, t in zip(conversations, turns, schemas)]
    longest = max(len(t) for ts in turns for t in ts)
    # a demonstration is replayed as written: a context policy would drop or summarise what the demonstrator saw
    # (and `summarize` would take the next scripted turn for a summary), so SFT runs with none, and every policy
    # of a comparison starts from the same warm start (generator.context is not in the SFT cache key)
    cfg = replace(gen_cfg, n_samples_per_prompt=1, step_wise_trajectories=True, merge_stepwise_output=True,
                  max_turns=max(len(ts) for ts in turns), max_input_length=1 << 30, show_progress=False,
                  apply_overlong_filtering=False, context=ContextConfig(),
                  sampling=replace(gen_cfg.sampling, max_generate_length=longest, logprobs=False, seed=None))
    registry = EnvRegistry()
    registry.register("replay", lambda: _ReplayEnv(conversations, tools, own_tools))
    engine = ScriptedEngine(lambda prompt, session, index: turns[int(session.rsplit("_", 1)[0])][index], tokenizer)
    generator = StepwiseGenerator(tokenizer, engine, registry, cfg)
    n = len(conversations)
    out = asyncio.run(generator.generate([split_turns(c)[0] for c in conversations], ["replay"] * n,
                                         [{"conversation": i} for i in range(n)],
                                         [TrajectoryID(str(i), 0) for i in range(n)]))
    if out.failed_trajectory_ids:
        bad = sorted(int(t.instance_id) for t in out.failed_trajectory_ids)
        raise ValueError(f"conversations {bad[:10]} cannot be rendered for SFT (see the warnings above)")
    return out


def sft_batches(samples: GeneratorOutput, batch_size: int, epochs: int, seed: int) -> list[TrainBatch]:
    """Shuffled mini-batches of whole conversations for every epoch, in order; reproducible from the seed."""
    batch = TrainBatch.from_output(samples)
    groups: dict[str, list[int]] = {}
    for i, iid in enumerate(batch.instance_ids):
        groups.setdefault(iid, []).append(i)
    keys, out = sorted(groups), []
    for epoch in range(epochs):
        order = keys[:]
        random.Random(seed + epoch).shuffle(order)
        for k in range(0, len(order), batch_size):
            out.append(batch.select([i for key in order[k:k + batch_size] for i in groups[key]]))
    return out


def train_sft(policy, batches: list[TrainBatch], ckpt_interval: int = 0, ckpt_dir: str | None = None,
              on_step=None, guard=None, on_restored=None) -> list[dict[str, float]]:
    """One optimizer step per batch with the cross-entropy objective; returns each step's metrics.

    With `ckpt_interval`, the policy checkpoints itself (into its own `ckpt_dir`, which must be `ckpt_dir`) every
    that many steps, and a later call with the same batches resumes after the latest complete checkpoint:
    weights, AdamW, schedule, RNG and the metrics so far come back, and the batches are a pure function of the
    seed, so the resumed run ends with exactly the weights of an uninterrupted one.
    `guard` (a DivergenceGuard) judges every step after `on_step` has logged it; a resumed run re-judges the
    steps it restored, so its start values are those of the uninterrupted run; `on_restored(step, metrics)` gets each
    restored step (to write it to a metrics file again), `on_step` only the steps trained now.
    """
    from skyrl_stepwise.checkpoint.store import lineage_entry
    from skyrl_stepwise.checkpoint.verify import resume_checkpoint

    history: list[dict[str, float]] = []
    lineage: list[dict] = []  # earlier SFT checkpoints: the worker keeps only the newest (trainer.max_ckpts_to_keep)
    resumed = resume_checkpoint("auto", ckpt_dir, lambda path: policy.call("load_checkpoint", str(path))) \
        if ckpt_interval and ckpt_dir else None
    if resumed is not None:
        state = resumed[1]
        history = list(state["history"])
        lineage = list(state["lineage"]) + [lineage_entry(state["step"], state["run_id"])]
    for step, batch in enumerate(batches, 1):
        if step <= len(history):
            if on_restored is not None:
                on_restored(step, history[step - 1])
            if guard is not None:
                guard.check(step, history[step - 1])
            continue
        metrics = policy.call("train_step", batch, "sft")
        history.append(metrics)
        if ckpt_interval and step % ckpt_interval == 0 and step < len(batches):
            policy.call("save_checkpoint", step, {"step": step, "history": history, "run_id": "sft",
                                                  "lineage": lineage})
            lineage.append(lineage_entry(step, "sft"))
        if on_step is not None:
            on_step(step, metrics)
        if guard is not None:
            guard.check(step, metrics)
    return history
