"""LoRA on the FSDP2 policy (`trainer.lora.enabled=true`), on peft.

peft injects its LoRA layers into the HF model in place (`inject_adapter_in_model`) before the model is sharded,
so the rest of the worker (packing, layout, self-check, checkpoints) sees the same model object, and only the
adapter's parameters require grad (the optimizer is built from those alone).

Two things the engines and the KL loss need are built here on peft's layers:
  - the reference is the base model: the same sharded model with every adapter layer switched off
    (`adapter_disabled`, what peft's `PeftModel.disable_adapter()` does), no second copy of the weights;
  - the engines receive merged full weights under the base model's names (`merged_items`): W + scaling * B @ A
    (transposed for GPT-2's Conv1D, fan_in_fan_out), computed on the gathered full tensors, so engines load
    them unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from skyrl_stepwise.policy.config import LoRAConfig

ADAPTER = "default"  # peft's adapter name: one adapter per policy
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdaptedLayer:
    """What merging one adapted layer needs: peft's scaling (alpha / rank) and whether the base weight is stored
    transposed ([in, out], GPT-2's Conv1D)."""

    scaling: float
    fan_in_fan_out: bool


def _linear_classes() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return torch.nn.Linear, Conv1D


def decoder_linear_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every linear layer (nn.Linear, GPT-2's Conv1D) inside the model's decoder layers (the classes HF lists in
    `_no_split_modules`), by full module name: what LoRA may adapt (never the embeddings or the LM head)."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    linear = _linear_classes()
    found: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if type(module).__name__ in layer_classes:
            for sub, child in module.named_modules():
                if sub and isinstance(child, linear):
                    found[f"{name}.{sub}"] = child
    return found


def resolve_target_modules(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The full module names `targets` (trainer.lora.target_modules) name on this model: each entry is a module
    name or its suffix (peft's rule), or "all-linear". An entry that names none of the decoder layers' linear
    modules is refused, listing the names there are."""
    candidates = decoder_linear_modules(model)
    if not candidates:
        raise ValueError(f"trainer.lora: {type(model).__name__} has no linear modules inside its decoder layers "
                         f"({getattr(model, '_no_split_modules', None)}) for LoRA to adapt")
    chosen: dict[str, None] = {}
    for target in targets:
        if target == ALL_LINEAR:
            chosen.update(dict.fromkeys(candidates))
            continue
        hits = [n for n in candidates if n == target or n.endswith(f".{target}")]
        if not hits:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in candidates})
            raise ValueError(f"trainer.lora.target_modules: {target!r} names no linear module in the decoder layers "
                             f"of {type(model).__name__}; its linear modules are {leaves} (or use {ALL_LINEAR})")
        chosen.update(dict.fromkeys(hits))
    return list(chosen)


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig) -> str:
    """Inject a LoRA adapter into `model` in place (before sharding) and freeze everything else; returns the
    start-up log line. B starts at zero, so the adapted model computes exactly what the base does."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers.pytorch_utils import Conv1D

    targets = resolve_target_modules(model, list(cfg.target_modules))
    modules = decoder_linear_modules(model)
    conv1d = [n for n in targets if isinstance(modules[n], Conv1D)]
    if conv1d and len(conv1d) != len(targets):
        raise ValueError(f"trainer.lora.target_modules mixes Conv1D ({conv1d[:3]}) and nn.Linear modules, whose "
                         f"weights peft stores transposed to each other; adapt one kind only")
    inject_adapter_in_model(LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                       target_modules=targets, bias="none", fan_in_fan_out=bool(conv1d)), model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    stray = [n for n in trainable if ".lora_" not in n]
    if not trainable or stray:
        raise RuntimeError(f"LoRA left {len(trainable) - len(stray)} adapter and these other parameters trainable: "
                           f"{stray[:5]}")
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    leaves = sorted({n.rsplit(".", 1)[-1] for n in targets})
    return (f"LoRA rank {cfg.rank}, alpha {cfg.alpha:g} on {len(targets)} modules ({', '.join(leaves)}): "
            f"{count:,} of {total:,} parameters train")


def adapted_layers(model: torch.nn.Module) -> dict[str, AdaptedLayer]:
    """Every LoRA layer of `model` by module name (empty without LoRA)."""
    from peft.tuners.lora import LoraLayer

    return {name: AdaptedLayer(float(m.scaling[ADAPTER]), bool(m.fan_in_fan_out))
            for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module):
    """The base model inside the block: every adapter layer switched off (peft's `enable_adapters(False)`, what
    `PeftModel.disable_adapter()` does), restored after, with the parameters' requires_grad as they were."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in grads:
            param.requires_grad_(flag)


def merged_items(state: dict[str, torch.Tensor], layers: dict[str, AdaptedLayer],
                 full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                 deferred: bool = False) -> Iterator[tuple[str, torch.Tensor | LowRankSum]]:
    """(base model name, merged weight) for every tensor of an adapted model's state dict, in its order: an
    adapted layer's `base_layer.weight` becomes W + scaling * B @ A under the layer's own name, the adapter's own
    tensors are left out, and every other tensor passes under its name. `full` turns a state-dict entry into its
    full tensor (DTensor.full_tensor on a sharded model: a collective, called in the same order on every rank).
    `deferred`: a merged weight comes as its LowRankSum, computed only where it is written (the weights file)."""
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        module, sep, leaf = name.partition(".base_layer.")
        if not sep:
            yield name, full(tensor)
            continue
        value = full(tensor)
        layer = layers.get(module)
        if leaf == "weight" and layer is not None:
            a = full(state[f"{module}.lora_A.{ADAPTER}.weight"]).to(value.dtype)
            b = full(state[f"{module}.lora_B.{ADAPTER}.weight"]).to(value.dtype)
            value = LowRankSum(value, a, b, layer) if deferred else merge_factors(value, a, b, layer)
        yield f"{module}.{leaf}", value


def merge_factors(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: AdaptedLayer,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """W + scaling * B @ A ((B @ A)^T for a transposed Conv1D weight) as one fused addmm, into `out` when given (of
    W's dtype and device) else into one new tensor: no rank-sized delta the size of W is materialised and added in
    a second pass."""
    with torch.no_grad():
        if layer.fan_in_fan_out:
            return torch.addmm(weight, a.T, b.T, alpha=layer.scaling, out=out)
        return torch.addmm(weight, b, a, alpha=layer.scaling, out=out)


@dataclass(frozen=True)
class LowRankSum:
    """A merged LoRA weight not yet computed: W + scaling * B @ A, written by `write_into` straight into the buffer
    it leaves through (inference/weights.write_weights_file). Merging into a tensor of its own first allocated and
    filled every adapted weight once more, which made LoRA's export for the engines slower than full's
    (docs/lora.md)."""

    weight: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    layer: AdaptedLayer

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def numel(self) -> int:
        return self.weight.numel()

    def tensor(self) -> torch.Tensor:
        return merge_factors(self.weight, self.a, self.b, self.layer)

    def write_into(self, out: torch.Tensor) -> None:
        if out.dtype == self.weight.dtype and out.device == self.weight.device:
            merge_factors(self.weight, self.a, self.b, self.layer, out=out)
        else:
            out.copy_(self.tensor())


def merged_shapes(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The (name, shape) pairs `merged_items` yields, from the adapted model's state-dict shapes: no weights."""
    for name, shape in shapes:
        if ".lora_" not in name:
            yield name.replace(".base_layer.", ".", 1), shape


# ------------------------------------------------------------------ adapter-only checkpoints and export (#46)

def is_adapter_key(name: str) -> bool:
    """Whether a state-dict / parameter name is one of the adapter's own tensors (lora_A / lora_B): what an
    adapter-only checkpoint keeps (the frozen base is re-read from trainer.model_path at resume)."""
    return ".lora_" in name


def base_weights_checksum(named_parameters: Iterable[tuple[str, torch.Tensor]],
                          checksum: Callable[[Iterable[tuple[str, torch.Tensor]]], str]) -> str:
    """The digest (`checksum`, fsdp_worker.weights_checksum) of the frozen base's tensors alone, the adapter's
    left out: the identity an adapter-only checkpoint records, so a resume on other base weights is refused."""
    return checksum((n, p) for n, p in named_parameters if not is_adapter_key(n))


class AdapterRecipeMismatch(ValueError):
    """A resume whose trainer.lora would build another adapter than the checkpoint holds: a configuration error
    naming `trainer.lora.<key>` and both values, never CorruptCheckpoint (the checkpoint itself is intact)."""


# the recipe keys that make the saved A and B another policy (or unloadable) when they differ at resume; dropout is
# recorded too but is a training setting like the learning rate (the run dir's config check covers it)
RECIPE_KEYS = ("rank", "alpha", "target_modules")


def adapter_recipe(model: torch.nn.Module, cfg: LoRAConfig) -> dict:
    """What rebuilding this adapter on the base needs (rank, alpha, the resolved full module names), with the
    configured target_modules and dropout: recorded in the checkpoint so a resume is checked against it before any
    tensor loads (`check_adapter_recipe`) and `model export` needs nothing but the checkpoint and the base folder."""
    return {"rank": cfg.rank, "alpha": cfg.alpha, "target_modules": sorted(adapted_layers(model)),
            "configured_target_modules": list(cfg.target_modules), "dropout": cfg.dropout}


def check_adapter_recipe(saved: dict | None, here: dict | None, checkpoint: str) -> None:
    """Refuse (AdapterRecipeMismatch) resuming the checkpoint's adapter `saved` (its recorded recipe; None: a full
    model) into the adapter `here` (this run's recipe; None: LoRA off) when they differ in trainer.lora.enabled,
    rank, alpha or the modules adapted (compared as resolved, so "all-linear" and the full list agree)."""
    if (saved is None) != (here is None):
        raise AdapterRecipeMismatch(
            f"checkpoint {checkpoint} holds {'a LoRA adapter' if saved else 'a full model'} but trainer.lora.enabled="
            f"{here is not None} (saved with {saved is not None}): resume with the setting it was saved with")
    if saved is None:
        return
    found = [_recipe_difference(key, saved, here) for key in RECIPE_KEYS if key in saved]
    found = [line for line in found if line]
    if found:
        raise AdapterRecipeMismatch(
            f"checkpoint {checkpoint} holds a LoRA adapter of another recipe than trainer.lora builds here, so its "
            "tensors would load into another policy (or not at all): " + "; ".join(found) +
            ". Resume with the saved values, or start a new run (trainer.resume=none and a new trainer.ckpt_dir)")


def _recipe_difference(key: str, saved: dict, here: dict) -> str | None:
    """`trainer.lora.<key>: saved X, now Y` when the recipes differ in `key`, else None."""
    if key == "target_modules":
        return _modules_difference(saved, here)
    cast = int if key == "rank" else float
    if cast(saved[key]) == cast(here[key]):
        return None
    return f"trainer.lora.{key}: saved {saved[key]!r}, now {here[key]!r}"


def _modules_difference(saved: dict, here: dict) -> str | None:
    """The target_modules line: the configured values (saved, now), and a few modules adapted on one side only."""
    old, new = set(saved["target_modules"]), set(here["target_modules"])
    if old == new:
        return None
    return (f"trainer.lora.target_modules: saved {saved.get('configured_target_modules', '?')} ({len(old)} modules), "
            f"now {here.get('configured_target_modules', '?')} ({len(new)} modules); adapted only in the checkpoint "
            f"{sorted(old - new)[:3]}, only here {sorted(new - old)[:3]}")


def peft_lora_config(model: torch.nn.Module, recipe: dict, base_model_name_or_path: str | None = None):
    """peft's LoraConfig of an adapter recorded by `adapter_recipe`, for `get_peft_model` on a plain HF model:
    the same layers, scaling and fan_in_fan_out (GPT-2's Conv1D) as `apply_lora` injected."""
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    modules = decoder_linear_modules(model)
    targets = list(recipe["target_modules"])
    missing = [n for n in targets if n not in modules]
    if missing:
        raise ValueError(f"the checkpoint's LoRA target modules {missing[:3]} are not linear modules of "
                         f"{type(model).__name__}: the base model is not the one the adapter was trained on")
    conv1d = any(isinstance(modules[n], Conv1D) for n in targets)
    return LoraConfig(r=int(recipe["rank"]), lora_alpha=float(recipe["alpha"]), lora_dropout=0.0,
                      target_modules=targets, bias="none", fan_in_fan_out=conv1d,
                      base_model_name_or_path=base_model_name_or_path)


# --- The adapter alone, in peft's format (trainer.lora.sync=adapter): what the engines load by version -------------

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the file names peft's save_pretrained writes (and vLLM reads)
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix: what peft's and vLLM's adapter loaders expect


def adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors only (lora_A / lora_B of every adapted layer), named as peft saves them: peft's own
    `get_peft_model_state_dict` on `state` (the model's full state dict, e.g. gathered from FSDP shards; default:
    the model's own). Never a base weight: that is what keeps an adapter sync at megabytes."""
    from peft import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(model, state_dict=state if state is not None else model.state_dict(),
                                        adapter_name=ADAPTER)
    stray = [n for n in tensors if ".lora_" not in n]
    if stray:
        raise RuntimeError(f"the adapter state holds non-adapter tensors {stray[:3]}: an adapter sync must never send "
                           f"base weights")
    return {f"{PEFT_PREFIX}{name}": tensor for name, tensor in tensors.items()}


def save_adapter(model: torch.nn.Module, folder, tensors: dict[str, torch.Tensor]) -> int:
    """Write `tensors` (adapter_state) and the model's LoraConfig as a peft adapter folder (adapter_config.json +
    adapter_model.safetensors: loadable by vLLM's LoRARequest and peft's load_adapter); returns the weights file's
    size in bytes. The weights file is written under a temporary name and renamed, so a reader never sees half."""
    import os
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.peft_config[ADAPTER].save_pretrained(str(folder))
    tmp = folder / f"{ADAPTER_WEIGHTS}.{os.getpid()}.tmp"
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / ADAPTER_WEIGHTS)
    return (folder / ADAPTER_WEIGHTS).stat().st_size
