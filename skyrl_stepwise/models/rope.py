"""RoPE variants whose frequencies depend on how long the forward is, not on each token's position alone.

Packing relies on a token's output depending only on its own sample. Two of transformers' RoPE types break that
through the *length* of the forward, whatever the masks (modeling_rope_utils.dynamic_rope_update):

- **longrope** (Phi-3.5-mini, Phi-4-mini, ...): every forward picks the short or the long factors from its largest
  position id: `max(position_ids) + 1 > original_max_position_embeddings` switches the whole forward to the long
  ones. A short sample packed with one past the switch is scored with the long factors, but was sampled (and scores
  alone) with the short ones. Exact when no row can pass the switch length with more than one sample in it: rows of
  at most `original_max_position_embeddings` tokens (a longer sample always gets a row of its own), or one sample
  per row. The choice is made afresh at each forward, so one-sample rows are exact.
  The engines decide once instead (vLLM: long factors for every token when engine.max_model_len exceeds
  original_max_position_embeddings), so the trainer pins the factors the engines use (`pin_longrope`, with
  trainer.engine_max_model_len); the layout keeps the packing bound above all the same (cautious, never wrong).
- **dynamic** (dynamic NTK): recomputes the frequencies from the forward's largest position and *keeps* them for
  later forwards until one is shorter than the original length: a sample's scores depend on its row-mates and on
  earlier micro-batches. No packing is exact (not even one sample per row), so the run is refused.

Every other RoPE type (default, linear, yarn, llama3, ...) is a fixed function of the position id: depths in a
trie and per-sample positions in a row reproduce it exactly.
"""

from __future__ import annotations


def _rope_parameter_sets(config) -> list[dict]:
    """The config's RoPE parameter dicts: one, or one per layer type (Gemma 3 style {layer_type: {...}})."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    nested = [v for v in params.values() if isinstance(v, dict)]
    return nested if nested and all(isinstance(v, dict) for v in params.values()) else [params]


def length_dependent_rope(config) -> tuple[str | None, int | None]:
    """("dynamic" | "longrope" | None, the switch length): the RoPE kind whose frequencies follow the forward's
    length, and the position count past which they change (None if not known)."""
    kind, switch = None, None
    for params in _rope_parameter_sets(config):
        rope_type = str(params.get("rope_type") or params.get("type") or "default")
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
        if "dynamic" in rope_type:
            return "dynamic", original
        if rope_type == "longrope":
            kind, switch = "longrope", min(filter(None, (switch, original)), default=None)
    return kind, switch


def declared_switch_length(config) -> int | None:
    """The pre-training length a config declares for its RoPE scaling (`original_max_position_embeddings`), if any:
    where a length-dependent RoPE we do not know by name would switch, so the self-check's probe row crosses it."""
    lengths = [p.get("original_max_position_embeddings") for p in _rope_parameter_sets(config)]
    lengths.append(getattr(config, "original_max_position_embeddings", None))
    return min((int(n) for n in lengths if n), default=None)


PINNED_LONGROPE = "longrope_pinned"  # a rotary module's rope_type once pinned: transformers no longer switches it


def engine_uses_long_factors(config, engine_max_model_len: int) -> bool | None:
    """Whether vLLM scores every token of a longrope model with the long factors at this context (None: no longrope).

    vLLM decides once, when the engine starts: `use_long_rope = max_model_len > original_max_position_embeddings`,
    and then every position indexes the long cos/sin cache (vllm/model_executor/layers/rotary_embedding/
    phi3_long_rope_scaled_rope.py, Phi3LongRoPEScaledRotaryEmbedding), so no KV cache mixes the two. transformers
    decides per forward from its largest position id (modeling_rope_utils.longrope_frequency_update)."""
    kind, switch = length_dependent_rope(config)
    if kind != "longrope" or switch is None:
        return None
    return engine_max_model_len > switch


def pin_longrope(model, engine_max_model_len: int, key: str = "trainer.engine_max_model_len") -> str | None:
    """Fix a longrope model's RoPE to the factors the engines use at `engine_max_model_len` (long for every token
    past original_max_position_embeddings, else short) in every forward; returns a line for the start-up log, or
    None for a model without longrope.

    Without the pin, with engine.max_model_len past the switch, a sample shorter than the switch is sampled with the
    long factors and trained with the short ones: every ratio and TIS weight of it is off. A pinned RoPE is a fixed
    function of the position again (what packing relies on); the layout stays as cautious as for longrope."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    use_long = engine_uses_long_factors(config, engine_max_model_len)
    if use_long is None:
        return None
    switch = length_dependent_rope(config)[1]
    pinned, unpinnable = 0, []
    for name, module in model.named_modules():
        rope_type = getattr(module, "rope_type", None)
        if not (isinstance(rope_type, str) and rope_type == "longrope" and hasattr(module, "inv_freq")):
            if isinstance(rope_type, dict) and "longrope" in rope_type.values():
                unpinnable.append(name)
            continue
        inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, module.inv_freq.device,
                                                      seq_len=switch + 1 if use_long else None)
        module.register_buffer("inv_freq", inv_freq, persistent=False)
        module.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        module.rope_type = PINNED_LONGROPE  # dynamic_rope_update only acts on "longrope" / "dynamic"
        pinned += 1
    if unpinnable or not pinned:
        raise ValueError(f"{key}={engine_max_model_len}: {config.model_type} has longrope RoPE, which the engines "
                         f"apply with their {'long' if use_long else 'short'} factors to every token, but its rotary "
                         f"modules ({', '.join(unpinnable) or 'none found'}) cannot be fixed to them here. Set "
                         f"engine.max_model_len <= {switch} (the engines then use the short factors, as the trainer "
                         f"does below that length) or report the architecture")
    factors = "long" if use_long else "short"
    why = (f"engine.max_model_len={engine_max_model_len} > original_max_position_embeddings={switch}: vLLM applies "
           f"the long factors to every token" if use_long else
           f"engine.max_model_len={engine_max_model_len} <= original_max_position_embeddings={switch}: vLLM applies "
           f"the short factors to every token")
    return f"longrope: the trainer scores every token with the {factors} RoPE factors ({why})"
