"""An fp32 stand-in for the run's model, so the packing self-check stays precise when training computes in bf16.

Under bf16 compute (FSDP mixed precision, the default wherever bf16 exists, CPU included) a packed row and a
sample alone round differently, so the check on the run's own model can only use a coarse bar (selfcheck.py:
HALF_TOLERANCE, 1 nat). A leak between samples of a small or freshly initialised model stays under that bar (a tiny
random Llama whose samples see each other: 0.09-0.9 nats). Whether a packing is exact is a property of the
architecture's forward (masks, positions, state), not of its weights, so the same class built from the same config
with only as many layers as it takes to hold every layer type, random weights, in fp32, answers it to 1e-3.
"""

from __future__ import annotations

import copy

import torch


# The largest model (parameters) built at full depth when no cut-down config builds (Gemma 3n's KV-shared layers,
# Zamba's shared blocks): random fp32 weights on the device, for the check only.
MAX_FULL_DEPTH_PARAMS = 4e9


def fewest_layers(config) -> int | None:
    """How many leading layers hold every layer type (at least 2); None when the config has no layer count."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int):
        return None
    types = list(getattr(text, "layer_types", None) or [])
    if len(types) != n:
        return min(2, n)
    needed = set(types)
    return max(next(k for k in range(1, n + 1) if set(types[:k]) == needed), min(2, n))


def proxy_config(config, keep: int | None = None):
    """`config` cut to its first `keep` layers (default: `fewest_layers`).

    Per-layer fields (lists or pattern strings as long as the layer count: layer_types, no_rope_layers,
    hybrid_override_pattern, ...) are cut to the same length, so the proxy's layers are the model's first layers.
    """
    proxy = copy.deepcopy(config)
    text = proxy.get_text_config() if hasattr(proxy, "get_text_config") else proxy
    n = getattr(text, "num_hidden_layers", None)
    keep = fewest_layers(config) if keep is None else keep
    if not isinstance(n, int) or keep is None or keep >= n:
        return proxy
    for name, value in list(vars(text).items()):
        if _per_layer(name, value, n):
            setattr(text, name, value[:keep])
    text.num_hidden_layers = keep
    return proxy


def _per_layer(name: str, value, num_layers: int) -> bool:
    """A field with one entry per layer: a list as long as the layer count, or a `*_pattern` string (Nemotron-H's
    hybrid_override_pattern); never token ids or names that merely have that length."""
    if "token_id" in name or name in ("architectures", "model_type"):
        return False
    if isinstance(value, str):
        return name.endswith("pattern") and len(value) == num_layers
    return isinstance(value, (list, tuple)) and len(value) == num_layers


def build_fp32_proxy(model: torch.nn.Module, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The run's model class from `proxy_config`, randomly initialised in fp32 on `device`, same attention.

    A config that does not build cut down (layers that share another layer's KV or weights by index) is tried
    with twice the layers, up to full depth for models of at most MAX_FULL_DEPTH_PARAMS; the last error is raised.
    Built inside a forked RNG, so the trainer's own random stream is the same with or without the check.
    """
    from transformers import AutoModelForCausalLM

    text = model.config.get_text_config()
    n, keep = getattr(text, "num_hidden_layers", None), fewest_layers(model.config)
    attn = model.config._attn_implementation
    while True:
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                with torch.device(device):
                    proxy = AutoModelForCausalLM.from_config(proxy_config(model.config, keep), dtype=torch.float32,
                                                             attn_implementation=attn)
            break
        except Exception:
            if keep is None or n is None or keep >= n:
                raise
            keep = min(2 * keep, n)
            if keep == n and sum(p.numel() for p in model.parameters()) > MAX_FULL_DEPTH_PARAMS:
                raise
    proxy.config.use_cache = False
    return proxy.eval().requires_grad_(False)
