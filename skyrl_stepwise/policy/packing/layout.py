"""What an architecture needs for its packed samples to stay apart: read once from the model, never per family.

A packed row (several samples end to end, or one prefix trie) is exact only if every token sees exactly the keys it
saw when its sample ran alone. Three things decide whether the trainer can guarantee that:

- **attention windows.** transformers takes a prepared 4D mask as-is, so our mask must carry every restriction the
  model would have built itself: a sliding window per layer type (`config.layer_types`, `config.sliding_window`).
  Windows are measured in positions (= depths in a trie), as transformers' `sliding_window_overlay` does.
- **recurrent state.** Mamba, gated-delta-net, short-conv and other linear-attention layers carry a state along the
  row, so no mask can separate two samples in one row: such models get one sample per row, and no tree.
- **RoPE that follows the forward's length** (longrope, dynamic NTK; models/rope.py): longrope rows are exact only
  while no row of several samples can pass the switch length; dynamic NTK is refused.
- **masks the model ignores.** A model that builds its masks without position ids (gpt-oss) or has a layer type we do
  not know gets explicit masks, and the start-up self-check (packing/selfcheck.py) proves the result on the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_stepwise.models.rope import length_dependent_rope

# Layer types whose mask we can build: the window each adds on top of causal attention (None = no window).
FULL_ATTENTION_TYPES = ("full_attention", "attention", "global_attention")
SLIDING_ATTENTION_TYPES = ("sliding_attention", "local_attention")
DENSE_MASK_ATTENTIONS = ("sdpa", "eager")
VARLEN_ATTENTIONS = ("flash_attention_2", "flash_attention_3")
PACKINGS = ("auto", "rows", "tree")


@dataclass(frozen=True)
class AttentionLayout:
    """How a model's layers attend, as far as packing is concerned.

    `windows` maps each layer type the model uses to its sliding window (None: full causal attention); a model
    without `layer_types` has one entry. `stateful_layers` names the layer types that carry a state along the row
    (recurrent / linear attention / convolution) or that we cannot mask (chunked attention): with any of them, a row
    holds one sample and a tree is refused.
    """

    model_type: str
    attn_implementation: str
    windows: dict[str, int | None]
    stateful_layers: tuple[str, ...] = ()
    attention_softcap: float | None = None  # Gemma 2's attn_logit_softcapping: sdpa silently ignores it
    attention_sinks: bool = False  # gpt-oss's learned sinks: only eager (and some flash kernels) apply them
    length_dependent_rope: str | None = None  # "longrope" / "dynamic": frequencies follow the forward's length
    rope_switch_length: int | None = None  # longrope: a forward past this many positions takes the long factors
    row_tokens: int | None = None  # the most tokens a packed row holds (trainer.micro_batch_tokens); None: unknown

    @property
    def rope_splits_rows(self) -> bool:
        """True when longrope could switch a packed row to its long factors: rows may hold more tokens than the
        switch length (or their size is unknown), so a short sample could share a row with a long one."""
        return self.length_dependent_rope == "longrope" and (
            self.row_tokens is None or self.rope_switch_length is None or self.row_tokens > self.rope_switch_length)

    @property
    def one_sample_per_row(self) -> bool:
        """True when samples cannot share a row: state carried along it, a layer we cannot mask, or a RoPE whose
        frequencies a longer row-mate would change."""
        return bool(self.stateful_layers) or self.rope_splits_rows

    def why_one_sample_per_row(self) -> str:
        """Why samples cannot share a row here (for refusals)."""
        if self.stateful_layers:
            return f"its layers {', '.join(self.stateful_layers)} carry a state along the row"
        return (f"its longrope RoPE switches a whole row to the long factors once the row passes "
                f"{self.rope_switch_length} positions, and rows may hold {self.row_tokens or 'any number of'} tokens "
                f"(keep trainer.micro_batch_tokens <= {self.rope_switch_length} to pack)")

    @property
    def per_layer_type_masks(self) -> bool:
        """True when layer types need different masks: the model then gets {layer_type: mask} (transformers' own
        causal_mask_mapping, which models with `layer_types` take as-is)."""
        return len(set(self.windows.values())) > 1

    @property
    def max_window(self) -> int | None:
        """The longest sliding window (probe samples must be longer than it); None when no layer has one."""
        finite = [w for w in self.windows.values() if w is not None]
        return max(finite) if finite else None

    def describe(self) -> str:
        """One line for logs and refusals: model type, attention, windows, recurrent layers."""
        windows = ", ".join(f"{t}: {'full' if w is None else f'window {w}'}" for t, w in self.windows.items())
        stateful = f"; state-carrying layers: {', '.join(self.stateful_layers)}" if self.stateful_layers else ""
        rope = (f"; {self.length_dependent_rope} RoPE (switch at {self.rope_switch_length} positions)"
                if self.length_dependent_rope else "")
        return f"{self.model_type} ({self.attn_implementation}; {windows}{stateful}{rope})"


def _text_config(config):
    """The decoder's config (multimodal models keep it under text_config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_windows(config) -> tuple[dict[str, int | None], list[str]]:
    """Each layer type's sliding window (None: full attention) and the layer types we cannot mask, from a config.

    Unknown layer types count as state-carrying: a row then holds one sample, which is exact for any causal model.
    """
    config = _text_config(config)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = list(getattr(config, "layer_types", None) or [])
    if not layer_types:
        layer_types = ["sliding_attention" if window else "full_attention"]
    windows: dict[str, int | None] = {}
    stateful: list[str] = []
    for t in dict.fromkeys(layer_types):
        if t in FULL_ATTENTION_TYPES:
            windows[t] = None
        elif t in SLIDING_ATTENTION_TYPES:
            if not window:
                raise ValueError(f"{config.model_type}: layer type {t!r} but config.sliding_window={window!r}")
            windows[t] = int(window)
        else:
            stateful.append(t)
    return windows, stateful


def max_sliding_window(config) -> int | None:
    """The longest sliding window of a model config (None without one): what a probe sequence must exceed."""
    finite = [w for w in layer_windows(config)[0].values() if w is not None]
    return max(finite) if finite else None


def attention_layout(model: torch.nn.Module, row_tokens: int | None = None) -> AttentionLayout:
    """Read the layout from the model's config and class: `layer_types`, `sliding_window`, `_is_stateful`, RoPE.

    `row_tokens` is the most tokens a packed row will hold (trainer.micro_batch_tokens); unknown (None), a longrope
    model gets one sample per row.
    """
    config = _text_config(model.config)
    rope_kind, rope_switch = length_dependent_rope(config)
    windows, stateful = layer_windows(config)
    inner = getattr(model, "module", model)  # an FSDP/DDP wrapper keeps the HF model as .module
    if getattr(inner, "_is_stateful", False) and not stateful:
        stateful.append("recurrent")
    return AttentionLayout(model_type=config.model_type, attn_implementation=model.config._attn_implementation,
                           windows=windows, stateful_layers=tuple(stateful),
                           attention_softcap=getattr(config, "attn_logit_softcapping", None),
                           attention_sinks=any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter)
                                               for m in model.modules()),
                           length_dependent_rope=rope_kind, rope_switch_length=rope_switch, row_tokens=row_tokens)


def refuse_inexact_attention(layout: AttentionLayout, key: str = "trainer.attn_implementation") -> None:
    """Refuse an attention implementation that computes another function than the model's own, whatever the packing.

    transformers' sdpa path drops attention logit soft-capping without a word, so a Gemma 2 trainer on sdpa would
    score every token differently from the engine that sampled it; our packed flex attention has no soft-capping
    either (a score_mod failed to compile on an H200, benchmarks/gpu_packing.py).
    """
    attn = layout.attn_implementation
    if layout.attention_softcap and attn not in ("eager",) and not attn.startswith("flash_attention"):
        raise ValueError(f"{key}={attn} is not exact on {layout.describe()}: it ignores the model's attention logit "
                         f"soft-capping ({layout.attention_softcap}), which the engines apply. Use {key}=eager")
    if layout.length_dependent_rope == "dynamic":
        raise ValueError(f"no trainer.packing is exact on {layout.describe()}: transformers' dynamic NTK RoPE "
                         f"recomputes its frequencies from the longest position of each forward and keeps them for "
                         f"later forwards, so a sample's logprobs depend on its row-mates and on earlier micro-batches "
                         f"(and not on the sample alone, as the engine scored it). Use a checkpoint with a static "
                         f"rope_type (default, linear, yarn, llama3)")
    if layout.attention_sinks and attn not in ("eager",) and not attn.startswith("flash_attention"):
        raise ValueError(f"{key}={attn} is not exact on {layout.describe()}: the packed rows' attention does not "
                         f"apply the model's attention sinks. Use {key}=eager")


def resolve_packing(packing: str, layout: AttentionLayout, key: str = "trainer.packing") -> str:
    """The packing a run uses on this model: `auto` becomes tree wherever the tree is exact, else rows.

    An explicit `tree` that cannot be exact here (state carried along the row, or an attention that takes no
    tree mask) is refused, naming the model type and the key, instead of training on other contexts.
    """
    if packing not in PACKINGS:
        raise ValueError(f"{key}: {packing!r} is not one of {PACKINGS}")
    attn = layout.attn_implementation
    tree_ok = not layout.one_sample_per_row and attn not in VARLEN_ATTENTIONS
    if packing == "auto":
        return "tree" if tree_ok else "rows"
    if packing == "tree" and not tree_ok:
        why = (f"{layout.why_one_sample_per_row()}, so prefix-shared samples cannot be kept apart"
               if layout.one_sample_per_row
               else f"attn_implementation={attn} (varlen) cannot express a tree mask")
        raise ValueError(f"{key}=tree is not exact on {layout.describe()}: {why}. Use {key}=rows (or auto)")
    return packing
