"""Tiny random models of the real architectures we train, built offline from transformers' config classes.

Each keeps what changes how a token sees its context: sliding windows and `layer_types`, attention sinks (gpt-oss),
recurrent / linear-attention / short-conv layers (Qwen3.5/Next, Granite 4, Nemotron-H, LFM2, Mamba, RecurrentGemma),
chunked attention (Llama 4), longrope (Phi-3.5), MoE routing, soft-capping
(Gemma 2), MLA (DeepSeek V3), tied embeddings where the family ties them. Sizes are the only thing shrunk; windows are
6 tokens so that a 20-token sample crosses them.
"""

from __future__ import annotations

import torch

from skyrl_stepwise.policy.batching import TrainBatch

WINDOW = 6
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=96, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2)
MIXED = ["sliding_attention", "full_attention"]
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)

# model_type -> what differs from COMMON (the family's own attention pattern, experts, recurrent layers)
ARCHITECTURES: dict[str, dict] = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "smollm3": {}, "seed_oss": {}, "glm4": {}, "granite": {},
    "ministral3": {}, "mistral": {"sliding_window": WINDOW}, "phi3": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW, "layer_types": MIXED},
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": MIXED},
    "gemma4_text": {"sliding_window": WINDOW, "layer_types": MIXED, "vocab_size_per_layer_input": 96,
                    "hidden_size_per_layer_input": 16},
    "cohere2": {"sliding_window": WINDOW, "layer_types": MIXED},
    "olmo3": {"sliding_window": WINDOW, "layer_types": MIXED},
    "exaone4": {"sliding_window": WINDOW, "layer_types": MIXED},
    "gpt_oss": {"sliding_window": WINDOW, "layer_types": MIXED, "num_local_experts": 4, **MOE},
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32, **MOE},
    "glm4_moe": {"n_routed_experts": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1, **MOE},
    "deepseek_v3": {"n_routed_experts": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "head_dim": 8,
                    "num_key_value_heads": 4,
                    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "n_group": 1, "topk_group": 1, **MOE},
    "minimax_m2": {"num_local_experts": 4, **MOE},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "num_local_experts": 4, "mamba_n_heads": 8,
                         "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_chunk_size": 8, **MOE},
    "nemotron_h": {"hybrid_override_pattern": "M*", "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1,
                   "ssm_state_size": 16, "chunk_size": 8},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
                   "moe_intermediate_size": 32, **LINEAR, **MOE},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], **LINEAR},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
                         "moe_intermediate_size": 32, **LINEAR, **MOE},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    # found by benchmarks/arch_sweep.py: what the families above do not exercise
    # qwen2-style windows: layer types derived from use_sliding_window / max_window_layers
    "qwen2[swa]": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "phi3[longrope]": {"sliding_window": WINDOW, "original_max_position_embeddings": 48, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 48,
        "partial_rotary_factor": 1.0, "short_factor": [1.0] * 8, "long_factor": [16.0] * 8}},  # Phi-3.5 / Phi-4-mini
    "llama4_text": {"attention_chunk_size": WINDOW, "layer_types": ["chunked_attention", "full_attention"],
                    "no_rope_layers": [1, 0], "num_local_experts": 4, "intermediate_size_mlp": 96, "moe_layers": [0],
                    **MOE},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": WINDOW, "lru_width": 64},
    "mamba": {"time_step_rank": 8, "state_size": 16},  # no layer_types: only the class's _is_stateful says it
    # the architectures of the template families added from the llama.cpp rehearsal
    "cohere2_moe": {"sliding_window": WINDOW, "layer_types": MIXED, "num_experts": 4, "moe_intermediate_size": 32,
                    **MOE},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_experts": 4, "moe_intermediate_size": 32,
                 "num_dense_layers": 1, **MOE},
    "minimax": {"layer_types": ["linear_attention", "full_attention"], "num_local_experts": 4, **MOE},  # lightning
    # issue 59's held-out templates: Falcon-H1 runs Mamba-2 heads beside attention in every layer
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_d_state": 16, "mamba_n_heads": 8, "mamba_d_head": 16,
                  "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16},
}

# Each chat-template family in tests/templates -> the architecture its models ship with.
TEMPLATE_ARCHITECTURE = {
    "command-r7b": "cohere2", "deepseek-r1-distill-qwen": "qwen2", "deepseek-v3.1": "deepseek_v3",
    "gemma-2": "gemma2", "gemma-4": "gemma4_text", "glm-4.6": "glm4_moe", "gpt-oss": "gpt_oss",
    "granite-3.3": "granite", "granite-4.0": "granitemoehybrid", "hermes-3-tool-use": "llama",
    "llama-3.1-instruct": "llama", "llama-3.2": "llama", "minimax-m2": "minimax_m2", "mistral-nemo": "mistral",
    "mistral-small-3.2": "mistral", "nemotron-3-nano": "nemotron_h", "phi-3.5": "phi3",
    "qwen2.5-instruct": "qwen2", "qwen3-coder": "qwen3_moe", "qwen3.5": "qwen3_5_moe_text", "qwen3": "qwen3",
    "seed-oss": "seed_oss", "smollm2": "llama",
    "firefunction-v2": "llama", "functionary-v3.1": "llama", "kimi-k2": "deepseek_v3", "lfm2": "lfm2",
    "nemotron-nano-v2": "nemotron_h", "qwq-32b": "qwen2", "smollm3": "smollm3",
    "apriel-1.6": "mistral", "cohere2moe": "cohere2_moe", "gigachat3.1": "deepseek_v3", "lfm2.5-8b": "lfm2_moe",
    "minimax-m1": "minimax", "falcon-h1": "falcon_h1", "llama-4": "llama4_text", "xlam-2-llama": "llama",
}

# Attention implementations the trainer would pick on CPU (flex_attention is the GPU path; gpt-oss has no sdpa, and
# the trainer refuses sdpa for Gemma 2: it ignores the attention soft-capping).
EAGER_ONLY = {"gpt_oss", "gemma2", "mamba"}


def attention_implementations(model_type: str) -> list[str]:
    """sdpa and eager, or eager alone where transformers has no sdpa path for the family."""
    return ["eager"] if model_type in EAGER_ONLY else ["sdpa", "eager"]


def tiny_model(model_type: str, attn_implementation: str = "sdpa", seed: int = 0,
               dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A 2-layer random model of this architecture (no download), in eval mode. `family[variant]` keys build the
    family's model_type with the variant's options; `overrides` replace config keys."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # tiny configs trip harmless warnings (rope factors, kernels not installed)
    config = AutoConfig.for_model(model_type.split("[")[0], **{**COMMON, **ARCHITECTURES[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def conformance_batch(seed: int = 0) -> TrainBatch:
    """Two prompt groups: a GRPO group sharing a prompt, a step-wise chain re-reading its history, a broken chain
    (the history cut short, as a stripped think block leaves it), and a second prompt; every sample > the window."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, 90, (n,), generator=g).tolist()

    prompt, other = ids(11), ids(9)
    first, obs = ids(7), ids(4)
    prompts = [prompt, prompt, prompt + first + obs, prompt[:8] + ids(3), other, other]
    responses = [first, ids(9), ids(6), ids(5), ids(8), ids(10)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      instance_ids=["q1"] * 4 + ["q2"] * 2)


def logprobs_alone(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Each sample forwarded on its own, the model building its own masks: what the engine computed, and what every
    packed forward must reproduce."""
    out = []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        logits = model(input_ids=torch.tensor([p + r]), use_cache=False).logits[0, len(p) - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    return torch.cat(out)
