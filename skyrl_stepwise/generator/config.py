"""Typed generator config; key names follow SkyRL's `generator.*` so its users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GeneratorSamplingConfig:
    """Per-turn sampling; `max_generate_length` is per turn, not per trajectory."""

    max_generate_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    logprobs: bool = True
    seed: int | None = None


@dataclass
class GeneratorConfig:
    """How trajectories are rolled out and turned into samples."""

    max_turns: int = 4
    max_input_length: int = 2048
    sampling: GeneratorSamplingConfig = field(default_factory=GeneratorSamplingConfig)
    n_samples_per_prompt: int = 1
    use_conversation_multi_turn: bool = True
    step_wise_trajectories: bool = True
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
    append_eos_after_stop_str: bool = True
    # Zero the loss mask of trajectories that ended by length (generation or context) instead of by the
    # model's own EOS or the env (SkyRL's apply_overlong_filtering); counted in generate/overlong_filtered_*.
    apply_overlong_filtering: bool = False
    show_progress: bool = True

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
