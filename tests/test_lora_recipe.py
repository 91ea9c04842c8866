"""A LoRA checkpoint records its adapter recipe, and a resume is checked against it before any tensor loads
(policy/lora.py check_adapter_recipe): a changed trainer.lora.alpha, rank or target_modules is a configuration
error naming the key and both values, never CorruptCheckpoint (which made resume=auto rename every good step_N to
step_N.corrupt) and never blamed on the base model. Tiny random models."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from skyrl_stepwise.policy.config import LoRAConfig
from skyrl_stepwise.policy.lora import AdapterRecipeMismatch, adapter_recipe, apply_lora, check_adapter_recipe


def _recipe(model_dir, **lora) -> dict:
    """The recipe a run with trainer.lora=`lora` records, on a fresh copy of the tiny model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoRAConfig(enabled=True, **{"rank": 4, "alpha": 8.0, **lora})
    apply_lora(model, cfg)
    return adapter_recipe(model, cfg)


@pytest.mark.parametrize("change, message", [
    ({"alpha": 16.0}, r"trainer.lora.alpha: saved 8.0, now 16.0"),
    ({"rank": 8}, r"trainer.lora.rank: saved 4, now 8"),
    ({"target_modules": ["q_proj", "v_proj"]},
     r"trainer.lora.target_modules: saved \['all-linear'\] \(14 modules\), now \['q_proj', 'v_proj'\] \(4 modules\); "
     r"adapted only in the checkpoint \['model.layers.0.mlp.down_proj'"),
])
def test_a_changed_adapter_recipe_is_a_config_error_naming_the_key_and_both_values(tiny_model_dir, change, message):
    saved = _recipe(tiny_model_dir)
    with pytest.raises(AdapterRecipeMismatch, match=rf"checkpoint ckpts/step_2 holds a LoRA adapter of another "
                                                    rf"recipe.*{message}"):
        check_adapter_recipe(saved, _recipe(tiny_model_dir, **change), "ckpts/step_2")


def test_the_same_adapter_under_other_words_or_dropout_resumes(tiny_model_dir):
    """target_modules compare as resolved ("all-linear" = every projection named); dropout is training noise, not
    the policy the checkpoint holds (the run dir's config check covers it)."""
    saved = _recipe(tiny_model_dir)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    check_adapter_recipe(saved, _recipe(tiny_model_dir, target_modules=every), "ckpts/step_2")
    check_adapter_recipe(saved, _recipe(tiny_model_dir, alpha=8, dropout=0.1), "ckpts/step_2")
    old = {k: saved[k] for k in ("rank", "alpha", "target_modules")}  # what checkpoints recorded before
    check_adapter_recipe(old, saved, "ckpts/step_2")
    with pytest.raises(AdapterRecipeMismatch, match="trainer.lora.alpha: saved 8.0, now 32.0"):
        check_adapter_recipe(old, _recipe(tiny_model_dir, alpha=32.0), "ckpts/step_2")


def test_lora_on_or_off_against_the_checkpoint_names_trainer_lora_enabled(tiny_model_dir):
    saved = _recipe(tiny_model_dir)
    with pytest.raises(AdapterRecipeMismatch, match=r"holds a LoRA adapter but trainer.lora.enabled=False "
                                                    r"\(saved with True\)"):
        check_adapter_recipe(saved, None, "ckpts/step_2")
    with pytest.raises(AdapterRecipeMismatch, match=r"holds a full model but trainer.lora.enabled=True "
                                                    r"\(saved with False\)"):
        check_adapter_recipe(None, saved, "ckpts/step_2")
    check_adapter_recipe(None, None, "ckpts/step_2")


@pytest.mark.integration  # three policy workers (> 2 s on a loaded 2-core box)
def test_resume_auto_with_a_changed_recipe_stops_naming_the_key_and_keeps_every_checkpoint(tmp_path):
    """Through the real worker and resume=auto: rank (was CorruptCheckpoint, step_N renamed .corrupt), alpha (was a
    silent resume into another policy) and target_modules (was blamed on the base model) each stop the resume with
    the key and both values; no folder is renamed and no tensor of the worker changes."""
    from test_lora import _batch, _cfg, _params, _save_tiny, _worker

    from skyrl_stepwise.checkpoint.store import complete_checkpoints
    from skyrl_stepwise.checkpoint.verify import resume_checkpoint

    model_dir = _save_tiny("llama", tmp_path / "llama")
    cfg = _cfg(model_dir, tmp_path / "ckpts")
    trained = _worker(cfg)
    trained.train_step(_batch())
    trained.save_checkpoint(1, {"step": 1})
    for change, message in (({"rank": 8}, "trainer.lora.rank: saved 4, now 8"),
                            ({"alpha": 16.0}, "trainer.lora.alpha: saved 8.0, now 16.0"),
                            ({"target_modules": ["q_proj"]}, r"trainer.lora.target_modules: saved \['all-linear'\]")):
        fresh = _worker(replace(cfg, lora=replace(cfg.lora, **change)))
        before = _params(fresh)
        with pytest.raises(AdapterRecipeMismatch, match=message):
            resume_checkpoint("auto", cfg.ckpt_dir, fresh.load_checkpoint, lambda msg: None)
        assert [p.name for p in complete_checkpoints(cfg.ckpt_dir)] == ["step_1"]
        after = _params(fresh)
        assert all(torch.equal(after[n], before[n]) for n in before)
