"""Dropout off in the trainer: the engines sample (and score) without it, so the trainer must score without it too.

The policy trains in `train()` mode (gradient checkpointing and other training-only paths need it), and in that mode
every dropout of a config that has one (GPT-2's `attn_pdrop`/`resid_pdrop`/`embd_pdrop`, OPT's `dropout`, Phi-2's
`resid_pdrop`, ...) would drop activations in the forward that computes the training logprobs. The engine never did,
so the PPO ratio and the TIS weights would compare two different functions, and a "fresh" logprob would change from
one forward to the next. MoE router jitter (`router_jitter_noise`) and LayerDrop (OPT's `layerdrop`: whole layers
skipped at random), applied in training only, are the same kind of noise and go with it.

Setting `model.eval()` for the forward instead would also switch off what transformers only does in training mode
(gradient checkpointing), so the probabilities themselves are set to 0, wherever transformers keeps them: the
`nn.Dropout` modules, float attributes of modules that functional dropout reads (`self.attention_dropout`,
`self.dropout`), and the config fields a forward may read directly (`config.hidden_dropout`).
`trainer.keep_dropout=true` keeps the model's dropout (it then also applies in SFT, which follows the same rule).
"""

from __future__ import annotations

import re

import torch

# attribute names that hold a dropout probability (or a training-only noise level) in transformers' models
NOISE_NAME = re.compile(r"dropout|pdrop|layerdrop|jitter_noise", re.IGNORECASE)


def _is_probability(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _configs(config) -> list:
    """The config and its sub-configs (text_config, vision_config, ...): a forward may read any of them."""
    found, todo = [], [config]
    while todo:
        c = todo.pop()
        if any(c is f for f in found):
            continue
        found.append(c)
        todo.extend(v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    return found


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout probability (and router jitter) of `model` to 0, in its config, its modules' float
    attributes and its `nn.Dropout` modules; returns what was non-zero, e.g. ["attn_pdrop=0.1", "resid_pdrop=0.1"],
    empty when the model had none. Must run before the first forward that is trained."""
    turned_off: dict[str, float] = {}
    for config in _configs(model.config):
        for key, value in list(vars(config).items()):
            if NOISE_NAME.search(key) and _is_probability(value):
                turned_off.setdefault(key, value)
                setattr(config, key, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            turned_off.setdefault(f"{type(module).__name__}(p={module.p:g})", module.p)
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if not key.startswith("_") and NOISE_NAME.search(key) and _is_probability(value):
                turned_off.setdefault(key, value)
                setattr(module, key, 0.0)
    return [f"{k}={v:g}" if "(" not in k else k for k, v in turned_off.items()]


def dropout_note(turned_off: list[str]) -> str | None:
    """The start-up log line for what `disable_dropout` turned off (None when nothing was)."""
    if not turned_off:
        return None
    return (f"dropout off in the trainer, as in the engines that sample: {', '.join(turned_off)} set to 0 "
            f"(trainer.keep_dropout=true keeps it)")
