"""RoPE variants whose frequencies depend on how long the forward is, not on each token's position alone.

Packing relies on a token's output depending only on its own sample. Two of transformers' RoPE types break that
through the *length* of the forward, whatever the masks (modeling_rope_utils.dynamic_rope_update):

- **longrope** (Phi-3.5-mini, Phi-4-mini, ...): every forward picks the short or the long factors from its largest
  position id: `max(position_ids) + 1 > original_max_position_embeddings` switches the whole forward to the long
  ones. A short sample packed with one past the switch is scored with the long factors, but was sampled (and scores
  alone) with the short ones. Exact when no row can pass the switch length with more than one sample in it: rows of
  at most `original_max_position_embeddings` tokens (a longer sample always gets a row of its own), or one sample
  per row. The choice is made afresh at each forward, so one-sample rows are exact.
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
