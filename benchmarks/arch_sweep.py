"""Packing exactness on every causal-LM architecture transformers can build offline: the unlisted-architecture sweep.

For each model type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES a tiny random model (2+ layers, hidden 64,
windows / chunks of 6 tokens so a 20-token sample crosses them, each distinct layer kind kept) is built from its
config class, then for packing in {rows, tree} x attention in {sdpa, eager} it goes through what the policy worker
does at start-up (attention_layout, refuse_inexact_attention, resolve_packing, the self-check) and, where the start-up
accepts it, the conformance batch of tests/arch_zoo.py is packed and compared with each sample forwarded alone:

    exact (max |packed - alone|)   accepted, and every logprob within 1e-5 (fp32)
    refused (reason)               the start-up refuses it, naming the model type
    MISMATCH (err)                 accepted, but a logprob is off: a bug in policy/packing/
    skipped (why)                  not a decoder-only LM we can build offline (encoder-decoder, multimodal, ...)

    python benchmarks/arch_sweep.py                 # every model type: progress on stderr, a markdown table on stdout
    python benchmarks/arch_sweep.py mistral gpt_neo # some
    python benchmarks/arch_sweep.py --proxy [types] # the fp32 proxy (policy/packing/proxy.py) vs the model itself

`--proxy`: each tiny model is built at twice its depth (per-layer fields repeated), its auto packing checked in fp32
on the model itself and on the proxy the worker builds under bf16 compute (the fewest leading layers that hold
every layer type, random weights); per type: agree (both pass or both fail), DISAGREE, or the proxy failing to build.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from arch_zoo import ARCHITECTURES, COMMON, WINDOW, conformance_batch, logprobs_alone  # noqa: E402

from skyrl_stepwise.policy.batching import forward_logprobs, pack_micro_batch, rank_micro_batches  # noqa: E402
from skyrl_stepwise.policy.packing import attention_layout, refuse_inexact_attention, resolve_packing  # noqa: E402
from skyrl_stepwise.policy.packing.selfcheck import check_packing, refusal  # noqa: E402

TOLERANCE = 1e-5
MAX_PARAMS = 5_000_000  # a config we failed to shrink (a size key we do not know) is skipped, not allocated
TIMEOUT_S = 120
ROW_TOKENS = 4096  # trainer.micro_batch_tokens' default: the worker reads the layout with it

# Generic shrinking: every one of these keys the config has gets this value.
SHRINK = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, n_routed_experts=4,
              num_local_experts=4, num_experts_per_tok=2, moe_topk=2, n_shared_experts=1, kv_lora_rank=16,
              q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
              first_k_dense_replace=1, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
              mamba_num_heads=8, mamba_head_dim=16, n_groups=1, ssm_state_size=16, state_size=16, time_step_rank=8,
              expand=2, mamba_expand=2, num_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
              linear_key_head_dim=16, linear_value_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=8,
              lru_width=64, attention_window_size=WINDOW, window_size=WINDOW, attention_chunk_size=WINDOW,
              sliding_window=WINDOW, keep_window_size=WINDOW, chunk_size=8, mamba_chunk_size=8,
              num_kv_shared_layers=0, hidden_size_per_layer_input=16, vocab_size_per_layer_input=96,
              laurel_rank=8, altup_num_inputs=2, n_positions=256, n_ctx=256, block_size=256, seq_length=256,
              rotary_dim=8, rotary_emb_base=10000, max_window_layers=1, d_model=64, d_ff=96, ffn_dim=96,
              num_layers=2, n_layer=2, n_head=4, n_embd=64, n_inner=96)
# Per family: what the generic shrinking cannot guess (hybrid layer patterns, fixed ratios).
EXTRA: dict[str, dict] = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_dt_rank=8, num_experts=4),
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=8, n_mamba_heads=2),
    "zamba2": dict(hybrid_layer_ids=[1], mamba_headdim=16, n_mamba_heads=8, num_mem_blocks=1),
    "bamba": dict(attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], num_attention_heads=4, num_key_value_heads=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "mamba": dict(time_step_rank=8), "falcon_mamba": dict(time_step_rank=8),
    "xlstm": dict(num_heads=4, qk_dim_factor=1.0, v_dim_factor=1.0, embedding_dim=64),
    "rwkv": dict(attention_hidden_size=64, intermediate_size=96, context_length=256),
    "reformer": dict(is_decoder=True, axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32],
                     attn_layers=["local", "lsh"], local_attn_chunk_length=WINDOW, lsh_attn_chunk_length=WINDOW),
    "nemotron_h": dict(hybrid_override_pattern="M*"),
    "zaya": dict(num_experts_per_tok=1),
    "blt": dict(vocab_size=260, encoder_hash_byte_group_vocab=101, encoder_hash_byte_group_size=[3, 4],
                patcher_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                    intermediate_size=48, head_dim=16, vocab_size=260),
                encoder_config=dict(hidden_size=32, hidden_size_global=64, num_attention_heads=2,
                                    num_key_value_heads=2, num_hidden_layers=1, intermediate_size=48, vocab_size=260),
                decoder_config=dict(hidden_size=32, hidden_size_global=64, num_attention_heads=2,
                                    num_key_value_heads=2, num_hidden_layers=1, intermediate_size=48, head_dim=16,
                                    vocab_size=260),
                global_config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                   intermediate_size=96, head_dim=16)),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2}),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=8, n_groups=1),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                                 for t in ("sliding_attention", "full_attention")}),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2, ple_embed_dim=16, heads_per_ngram=2, ngram_vocab_size_base=1000,
                           make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4),
}
# Options a family's default config leaves off that change what a token sees: swept as `model_type[variant]`.
VARIANTS: dict[str, tuple[str, dict]] = {
    "falcon[alibi]": ("falcon", dict(alibi=True)),
    "mpt[no_alibi]": ("mpt", dict(attn_config={"alibi": False})),
    "minimax_m3_vl_text[sparse]": ("minimax_m3_vl_text", dict(
        layer_types=["minimax_m3_sparse", "full_attention"], index_block_size=4, index_topk_blocks=2,
        index_local_blocks=1, index_n_heads=2, index_head_dim=16)),
    "qwen4_exp_text[full]": ("qwen4_exp_text", dict(layer_types=["full_attention", "full_attention"])),
    "gemma3n_text[kv_shared]": ("gemma3n_text", dict(num_hidden_layers=4, num_kv_shared_layers=2,
                                                     layer_types=["sliding_attention", "full_attention"] * 2)),
    "phi3[longrope]": ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=16,
                                    rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16, partial_rotary_factor=1.0,
        short_factor=[1.0] * 8, long_factor=[4.0] * 8))),
    "llama[dynamic]": ("llama", dict(max_position_embeddings=16, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=4.0))),
    "llama4_text[no_chunk]": ("llama4_text", dict(layer_types=["full_attention", "full_attention"],
                                                  attention_chunk_size=None)),
}
ENCODER_FAMILY = "a bidirectional encoder made causal with is_decoder (BERT-style), not a decoder-only LM"


def _per_layer(values: list, picks: list[int]) -> list:
    return [values[i] for i in picks]


def tiny_config(model_type: str, options: dict | None = None):
    """A tiny config of this model type (or `model_type[variant]`), or a string saying why it is skipped."""
    from transformers import AutoConfig

    if model_type in VARIANTS:
        return tiny_config(*VARIANTS[model_type])

    default = AutoConfig.for_model(model_type)
    if getattr(default, "is_encoder_decoder", False):
        return "encoder-decoder"
    if model_type == "xlnet":
        return "permutation LM with bidirectional attention (attn_type=bi), not decoder-only"
    if hasattr(default, "is_decoder") and not getattr(default, "is_decoder") and model_type != "reformer" \
            and "gpt_neox" not in model_type:
        return ENCODER_FAMILY
    if default.get_text_config() is not default:
        return "multimodal config (vision/audio sub-configs)"
    kwargs = {k: v for k, v in {**COMMON, **SHRINK}.items()
              if k in COMMON or hasattr(default, k) or k in default.attribute_map}
    kwargs = {k: v for k, v in kwargs.items() if not (k in SHRINK and getattr(default, k, 0) is None
                                                       and "window" not in k and "chunk" not in k)}
    if "kv_lora_rank" in kwargs:  # MLA: the rotary embedding's size is the rope part of a head
        kwargs.update(head_dim=kwargs["qk_rope_head_dim"], num_key_value_heads=kwargs["num_attention_heads"])
    kwargs.update(ARCHITECTURES.get(model_type, {}))
    kwargs.update(EXTRA.get(model_type, {}))
    kwargs.update(options or {})
    n_default = getattr(default, "num_hidden_layers", None)
    types = getattr(default, "layer_types", None)
    if getattr(default, "use_sliding_window", None) is not None:  # qwen2 style: layer types from max_window_layers
        types = None
    if "layer_types" not in kwargs and isinstance(types, list) and types:
        picks = list(dict.fromkeys(types.index(t) for t in types))
        picks = (picks + [0, 0])[:max(2, len(picks))]
        kwargs["layer_types"], kwargs["num_hidden_layers"] = _per_layer(types, picks), len(picks)
    else:
        picks = list(range(kwargs.get("num_hidden_layers", 2)))
    for key, value in default.to_dict().items():  # other per-layer lists follow the same layers
        if (key not in kwargs and isinstance(value, list) and n_default and len(value) == n_default
                and key != "layer_types"):
            kwargs[key] = _per_layer(value, picks)
    if getattr(default, "use_sliding_window", None) is False:
        kwargs["use_sliding_window"] = True
    read_only = {k for k in kwargs if isinstance(getattr(type(default), default.attribute_map.get(k, k), None),
                                                 property)}
    kwargs = {k: v for k, v in kwargs.items() if k not in read_only}  # derived by the config itself
    return AutoConfig.for_model(model_type, **kwargs)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"over {TIMEOUT_S} s")


def _packed(model, batch, packing, layout):
    by_sample = {}
    for idx in rank_micro_batches(batch, 0, 1, 10_000, packing, layout.one_sample_per_row):
        mb = pack_micro_batch(batch, idx, packing)
        by_sample.update(zip(idx, forward_logprobs(model, mb, layout=layout)[0].split(mb.response_lens)))
    return torch.cat([by_sample[i] for i in range(len(batch))])


def _short(e: BaseException, n: int = 110) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:n].replace("|", "/")


@torch.no_grad()
def run_cell(model, packing: str) -> tuple[str, str]:
    """(status, detail) of one model x packing, as the worker's start-up and then the conformance batch see it."""
    layout = attention_layout(model, row_tokens=ROW_TOKENS)
    try:
        refuse_inexact_attention(layout)
        resolve_packing(packing, layout)
    except ValueError as e:
        return "refused", _short(e, 160)
    batch = conformance_batch()
    alone = logprobs_alone(model, batch)
    try:
        got = _packed(model, batch, packing, layout)
        err = (got - alone).abs().max().item()
    except Exception as e:  # noqa: BLE001 - the self-check would refuse a row the model cannot run
        err, failure = float("nan"), e
    else:
        failure = None
    try:
        check = check_packing(model, layout, packing, torch.device("cpu"))
        refused = None if check.passed else refusal(check, layout)
    except Exception as e:  # noqa: BLE001 - the worker refuses a model that cannot run the packed probe
        refused = f"self-check failed to run: {_short(e)}"
    per_row = " (1 sample/row)" if layout.one_sample_per_row else ""
    if refused:
        return "refused", f"self-check: {refused[:120]}; conformance err {err:.1e}"
    if failure is not None:
        return "MISMATCH", f"accepted, then failed: {_short(failure)}"
    if not err <= TOLERANCE:
        return "MISMATCH", f"{err:.1e}{per_row}; self-check passed ({check.max_abs_error:.1e})"
    return "exact", f"{err:.1e}{per_row}"


def sweep_model(model_type: str) -> dict[tuple[str, str], tuple[str, str]]:
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(model_type)
    except Exception as e:  # noqa: BLE001
        return {("*", "*"): ("skipped", f"config: {_short(e)}")}
    if isinstance(config, str):
        return {("*", "*"): ("skipped", config)}
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as e:  # noqa: BLE001
        return {("*", "*"): ("skipped", f"cannot build: {_short(e)}")}
    if n > MAX_PARAMS:
        return {("*", "*"): ("skipped", f"could not shrink ({n / 1e6:.0f}M parameters)")}
    cells = {}
    for attn in ("sdpa", "eager"):
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
        except Exception as e:  # noqa: BLE001
            why = (f"transformers has no {attn} path" if "does not support an attention implementation" in str(e)
                   else f"no {attn}: {_short(e, 80)}")
            for packing in ("rows", "tree"):
                cells[(packing, attn)] = ("skipped", why)
            continue
        for packing in ("rows", "tree"):
            try:
                cells[(packing, attn)] = run_cell(model, packing)
            except Exception as e:  # noqa: BLE001
                cells[(packing, attn)] = ("skipped", f"alone forward fails: {_short(e)}")
    return cells


def proxy_verdict(model_type: str) -> str:
    """One type at twice its tiny depth: does the fp32 proxy's self-check agree with the model's own fp32 check?"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from skyrl_stepwise.policy.packing.proxy import build_fp32_proxy

    config = tiny_config(model_type)
    if isinstance(config, str):
        return f"skipped ({config})"
    n = config.get_text_config().num_hidden_layers
    deep = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    for key, value in list(deep.items()):
        if "token_id" not in key and key != "architectures" and isinstance(value, (list, str)) and len(value) == n \
                and (isinstance(value, list) or key.endswith("pattern")):
            deep[key] = value * 2
    deep["num_hidden_layers"] = 2 * n
    model = None
    for attn in ("sdpa", "eager"):
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.model_type, **deep),
                                                     attn_implementation=attn, dtype=torch.float32).eval()
            break
        except Exception as e:  # noqa: BLE001
            why = _short(e)
    if model is None:
        return f"skipped (cannot build at twice the depth: {why})"
    layout = attention_layout(model, row_tokens=ROW_TOKENS)
    try:
        refuse_inexact_attention(layout)
        packing = resolve_packing("auto", layout)
        own = check_packing(model, layout, packing, torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 - refused at start-up before any proxy is built
        return f"refused ({_short(e, 80)})"
    try:
        proxy = build_fp32_proxy(model, torch.device("cpu"))
        mirrored = check_packing(proxy, layout, packing, torch.device("cpu"))
    except Exception as e:  # noqa: BLE001
        return f"PROXY FAILED ({_short(e)})"
    layers = f"{proxy.config.get_text_config().num_hidden_layers}/{2 * n} layers"
    verdict = "agree" if own.passed == mirrored.passed else "DISAGREE"
    return f"{verdict} ({packing}: model {own.max_abs_error:.1e}, proxy {mirrored.max_abs_error:.1e}, {layers})"


def main_proxy(types: list[str]) -> None:
    counts: dict[str, int] = {}
    print("| model_type | proxy vs model (fp32, auto packing) |\n|---|---|")
    for i, mt in enumerate(types):
        signal.alarm(TIMEOUT_S)
        try:
            verdict = proxy_verdict(mt)
        except Exception as e:  # noqa: BLE001
            verdict = f"skipped ({_short(e)})"
        finally:
            signal.alarm(0)
        counts[verdict.split()[0]] = counts.get(verdict.split()[0], 0) + 1
        print(f"[{i + 1}/{len(types)}] {mt}: {verdict}", file=sys.stderr, flush=True)
        print(f"| {mt} | {verdict} |")
    print(f"\n{len(types)} model types: {counts}", file=sys.stderr)


def main(argv: list[str]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    proxy = "--proxy" in argv
    argv = [a for a in argv if a != "--proxy"]
    types = argv or [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *VARIANTS]
    if proxy:
        return main_proxy(types)
    rows, counts = [], {}
    start = time.time()
    for i, mt in enumerate(types):
        t0 = time.time()
        signal.alarm(TIMEOUT_S)
        try:
            cells = sweep_model(mt)
        except _Timeout as e:
            cells = {("*", "*"): ("skipped", f"timed out: {e}")}
        except Exception as e:  # noqa: BLE001
            cells = {("*", "*"): ("skipped", f"crashed: {_short(e)}")}
            traceback.print_exc()
        finally:
            signal.alarm(0)
        for status, _ in cells.values():
            counts[status] = counts.get(status, 0) + 1
        line = "; ".join(f"{p}/{a}: {s} {d}" for (p, a), (s, d) in cells.items())
        print(f"[{i + 1}/{len(types)}] {mt} ({time.time() - t0:.1f}s): {line}", file=sys.stderr, flush=True)
        rows.append((mt, cells))
    print("| model_type | rows / sdpa | tree / sdpa | rows / eager | tree / eager |")
    print("|---|---|---|---|---|")
    for mt, cells in rows:
        if ("*", "*") in cells:
            s, d = cells[("*", "*")]
            print(f"| {mt} | {s} ({d}) | | | |")
            continue
        out = []
        for a in ("sdpa", "eager"):
            for p in ("rows", "tree"):
                s, d = cells[(p, a)]
                out.append(f"**{s}** ({d})" if s == "MISMATCH" else f"{s} ({d})")
        print(f"| {mt} | {out[0]} | {out[1]} | {out[2]} | {out[3]} |")
    print(f"\n{len(types)} model types, cells: {counts}, {time.time() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
