"""Trainer-side exactness per architecture: every packed sample scores as it would alone, or is refused at start-up.

For each architecture in tests/arch_zoo.py (every family in tests/templates and the others we support), a tiny random
model is packed with GRPO groups sharing a prompt, a step-wise chain, a broken chain, an unrelated prompt, all longer
than the sliding window, under packing=rows and packing=tree with each attention implementation the trainer would
pick. Per-token logprobs must equal each sample forwarded alone within 1e-5 (fp32), and gradients must equal one
sample per row within 1e-4 relative; where a combination cannot be exact (tree on state-carrying layers) it is
refused, naming the model type and the key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_zoo import (ARCHITECTURES, TEMPLATE_ARCHITECTURE, attention_implementations, conformance_batch,
                      logprobs_alone, tiny_model)

from skyrl_stepwise.policy.batching import TrainBatch, forward_logprobs, pack_micro_batch, rank_micro_batches
from skyrl_stepwise.policy.packing import attention_layout, resolve_packing
from skyrl_stepwise.policy.packing.selfcheck import check_packing, refusal

# one sample per row: state along the row, a layer kind we cannot mask (chunked), or longrope with rows of unknown size
STATE_CARRYING = {"granitemoehybrid", "nemotron_h", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lfm2",
                  "phi3[longrope]", "llama4_text", "recurrent_gemma", "mamba", "lfm2_moe", "minimax", "falcon_h1"}
WINDOWED = {"mistral", "phi3", "gemma2", "gemma3_text", "gemma4_text", "cohere2", "olmo3", "exaone4", "gpt_oss",
            "qwen2[swa]", "phi3[longrope]", "recurrent_gemma", "cohere2_moe"}


def _packed(model, batch, micro_batches, packing, layout):
    """Per-sample logprobs in sample order from these micro-batches."""
    by_sample = {}
    for idx in micro_batches:
        mb = pack_micro_batch(batch, idx, packing)
        by_sample.update(zip(idx, forward_logprobs(model, mb, layout=layout)[0].split(mb.response_lens)))
    return torch.cat([by_sample[i] for i in range(len(batch))])


def _grads(model, batch, micro_batches, packing, layout, weights):
    model.zero_grad(set_to_none=True)
    (_packed(model, batch, micro_batches, packing, layout) * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_every_template_family_has_an_architecture_in_the_suite():
    templates = {p.stem for p in (Path(__file__).parent / "templates").glob("*.jinja")}
    assert templates <= set(TEMPLATE_ARCHITECTURE), templates - set(TEMPLATE_ARCHITECTURE)
    assert set(TEMPLATE_ARCHITECTURE.values()) <= set(ARCHITECTURES)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_packed_samples_score_exactly_as_alone_or_are_refused(model_type):
    batch = conformance_batch()
    weights = torch.linspace(-1.0, 1.0, sum(len(r) for r in batch.response_ids))
    for attn in attention_implementations(model_type):
        model = tiny_model(model_type, attn)
        layout = attention_layout(model)
        assert layout.one_sample_per_row == (model_type in STATE_CARRYING), layout.describe()
        assert (layout.max_window is not None) == (model_type in WINDOWED), layout.describe()
        with torch.no_grad():
            alone = logprobs_alone(model, batch)
        singles = rank_micro_batches(batch, 0, 1, 10_000, "rows", one_sample_per_row=True)
        reference_grads = _grads(model, batch, singles, "rows", layout, weights)
        for packing in ("rows", "tree"):
            if packing == "tree" and layout.one_sample_per_row:
                family = model_type.split("[")[0]  # a `family[variant]` zoo entry
                with pytest.raises(ValueError, match=rf"trainer.packing=tree is not exact on {family}"):
                    resolve_packing("tree", layout)
                assert resolve_packing("auto", layout) == "rows"
                continue
            assert resolve_packing(packing, layout) == packing
            mbs = rank_micro_batches(batch, 0, 1, 10_000, packing, layout.one_sample_per_row)
            if not layout.one_sample_per_row:  # really packed: all six samples in one row
                assert mbs == [list(range(len(batch)))]
            with torch.no_grad():
                got = _packed(model, batch, mbs, packing, layout)
            err = (got - alone).abs().max().item()
            assert err < 1e-5, f"{model_type} {attn} {packing}: max |packed - alone| = {err:.2e}"
            grads = _grads(model, batch, mbs, packing, layout, weights)
            assert grads.keys() == reference_grads.keys()
            for name, g in grads.items():
                ref = reference_grads[name]
                rel = (g - ref).norm() / ref.norm().clamp_min(1e-12)
                assert rel < 1e-4, f"{model_type} {attn} {packing}: gradient of {name} off by {rel:.2e} relative"


def test_explicit_tree_on_a_recurrent_model_is_refused_at_worker_start(tmp_path):
    """A user asking for packing=tree on Qwen3.5 (gated delta net) is stopped before the first step, with the model
    type and the key in the message; auto picks rows with one sample per row and passes the self-check."""
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    tiny_model("qwen3_5_text").save_pretrained(tmp_path / "m")
    cfg = TrainerConfig(model_path=str(tmp_path / "m"), packing="tree", ckpt_dir=str(tmp_path / "c"))
    cfg.fsdp.mixed_precision = False
    with pytest.raises(ValueError, match=r"trainer.packing=tree is not exact on qwen3_5_text.*linear_attention"):
        PolicyWorker(cfg, trainable=False)
    cfg.packing = "auto"
    worker = PolicyWorker(cfg, trainable=False)
    summary = worker.packing_summary()
    assert summary["packing"] == "rows" and worker.layout.one_sample_per_row
    assert summary["max_abs_error"] < 1e-5


def _gpt_neo_config(tmp_path):
    """A saved tiny GPT-Neo (a local band by row index: rows exact, tree not) and a worker config with auto packing."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from skyrl_stepwise.policy.config import TrainerConfig

    torch.manual_seed(0)
    GPTNeoForCausalLM(GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96, vocab_size=96,
                                   attention_types=[[["global", "local"], 1]], window_size=6,
                                   max_position_embeddings=256)).save_pretrained(tmp_path / "m")
    cfg = TrainerConfig(model_path=str(tmp_path / "m"), packing="auto", attn_implementation="eager",
                        ckpt_dir=str(tmp_path / "c"))
    return cfg


def test_auto_falls_back_to_rows_when_the_tree_fails_the_models_self_check(tmp_path):
    """GPT-Neo's local band follows the row index: as rows (contiguous samples) it is exact, in a tree (positions by
    depth) it is not, and nothing in the config says so. auto means "tree wherever exact": the self-check decides,
    auto trains rows and says why; an explicit tree is refused."""
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = _gpt_neo_config(tmp_path)
    cfg.fsdp.mixed_precision = False
    worker = PolicyWorker(cfg, trainable=False)
    summary = worker.packing_summary()
    assert summary["packing"] == "rows" and summary["max_abs_error"] < 1e-5, summary
    assert "auto fell back to rows: the tree failed its check" in summary["check"]
    assert worker.packing_check.fallback_from.max_abs_error > 1e-2
    assert worker.set_packing("auto") == "rows" and worker.cfg.packing == "rows"  # the ablation's switch agrees
    cfg.packing = "tree"
    with pytest.raises(ValueError, match=r"trainer.packing=tree is not exact on this model: gpt_neo"):
        PolicyWorker(cfg, trainable=False)


def test_set_packing_runs_the_self_check_before_a_packing_first_trains(tmp_path):
    """The ablation and the benchmarks switch packings on a running worker (set_packing). The switch must pass the
    same self-check as start-up: on GPT-Neo (the tree scores 0.13 nats off, only the check can tell) a worker started
    with rows neither trains the tree it is asked for nor resolves a later auto to an unchecked tree; a refused
    switch names the model type and why, and leaves the worker on its packing."""
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = _gpt_neo_config(tmp_path)
    cfg.fsdp.mixed_precision = False
    cfg.packing = "rows"
    worker = PolicyWorker(cfg, trainable=False)
    assert worker.cfg.packing == "rows" and worker.packing_check.passed
    with pytest.raises(ValueError, match=r"trainer.packing=tree is not exact on this model: gpt_neo.*scored up to"):
        worker.set_packing("tree")
    assert worker.cfg.packing == "rows" and worker.packing_check.packing == "rows"
    assert worker.set_packing("auto") == "rows" and worker.cfg.packing == "rows"
    assert worker.packing_check.fallback_from is not None and not worker.packing_check.fallback_from.passed
    assert "auto fell back to rows" in worker.packing_summary()["check"]
    assert worker.set_packing("rows") == "rows"


def test_under_bf16_compute_an_fp32_proxy_catches_a_leak_the_coarse_bar_lets_through(tmp_path, monkeypatch):
    """The default config computes in bf16 (FSDP mixed precision, on CPU too), where the check on the run's model
    can only use a 1-nat bar: GPT-Neo's tree scores 0.1 nats off there and passed it, so auto trained a tree that
    is not exact. The same check on an fp32 copy of the architecture (2 layers, random weights) fails it at 1e-3:
    auto falls back to rows and an explicit tree is refused, naming the proxy."""
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker, mixed_precision_on

    # bf16 compute whatever this host has: on a CPU without native bf16 torch emulates it (slower, same numbers),
    # and the run itself would compute in fp32 there, where this leak cannot hide
    monkeypatch.setattr("skyrl_stepwise.host.hardware.cpu_bf16_is_native", lambda: True)
    cfg = _gpt_neo_config(tmp_path)
    assert cfg.fsdp.mixed_precision and mixed_precision_on(cfg.fsdp, torch.device("cpu"))
    worker = PolicyWorker(cfg, trainable=False)
    tree = worker.packing_check.fallback_from
    assert worker.cfg.packing == "rows" and tree is not None
    assert tree.max_abs_error <= tree.tolerance == 1.0  # the bf16 bar alone would have trained the tree
    assert not tree.proxy.passed and tree.proxy.max_abs_error > 1e-2 and tree.proxy.tolerance == 1e-3
    assert worker.packing_check.proxy.passed and "fp32 proxy (2 of 2 layers" in worker.packing_summary()["check"]
    cfg.packing = "tree"
    with pytest.raises(ValueError, match=r"trainer.packing=tree is not exact.*on an fp32 copy of the architecture"):
        PolicyWorker(cfg, trainable=False)


def test_the_fp32_proxy_keeps_every_layer_type_in_the_fewest_layers():
    """A deep config is cut to the first layers that hold each layer type once, per-layer fields cut alike; the
    proxy's layout (windows, state-carrying layers) is the model's."""
    from transformers import AutoConfig

    from skyrl_stepwise.policy.packing.layout import layer_windows
    from skyrl_stepwise.policy.packing.proxy import build_fp32_proxy, proxy_config

    types = ["sliding_attention"] * 5 + ["full_attention"]
    gemma = AutoConfig.for_model("gemma3_text", num_hidden_layers=12, layer_types=types * 2, sliding_window=6,
                                 hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, vocab_size=96)
    cut = proxy_config(gemma)
    assert cut.num_hidden_layers == 6 and cut.layer_types == types and gemma.num_hidden_layers == 12
    assert layer_windows(cut) == layer_windows(gemma)
    hybrid = AutoConfig.for_model("nemotron_h", num_hidden_layers=8, hybrid_override_pattern="MM*-MM*-",
                                  hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  vocab_size=96, mamba_num_heads=8, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                                  chunk_size=8, intermediate_size=96)
    cut = proxy_config(hybrid)
    assert cut.num_hidden_layers == 4 and cut.hybrid_override_pattern == "MM*-"  # mamba, attention, mlp: all there
    assert set(cut.layer_types) == set(hybrid.layer_types) and len(cut.layer_types) == 4
    model = tiny_model("llama", num_hidden_layers=5)
    proxy = build_fp32_proxy(model, torch.device("cpu"))
    assert proxy.config.num_hidden_layers == 2 and type(proxy) is type(model)
    assert proxy.config._attn_implementation == model.config._attn_implementation
    # Gemma 3n shares the last layers' KV with earlier ones by index: cut to 2 layers it does not build, so the
    # proxy takes more layers (here all 4) instead of leaving the check at the bf16 bar
    from transformers import AutoModelForCausalLM
    gemma3n = AutoConfig.for_model("gemma3n_text", hidden_size=64, intermediate_size=[96] * 4, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96,
                                   sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
                                   vocab_size_per_layer_input=96, hidden_size_per_layer_input=16, altup_num_inputs=2,
                                   num_kv_shared_layers=2, laurel_rank=8, activation_sparsity_pattern=[0.95] * 4)
    with pytest.raises(Exception):
        AutoModelForCausalLM.from_config(proxy_config(gemma3n))
    proxy = build_fp32_proxy(AutoModelForCausalLM.from_config(gemma3n), torch.device("cpu"))
    assert proxy.config.num_hidden_layers == 4


def test_attention_that_drops_soft_capping_or_sinks_is_refused():
    """Gemma 2 soft-caps attention logits and gpt-oss has learned sinks; transformers' sdpa and our packed flex skip
    them, so those attentions would train another function than the engine samples from."""
    from skyrl_stepwise.policy.packing import refuse_inexact_attention

    with pytest.raises(ValueError, match=r"trainer.attn_implementation=sdpa is not exact on gemma2.*soft-capping"):
        refuse_inexact_attention(attention_layout(tiny_model("gemma2", "sdpa")))
    refuse_inexact_attention(attention_layout(tiny_model("gemma2", "eager")))
    refuse_inexact_attention(attention_layout(tiny_model("gemma3_text", "sdpa")))  # Gemma 3 has no soft-capping
    sinks = tiny_model("gpt_oss", "eager")
    refuse_inexact_attention(attention_layout(sinks))
    sinks.config._attn_implementation = "flex_attention"  # the GPU path has no sinks: refused, not dropped
    with pytest.raises(ValueError, match=r"flex_attention is not exact on gpt_oss.*attention sinks"):
        refuse_inexact_attention(attention_layout(sinks))


def test_longrope_packs_only_rows_that_cannot_pass_its_switch_length():
    """longrope (Phi-3.5, Phi-4-mini) takes its long factors for a whole forward once the row's longest position passes
    original_max_position_embeddings: a short sample packed with a long one would score with the long factors. Rows
    of at most the switch length pack exactly (a longer sample has a row of its own); longer rows get one sample per
    row, and an explicit tree is refused naming the reason."""
    model = tiny_model("phi3[longrope]")  # switch at 48 positions
    base = conformance_batch()  # 16 to 28 tokens each, plus one sample past the switch
    batch = TrainBatch(prompt_ids=base.prompt_ids + [list(range(3, 49))], response_ids=base.response_ids + [[5] * 6],
                       loss_masks=base.loss_masks + [[1] * 6], instance_ids=base.instance_ids + ["long"])
    with torch.no_grad():
        alone = logprobs_alone(model, batch)
    fits = attention_layout(model, row_tokens=48)
    assert not fits.one_sample_per_row and resolve_packing("auto", fits) == "tree"
    for packing in ("rows", "tree"):
        mbs = rank_micro_batches(batch, 0, 1, 48, packing)
        assert any(len(mb) > 1 for mb in mbs) and [len(batch) - 1] in mbs
        with torch.no_grad():
            assert (_packed(model, batch, mbs, packing, fits) - alone).abs().max() < 1e-5
    with torch.no_grad():  # what a row past the switch does to the short samples in it
        leaked = _packed(model, batch, [list(range(len(batch)))], "rows", fits)
    assert (leaked - alone).abs().max() > 1e-3
    wide = attention_layout(model, row_tokens=4096)
    assert wide.one_sample_per_row
    with pytest.raises(ValueError, match=r"trainer.packing=tree is not exact on phi3.*longrope.*micro_batch_tokens"):
        resolve_packing("tree", wide)


def test_selfcheck_catches_a_length_dependent_rope_the_layout_missed():
    """The self-check's probe row passes the RoPE switch length the config declares, so a length-dependent RoPE we
    did not read (here: longrope hidden from the layout) fails it instead of training short samples on long factors."""
    from dataclasses import replace

    model = tiny_model("phi3[longrope]")
    blind = replace(attention_layout(model, row_tokens=4096), length_dependent_rope=None)
    assert not blind.one_sample_per_row
    check = check_packing(model, blind, "rows", torch.device("cpu"))
    assert not check.passed and check.longest_sample > 48, check.describe()
    exact = check_packing(model, attention_layout(model, row_tokens=4096), "rows", torch.device("cpu"))
    assert exact.passed and exact.max_abs_error < 1e-5


def test_dynamic_rope_is_refused_whatever_the_packing():
    """transformers' dynamic NTK RoPE recomputes its frequencies from each forward's longest position and keeps them
    for later forwards: no packing (not even one sample per row) scores a sample as it scored alone."""
    from skyrl_stepwise.policy.packing import refuse_inexact_attention

    model = tiny_model("llama", max_position_embeddings=16,
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ValueError, match=r"no trainer.packing is exact on llama.*dynamic NTK RoPE"):
        refuse_inexact_attention(attention_layout(model, row_tokens=4096))


class _WholeRowLlama(torch.nn.Module):
    """A causal LM whose forward drops the attention mask and position ids: every token sees the whole row up to it,
    the way a custom or remote-code model that builds its own causal mask would."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, **kwargs)


@pytest.mark.parametrize("packing", ["rows", "tree"])
def test_selfcheck_catches_a_model_that_ignores_masks_and_positions(packing):
    model = _WholeRowLlama(tiny_model("llama"))
    layout = attention_layout(model)
    check = check_packing(model, layout, packing, torch.device("cpu"))
    assert not check.passed and check.max_abs_error > 100 * check.tolerance
    message = refusal(check, layout)
    assert f"trainer.packing={packing}" in message and "llama" in message and "trainer.attn_implementation" in message


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma3_text", "qwen3_5_text"])
def test_selfcheck_passes_on_exact_packing_with_probes_longer_than_the_window(model_type):
    model = tiny_model(model_type, attention_implementations(model_type)[0])
    layout = attention_layout(model)
    check = check_packing(model, layout, resolve_packing("auto", layout), torch.device("cpu"))
    assert check.passed and check.max_abs_error < 1e-5, check.describe()
    assert check.longest_sample > (layout.max_window or 0)


def test_masks_keep_samples_apart_and_windows_in_depth():
    """The mask rule itself: rows are block-diagonal, a window counts depth (positions), layer types with different
    windows get a mask each, a single sample needs none, and a varlen kernel refuses a tree row."""
    from skyrl_stepwise.policy.packing.layout import AttentionLayout
    from skyrl_stepwise.policy.packing.masks import allowed_mask, row_model_inputs

    # rows: two samples of 3 and 2 tokens
    end, depth = torch.tensor([3, 3, 3, 5, 5]), torch.tensor([0, 1, 2, 0, 1])
    full = allowed_mask(end, depth)
    assert full.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    windowed = allowed_mask(end, depth, window=2)  # q - k < 2 in positions
    assert windowed[2].int().tolist() == [0, 1, 1, 0, 0] and windowed[4].int().tolist() == [0, 0, 0, 1, 1]
    # a tree: root 0 -> 1 -> 2 and 0 -> 3; the window counts depth, not the row index
    tree_end, tree_depth = torch.tensor([4, 3, 3, 4]), torch.tensor([0, 1, 2, 1])
    assert allowed_mask(tree_end, tree_depth, window=2)[3].int().tolist() == [1, 0, 0, 1]
    ids, pos = torch.arange(5)[None], depth[None]
    mixed = AttentionLayout("m", "sdpa", {"full_attention": None, "sliding_attention": 2})
    masks = row_model_inputs(ids, pos, end, mixed)["attention_mask"]
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(masks["sliding_attention"][0, 0], windowed) and torch.equal(masks["full_attention"][0, 0], full)
    one = row_model_inputs(torch.arange(3)[None], torch.arange(3)[None], torch.tensor([3, 3, 3]), mixed)
    assert "attention_mask" not in one  # a single sample: the model builds its own masks, exactly as alone
    varlen = AttentionLayout("m", "flash_attention_2", {"full_attention": None})
    assert "attention_mask" not in row_model_inputs(ids, pos, end, varlen)  # boundaries from position ids
    with pytest.raises(ValueError, match="cannot take a prefix-tree row"):
        row_model_inputs(torch.arange(4)[None], tree_depth[None], tree_end, varlen)
    recurrent = AttentionLayout("m", "sdpa", {"full_attention": None}, stateful_layers=("mamba",))
    with pytest.raises(ValueError, match="one sample per row"):
        row_model_inputs(ids, pos, end, recurrent)


# ------------------------------------------------------------------------------------------ LoRA (#46)

LORA_ARCHITECTURES = ["llama", "qwen2", "gpt2", "mistral", "gemma2", "qwen3_5_text"]


def _tiny_gpt2(attn: str) -> torch.nn.Module:
    """GPT-2: fused Conv1D projections (peft's fan_in_fan_out path), not in the zoo's config scheme."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=256,
                                      attn_implementation=attn)).eval()


def _with_trained_adapter(model: torch.nn.Module) -> torch.nn.Module:
    """The model with a LoRA adapter on every decoder linear (trainer.lora's default), its A and B random as after
    training (a fresh adapter's B = 0 would leave the base model, proving nothing)."""
    from skyrl_stepwise.policy.config import LoRAConfig
    from skyrl_stepwise.policy.lora import apply_lora

    apply_lora(model, LoRAConfig(enabled=True, rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return model


@pytest.mark.parametrize("model_type", LORA_ARCHITECTURES)
def test_packed_samples_with_a_trained_lora_adapter_score_exactly_as_alone_or_are_refused(model_type):
    """With an adapter the packed forward (rows and tree) still equals each sample alone (1e-5) and the adapter's
    gradients equal one sample per row (1e-4 relative); tree on a state-carrying model is refused as without LoRA."""
    batch = conformance_batch()
    weights = torch.linspace(-1.0, 1.0, sum(len(r) for r in batch.response_ids))
    attns = ["sdpa", "eager"] if model_type == "gpt2" else attention_implementations(model_type)
    for attn in attns:
        plain = _tiny_gpt2(attn) if model_type == "gpt2" else tiny_model(model_type, attn)
        with torch.no_grad():
            base = logprobs_alone(plain, batch)
        model = _with_trained_adapter(plain)
        layout = attention_layout(model)
        assert layout.one_sample_per_row == (model_type in STATE_CARRYING), layout.describe()
        with torch.no_grad():
            alone = logprobs_alone(model, batch)
        assert (alone - base).abs().max() > 1e-3  # the adapter changes what the model computes
        singles = rank_micro_batches(batch, 0, 1, 10_000, "rows", one_sample_per_row=True)
        reference_grads = _grads(model, batch, singles, "rows", layout, weights)
        assert reference_grads and all(".lora_" in n for n in reference_grads)
        for packing in ("rows", "tree"):
            if packing == "tree" and layout.one_sample_per_row:
                with pytest.raises(ValueError, match=rf"trainer.packing=tree is not exact on {model_type}"):
                    resolve_packing("tree", layout)
                continue
            mbs = rank_micro_batches(batch, 0, 1, 10_000, packing, layout.one_sample_per_row)
            with torch.no_grad():
                got = _packed(model, batch, mbs, packing, layout)
            err = (got - alone).abs().max().item()
            assert err < 1e-5, f"LoRA {model_type} {attn} {packing}: max |packed - alone| = {err:.2e}"
            grads = _grads(model, batch, mbs, packing, layout, weights)
            assert grads.keys() == reference_grads.keys()
            for name, g in grads.items():
                ref = reference_grads[name]
                rel = (g - ref).norm() / ref.norm().clamp_min(1e-12)
                assert rel < 1e-4, f"LoRA {model_type} {attn} {packing}: gradient of {name} off by {rel:.2e}"


def test_flex_packing_with_a_trained_lora_adapter_scores_as_alone():
    """flex_attention (the GPU path; forward only on CPU) packs a model with a trained adapter exactly, tree and
    rows: peft wraps the linear layers only, the attention kernel and its BlockMask see the same tensors."""
    from skyrl_stepwise.policy.packing.flex import register_packed_flex_attention

    batch = conformance_batch()
    model = _with_trained_adapter(tiny_model("llama", "sdpa"))
    with torch.no_grad():
        alone = logprobs_alone(model, batch)
    model.set_attn_implementation(register_packed_flex_attention())
    layout = attention_layout(model)
    for packing in ("rows", "tree"):
        mbs = rank_micro_batches(batch, 0, 1, 10_000, packing, layout.one_sample_per_row)
        with torch.no_grad():
            got = _packed(model, batch, mbs, packing, layout)
        err = (got - alone).abs().max().item()
        assert err < 1e-5, f"LoRA llama flex {packing}: max |packed - alone| = {err:.2e}"
