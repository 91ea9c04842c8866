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


def test_processes_that_start_cold_together_convert_once(tmp_path, monkeypatch):
    """Two test workers (or a retriever beside a trainer) starting on an empty cache: one converts, the other waits
    for its lock and takes the finished folder instead of converting the same model again at the same time."""
    import threading

    builds = []

    def slow_convert(gguf, out_dir):
        builds.append(threading.get_ident())
        time.sleep(0.5)  # long enough that the second caller arrives while the first is converting
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / prepare._DONE_MARKER).write_text("done")

    monkeypatch.setattr(prepare, "convert", slow_convert)
    monkeypatch.setattr(prepare, "gguf_path", lambda: tmp_path / "model.gguf")
    results = []
    callers = [threading.Thread(target=lambda: results.append(prepare_model(tmp_path))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(builds) == 1, builds
    assert results == [tmp_path / "models" / MODEL_NAME] * 2
    assert (results[0] / "model.safetensors").read_bytes() == b"weights"


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


@pytest.mark.integration
def test_the_tiny_model_is_smollm2s_tokenizer_and_template_on_a_small_body(tiny_smollm2, model_path):
    """`model_path=smollm2-tiny` gives the plumbing tests SmolLM2's exact token ids, chat template and stop ids, with
    a body small enough for a forward pass in milliseconds and a head dim vLLM serves."""
    from transformers import AutoConfig, AutoTokenizer

    from skyrl_stepwise.models.prepare import TINY_SHAPE, resolve_model_path

    assert resolve_model_path("smollm2-tiny") == str(tiny_smollm2) == resolve_model_path("SmolLM2-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tiny_smollm2 / name).read_bytes() == (model_path / name).read_bytes(), name
    config, real = AutoConfig.from_pretrained(tiny_smollm2), AutoConfig.from_pretrained(model_path)
    assert config.hidden_size // config.num_attention_heads == config.head_dim == 32
    assert {k: getattr(config, k) for k in TINY_SHAPE} == TINY_SHAPE
    assert (config.model_type, config.vocab_size, config.eos_token_id) == (real.model_type, real.vocab_size,
                                                                           real.eos_token_id)
    messages = [{"role": "user", "content": "hi"}]
    rendered = [AutoTokenizer.from_pretrained(p).apply_chat_template(messages, add_generation_prompt=True)
                for p in (tiny_smollm2, model_path)]
    assert rendered[0] == rendered[1]
    assert (tiny_smollm2 / "model.safetensors").stat().st_size < 20e6
