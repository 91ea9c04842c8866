"""The embedded SmolLM2: GGUF on PyPI -> a plain HF folder that loads anywhere and predicts identically."""

from __future__ import annotations

import time

import pytest
import torch

from skyrl_stepwise.models import prepare
from skyrl_stepwise.models.prepare import MODEL_NAME, gguf_path, prepare_model, resolve_model_path


def test_gguf_is_found_through_package_metadata():
    path = gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert path.stat().st_size > 50_000_000  # the real ~98 MB Q4_1 file, not a pointer


def test_resolve_model_path_rules(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match="does/not/exist"):
        resolve_model_path("./does/not/exist")


def test_interrupted_prepare_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    def crash_midway(gguf, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("killed")  # a conversion that dies half-way

    monkeypatch.setattr(prepare, "convert", crash_midway)
    with pytest.raises(RuntimeError, match="killed"):
        prepare_model(tmp_path)
    models = tmp_path / "models"
    assert not (models / MODEL_NAME).exists()
    assert list(models.iterdir()) == []  # the temp dir is cleaned up too


@pytest.mark.integration
def test_prepare_is_idempotent_and_cli_prints_folder(model_path, capsys):
    stamp = (model_path / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert prepare_model() == model_path
    assert time.perf_counter() - start < 1.0
    assert (model_path / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    assert resolve_model_path("smollm2") == str(model_path)
    assert prepare.main([]) == 0
    assert capsys.readouterr().out.strip() == str(model_path)


@pytest.mark.integration
def test_converted_model_has_identical_logits_and_a_chat_template(model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model_path.iterdir()}
    assert "<|im_start|>" in tokenizer.chat_template
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}],
                                        add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")

    gguf = gguf_path()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    converted = AutoModelForCausalLM.from_pretrained(model_path)
    assert "quantization_config" not in converted.config.to_dict()
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(original(x).logits, converted(x).logits)
