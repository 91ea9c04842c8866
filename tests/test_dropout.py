"""Dropout the engine never applied: the trainer scores (and SFT trains) with every dropout probability at 0.

The policy trains in train() mode; a config with dropout (GPT-2, OPT, Phi-2, ...) would otherwise compute its
training logprobs with dropout the sampler never used, so the PPO ratio and the TIS weights compare two functions.
"""

from __future__ import annotations

import pytest
import torch

from arch_zoo import conformance_batch
from skyrl_stepwise.policy.batching import forward_logprobs, pack_micro_batch
from skyrl_stepwise.policy.config import TrainerConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DROPOUT_MODELS = {  # a tiny model with dropout 0.5 wherever its family keeps one
    "gpt2 (nn.Dropout, config *_pdrop)": ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=128,
                                                       attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.5),
                                          "attn_pdrop=0.5"),
    "llama (a float attention_dropout read by eager attention)": (
        "llama", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, attention_dropout=0.5), "attention_dropout=0.5"),
}


def _worker(tmp_path, name: str, keep_dropout: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    model_type, overrides, _ = DROPOUT_MODELS[name]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **overrides)).save_pretrained(tmp_path / "m")
    cfg = TrainerConfig(model_path=str(tmp_path / "m"), attn_implementation="eager", packing="rows",
                        ckpt_dir=str(tmp_path / "c"), keep_dropout=keep_dropout)
    cfg.fsdp.mixed_precision = False
    cfg.algorithm.use_kl_loss = False
    cfg.algorithm.tis_ratio_clip_high = None
    return PolicyWorker(cfg)


def _training_logprobs(worker, batch) -> torch.Tensor:
    """What train_step's loss is computed from: the model in train() mode, the packed row's logprobs."""
    worker.model.train()
    with torch.no_grad():
        return forward_logprobs(worker.model, pack_micro_batch(batch, list(range(len(batch))), "rows"))[0]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("name", sorted(DROPOUT_MODELS))
def test_training_logprobs_have_no_dropout_and_equal_the_eval_logprobs(tmp_path, name):
    """Two training forwards give identical logprobs, equal to the eval-mode ones the engine's would match; the
    start-up note names the dropout that was turned off."""
    worker = _worker(tmp_path, name)
    batch = conformance_batch()
    first, second = _training_logprobs(worker, batch), _training_logprobs(worker, batch)
    assert torch.equal(first, second)
    evaluated = torch.tensor(sum(worker.compute_logprobs(batch), []))
    torch.testing.assert_close(first, evaluated, rtol=1e-5, atol=1e-5)
    note = " ".join(worker.packing_summary()["notes"])
    assert "dropout off in the trainer" in note and DROPOUT_MODELS[name][2] in note, note
    step = worker.train_step(_with_advantages(batch, worker))  # old = eval logprobs: every ratio is 1
    assert step["policy/ppo_kl"] < 1e-9 and step["policy/clip_frac"] == 0.0, step


def _with_advantages(batch, worker):
    import dataclasses

    lp = worker.compute_logprobs(batch)
    return dataclasses.replace(batch, advantages=[[1.0] * len(r) for r in batch.response_ids], old_logprobs=lp)


def test_keep_dropout_keeps_it_when_asked(tmp_path):
    """trainer.keep_dropout=true: the model's own dropout stays (two training forwards differ), and no note."""
    worker = _worker(tmp_path, "gpt2 (nn.Dropout, config *_pdrop)", keep_dropout=True)
    batch = conformance_batch()
    assert not torch.equal(_training_logprobs(worker, batch), _training_logprobs(worker, batch))
    assert worker.packing_summary()["notes"] == []
