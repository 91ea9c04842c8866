"""Typed generator config; key names follow SkyRL's `generator.*` so its users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GeneratorSamplingConfig:
    """Per-turn sampling; `max_generate_length` is per turn, not per trajectory."""

    max_generate_length: int = 256  # tokens sampled per turn at most (finish reason `length` past it)
    temperature: float = 1.0  # trainer.temperature must equal it (checked at start-up)
    top_p: float = 1.0  # nucleus sampling; 1.0: off (trainer.top_p follows it)
    top_k: int = -1  # sample from the k most likely tokens; -1: off (trainer.top_k follows it)
    stop: list[str] = field(default_factory=list)  # strings that end a turn, kept in the action (e.g. </search>)
    # record the engine's logprob of each sampled token (truncated IS, the agreement check, the endpoint's logprobs)
    logprobs: bool = True
    # null: unseeded sampling; a number: each (trajectory, turn) samples with a seed derived from it, so a rerun
    # samples the same ids
    seed: int | None = None


CONTEXT_POLICIES = ("none", "truncate", "sliding_window", "summarize")
DEFAULT_SUMMARY_INSTRUCTION = ("Your context is nearly full. Summarise everything you have learned so far that you still "
                               "need to finish the task (facts found, what you tried, what is left), as concisely as "
                               "you can. Do not call tools in this turn.")
DEFAULT_RESUME_MESSAGE = "Continue the task from your summary above."


@dataclass
class ContextConfig:
    """How a trajectory's context is managed between turns (generator/context.py). See README "Long-horizon
    agents: context policies". Every policy keeps sampled ids exact; an edit starts a new step chain."""

    # none | truncate | sliding_window | summarize | a plugin `pkg.module:Class` (built with this config)
    policy: str = "none"
    # truncate: each observation message capped at this many tokens (head + tail, a marker says how many were cut)
    max_observation_tokens: int = 256
    truncate_head_fraction: float = 0.5  # share of the cap kept from the start of the observation
    # sliding_window: the observations of the last `window` turns are kept; older ones become `placeholder`
    window: int = 2
    placeholder: str = "[older observation removed: {tokens} tokens]"  # sliding_window: replaces a dropped observation
    # summarize: when the next prompt would exceed `summarize_threshold` tokens (null: 3/4 of max_input_length),
    # the policy model writes a summary turn and the context restarts from the first messages and that summary
    summarize_threshold: int | None = None
    summary_instruction: str = DEFAULT_SUMMARY_INSTRUCTION  # summarize: the user message that asks for the summary
    resume_message: str = DEFAULT_RESUME_MESSAGE  # summarize: the user message after the summary, in the new context
    train_summaries: bool = True  # summary turns are actions trained with the trajectory's credit; false: masked
    max_summaries: int = 8  # per trajectory
    # per trajectory, sampled + observed tokens; past it the trajectory stops with `budget_exhausted` (null: none)
    token_budget: int | None = None
    # SUPO-style: trajectories that stop at a limit (context_exhausted, budget_exhausted) get no gradient (their
    # loss mask zeroed) instead of being trained on a reward the cut made up; counted in
    # generate/overlong_filtered_trajectories
    mask_limit_stops: bool = False

    def validate(self, max_input_length: int, conversation: bool) -> None:
        """Refuse a context config that cannot work, naming the key (a plugin is imported now, like env plugins)."""
        where = "generator.context"
        if self.policy not in CONTEXT_POLICIES:
            if ":" not in self.policy:
                raise ValueError(f"{where}.policy={self.policy!r} is not one of {list(CONTEXT_POLICIES)} nor a "
                                 "plugin 'pkg.module:Class'")
            load_plugin(self.policy, f"{where}.policy")
        if self.policy != "none" and not conversation:
            raise ValueError(f"{where}.policy={self.policy!r} edits chat turns: it needs "
                             "generator.use_conversation_multi_turn=true")
        for key, value in (("max_observation_tokens", self.max_observation_tokens), ("window", self.window),
                           ("max_summaries", self.max_summaries)):
            if value < (0 if key == "max_summaries" else 1):
                raise ValueError(f"{where}.{key} must be >= 1, got {value}")
        if not 0.0 <= self.truncate_head_fraction <= 1.0:
            raise ValueError(f"{where}.truncate_head_fraction must be in [0, 1], got {self.truncate_head_fraction}")
        if self.summarize_threshold is not None and not 0 < self.summarize_threshold <= max_input_length:
            raise ValueError(f"{where}.summarize_threshold={self.summarize_threshold} must be in (0, "
                             f"generator.max_input_length={max_input_length}]: the summary prompt is the prompt that "
                             "crossed it plus the instruction, and it must still fit")
        if self.token_budget is not None and self.token_budget <= 0:
            raise ValueError(f"{where}.token_budget must be > 0 or null, got {self.token_budget}")
        if "{tokens}" not in self.placeholder and "{" in self.placeholder:
            raise ValueError(f"{where}.placeholder may use only the field {{tokens}}, got {self.placeholder!r}")

    def threshold(self, max_input_length: int) -> int:
        """The summarize trigger in tokens: the key, or 3/4 of max_input_length (room for the summary turn)."""
        return self.summarize_threshold if self.summarize_threshold is not None else (3 * max_input_length) // 4


@dataclass
class GeneratorConfig:
    """How trajectories are rolled out and turned into samples."""

    max_turns: int = 4  # model turns per trajectory at most; the last one ends it whatever the env says
    # tokens a turn's prompt may have; a longer one stops the trajectory (context_exhausted)
    max_input_length: int = 2048
    sampling: GeneratorSamplingConfig = field(default_factory=GeneratorSamplingConfig)
    n_samples_per_prompt: int = 1  # trajectories per prompt: the group GRPO/RLOO baseline against each other
    # true: each turn's observations are a new chat message and the next turn a new assistant message; false: one
    # growing assistant message with observations spliced in (Search-R1's original format)
    use_conversation_multi_turn: bool = True
    # true: every turn is a training sample of its own (its prompt: the context at that turn); false: a trajectory's
    # turns are merged into one sample per exact token chain (the whole-trajectory sample, observations masked)
    step_wise_trajectories: bool = True
    # step-wise only: merge a trajectory's turns back into the fewest exact token chains (a turn joins the previous
    # one when that one's prompt + response is a prefix of its prompt), so a shared prefix is computed once
    merge_stepwise_output: bool = False
    # "exact": next prompt = prompt + sampled ids (+ appended EOS) + template bridge ids.
    # "retokenize": apply the chat template to the text history every turn (the common behaviour).
    history: str = "exact"
    # Who renders the chat: auto (the `renderers` library where it knows the model, else the chat template),
    # template, or a `renderers` name (qwen3, llama-3, gpt-oss, ...). See README "Token-exact on your model".
    renderer: str = "auto"
    # The tool-call format of the chat template backend: auto (the one the model's template renders a probe call
    # in), or a format name (hermes, llama_json, glm, qwen_xml, deepseek_v3, ...). See README "Tool calls".
    tool_parser: str = "auto"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    # template: follow the chat template (Qwen3 drops past reasoning: a new chain at each user turn, counted);
    # all: keep everything sampled in the history, so a trajectory stays one chain.
    thinking_retention: str = "template"
    # a chat turn that ended on a stop string gets the template's end-of-message token appended (loss-masked, never a
    # target), as the turn the template renders would have it; false: the turn stays open
    append_eos_after_stop_str: bool = True
    # Zero the loss mask of trajectories that ended by length (generation or context) instead of by the
    # model's own EOS or the env (SkyRL's apply_overlong_filtering); counted in generate/overlong_filtered_*.
    apply_overlong_filtering: bool = False
    show_progress: bool = True  # a tqdm bar over each step's rollouts on stderr
    context: ContextConfig = field(default_factory=ContextConfig)
    # Seconds one env call (reset, step / step_turn, on_context_exhausted, aclose) may take. Past it the trajectory
    # fails (env_reset / env_step, "timed out": contained, counted, never trained) and a close is abandoned and
    # counted (generate/env_close_errors): a hung env or reward function never hangs the step. null: no limit.
    env_timeout_s: float | None = 600.0

    def validate(self) -> None:
        """Reject combinations that would silently train on the wrong thing, naming the key."""
        if self.history not in ("exact", "retokenize"):
            raise ValueError(f"generator.history must be 'exact' or 'retokenize', got {self.history!r}")
        if self.thinking_retention not in ("template", "all"):
            raise ValueError(f"generator.thinking_retention must be 'template' or 'all', got {self.thinking_retention!r}")
        if self.renderer not in ("auto", "template"):
            from skyrl_stepwise.chat import renderer_names

            if self.renderer not in renderer_names():
                raise ValueError(f"generator.renderer={self.renderer!r} is not one of {renderer_names()}")
        from skyrl_stepwise.chat.tool_formats import tool_format_names

        if self.tool_parser not in tool_format_names():
            raise ValueError(f"generator.tool_parser={self.tool_parser!r} is not one of {tool_format_names()}")
        if self.merge_stepwise_output and not self.step_wise_trajectories:
            raise ValueError("generator.merge_stepwise_output=true requires generator.step_wise_trajectories=true")
        for key, value in (("generator.max_turns", self.max_turns),
                           ("generator.max_input_length", self.max_input_length),
                           ("generator.sampling.max_generate_length", self.sampling.max_generate_length),
                           ("generator.n_samples_per_prompt", self.n_samples_per_prompt)):
            if value <= 0:
                raise ValueError(f"{key} must be > 0, got {value}")
        if self.env_timeout_s is not None and self.env_timeout_s <= 0:
            raise ValueError(f"generator.env_timeout_s must be > 0 (or null: no limit), got {self.env_timeout_s}")
        self.context.validate(self.max_input_length, self.use_conversation_multi_turn)


def load_plugin(path: str, where: str) -> type:
    """Import a `pkg.module:Class` context policy now, so a broken plugin fails at start-up naming the key (here,
    beside the config that names it: generator/context.py builds on this module, not the other way round)."""
    from skyrl_stepwise.envs.builtin import EnvPluginError, import_object

    try:
        cls = import_object(path, where)
    except EnvPluginError as e:
        raise ValueError(str(e)) from None
    if not callable(getattr(cls, "between_turns", None)):
        raise ValueError(f"{where}: {path!r} has no between_turns(view) method; a context policy offers "
                         "between_turns(view) -> ContextEdit | None and optionally observe(observations, tokens)")
    return cls
