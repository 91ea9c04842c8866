"""longrope and the engines' context: the trainer scores every token with the RoPE factors vLLM uses.

vLLM decides once, at engine start, from engine.max_model_len: past original_max_position_embeddings every token
gets the long factors (vllm/model_executor/layers/rotary_embedding/phi3_long_rope_scaled_rope.py); transformers
picks them per forward from its largest position. Unpinned, a sample shorter than the switch was sampled with the
long factors and trained with the short ones.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_stepwise.policy.batching import TrainBatch
from skyrl_stepwise.policy.config import TrainerConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SWITCH, MAX_POSITIONS = 16, 64
SHORT, LONG = [1.0, 1.0, 1.0, 1.0], [3.0, 5.0, 7.0, 9.0]


def _phi3(short_factor=SHORT):
    """A tiny Phi-3 with longrope (head_dim 8: 4 factors), switching at 16 positions."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                        intermediate_size=64, vocab_size=96, max_position_embeddings=MAX_POSITIONS, pad_token_id=0,
                        eos_token_id=1, bos_token_id=1, original_max_position_embeddings=SWITCH, initializer_range=0.5,
                        rope_scaling={"rope_type": "longrope", "short_factor": list(short_factor),
                                      "long_factor": LONG})
    torch.manual_seed(0)
    return Phi3ForCausalLM(config).eval()


def _batch() -> TrainBatch:
    """Two samples under the switch length and one past it."""
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(2, 90, (n,), generator=g).tolist()

    prompts, responses = [ids(6), ids(4), ids(20)], [ids(5), ids(7), ids(6)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      instance_ids=["a", "a", "b"])


def _alone(model, batch) -> torch.Tensor:
    """Each sample forwarded alone by a plain HF model."""
    out = []
    with torch.no_grad():
        for p, r in zip(batch.prompt_ids, batch.response_ids):
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
            out.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    return torch.cat(out)


def _worker(tmp_path, engine_max_model_len):
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    _phi3().save_pretrained(tmp_path / "m")
    cfg = TrainerConfig(model_path=str(tmp_path / "m"), attn_implementation="eager", packing="auto",
                        ckpt_dir=str(tmp_path / "c"), engine_max_model_len=engine_max_model_len)
    cfg.fsdp.mixed_precision = False
    return PolicyWorker(cfg, trainable=False)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_past_the_switch_the_trainer_scores_every_token_with_the_long_factors_as_the_engine_does(tmp_path):
    """engine.max_model_len 64 > original 16: the engine-style forward (long factors for all tokens: the same weights
    with short_factor = long_factor) and the trainer agree on short and long samples alike; plain transformers
    (short factors below the switch) does not, which is what the trainer computed before."""
    batch = _batch()
    worker = _worker(tmp_path, MAX_POSITIONS)
    trainer = torch.tensor(sum(worker.compute_logprobs(batch), []))
    engine_style = _phi3(short_factor=LONG)
    engine_style.load_state_dict(_phi3().state_dict())
    torch.testing.assert_close(trainer, _alone(engine_style, batch), rtol=1e-5, atol=1e-5)
    per_forward = _alone(_phi3(), batch)  # transformers' own choice: short factors for the two short samples
    assert (trainer - per_forward).abs()[:12].max() > 1e-3
    torch.testing.assert_close(trainer[12:], per_forward[12:], rtol=1e-5, atol=1e-5)  # the long one: long anyway
    note = " ".join(worker.packing_summary()["notes"])
    assert "long RoPE factors" in note and "engine.max_model_len=64 > original_max_position_embeddings=16" in note


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_within_the_switch_every_token_keeps_the_short_factors(tmp_path):
    """engine.max_model_len <= original: vLLM uses the short factors for every token; so does the trainer, even for
    a forward past the switch (the self-check's probe, a longer packed row)."""
    batch = _batch()
    worker = _worker(tmp_path, SWITCH)
    trainer = torch.tensor(sum(worker.compute_logprobs(batch), []))
    short_everywhere = _phi3()
    short_everywhere.load_state_dict(_phi3().state_dict())
    short_everywhere.config.rope_parameters["long_factor"] = SHORT  # transformers then never leaves the short ones
    torch.testing.assert_close(trainer, _alone(short_everywhere, batch), rtol=1e-5, atol=1e-5)
    assert "short RoPE factors" in " ".join(worker.packing_summary()["notes"])


@pytest.mark.integration  # slow for the fast suite (> 2 s on a quiet 2-core box)
def test_the_pinned_rope_is_vllms_cos_sin_cache(monkeypatch):
    """The pinned rotary embedding's cos/sin are vLLM's own Phi3LongRoPEScaledRotaryEmbedding cache rows at the same
    positions, for a context past the switch and one within it."""
    from types import SimpleNamespace

    rope_module = pytest.importorskip("vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope")
    from skyrl_stepwise.models.rope import pin_longrope

    for max_model_len in (MAX_POSITIONS, SWITCH):
        positions = torch.arange(max_model_len)  # the positions such an engine ever scores
        model = _phi3()
        assert pin_longrope(model, max_model_len) is not None
        x = torch.zeros(1, len(positions), 32)
        cos, sin = model.model.rotary_emb(x, positions[None])
        monkeypatch.setattr(rope_module, "get_current_vllm_config",
                            lambda: SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len)))
        vllm_rope = rope_module.Phi3LongRoPEScaledRotaryEmbedding(8, 8, MAX_POSITIONS, SWITCH, 10000.0, True,
                                                                  torch.float32, SHORT, LONG)
        offset = SWITCH if vllm_rope.use_long_rope else 0
        assert vllm_rope.use_long_rope == (max_model_len > SWITCH)
        v_cos, v_sin = vllm_rope.long_short_cos_sin_cache[positions + offset].chunk(2, dim=-1)
        torch.testing.assert_close(cos[0], v_cos.repeat(1, 2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin[0], v_sin.repeat(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_transformers_engine_pins_the_same_factors(tmp_path):
    """engine.backend=transformers decodes with a KV cache: transformers' per-forward choice would switch factors
    mid-generation. It uses vLLM's rule too, so the trainer's pinned RoPE matches whichever engine sampled."""
    from skyrl_stepwise.inference.config import EngineConfig
    from skyrl_stepwise.inference.hf_engine import HFEngine
    from skyrl_stepwise.models.rope import PINNED_LONGROPE

    from transformers import AutoTokenizer

    from skyrl_stepwise.models import resolve_model_path

    _phi3().save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(resolve_model_path("smollm2")).save_pretrained(tmp_path / "m")  # any tokenizer
    long_model = _phi3(short_factor=LONG)
    for max_model_len, expected in ((MAX_POSITIONS, long_model), (SWITCH, _phi3())):
        engine = HFEngine(EngineConfig(backend="transformers", model_path=str(tmp_path / "m"), dtype="float32",
                                       max_model_len=max_model_len, device="cpu"))
        rotary = engine.model.model.rotary_emb
        assert rotary.rope_type == PINNED_LONGROPE
        torch.testing.assert_close(rotary.inv_freq, expected.model.rotary_emb.inv_freq)
