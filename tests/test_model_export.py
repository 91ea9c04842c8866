"""`skyrl-stepwise model export` (cli/export.py): a trained checkpoint as a plain HF folder (LoRA merged) or a peft
adapter, loadable by transformers / peft and scoring what the trained policy scores (fp32, 1e-5); an incomplete
checkpoint is refused naming the missing file. Tiny random models, one gloo rank in-process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from arch_zoo import logprobs_alone
from test_lora import _batch, _cfg, _save_tiny, _worker

from skyrl_stepwise.cli import main as cli_main
from skyrl_stepwise.policy.config import LoRAConfig


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {arch: _save_tiny(arch, tmp_path_factory.mktemp(arch)) for arch in ("llama", "qwen2", "gpt2")}


def _flat(rows) -> torch.Tensor:
    return torch.tensor([v for row in rows for v in row])


def _trained(model_dir: str, tmp_path, lora: bool = True):
    cfg = _cfg(model_dir, tmp_path / "run" / "ckpts")
    if not lora:
        cfg = replace(cfg, lora=LoRAConfig())
        cfg.optim.lr = 1e-3
    worker = _worker(cfg)
    for _ in range(2):  # B starts at 0: two steps move both A and B
        worker.train_step(_batch())
    path = worker.save_checkpoint(2, {"step": 2})
    return worker, path, _flat(worker.compute_logprobs(_batch()))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_merged_lora_export_loads_in_transformers_and_scores_like_the_trained_policy(arch, model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    worker, _, trained = _trained(model_dirs[arch], tmp_path)
    assert cli_main(["model", "export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0  # a run dir
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors"} <= files and not any("adapter" in f for f in files)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        exported = logprobs_alone(model, _batch())
        base = logprobs_alone(AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32), _batch())
    assert (trained - base).abs().max() > 1e-3  # the adapter moved the policy
    torch.testing.assert_close(exported, trained, rtol=0, atol=1e-5)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_an_adapter_only_export_loads_in_peft_and_scores_like_the_trained_policy(arch, model_dirs, tmp_path):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    worker, path, trained = _trained(model_dirs[arch], tmp_path)
    assert cli_main(["model", "export", str(path), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == model_dirs[arch] and config["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        exported = logprobs_alone(model, _batch())
    torch.testing.assert_close(exported, trained, rtol=0, atol=1e-5)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_full_fine_tune_exports_the_model(model_dirs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    worker, _, trained = _trained(model_dirs["qwen2"], tmp_path, lora=False)
    assert cli_main(["model", "export", str(tmp_path / "run" / "ckpts"), "--out", str(tmp_path / "out")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(logprobs_alone(model, _batch()), trained, rtol=0, atol=1e-5)
    assert cli_main(["model", "export", str(tmp_path / "run"), "--out", str(tmp_path / "a"), "--adapter-only"]) == 1
    assert "is a full fine-tune (no LoRA adapter)" in capsys.readouterr().err


@pytest.mark.parametrize("remove, named", [("COMPLETE", "COMPLETE"), ("dcp/.metadata", "dcp/.metadata"),
                                           ("trainer_state.json", "trainer_state.json")])
def test_export_of_an_incomplete_checkpoint_names_the_missing_file(remove, named, tmp_path):
    from skyrl_stepwise.cli.export import export_checkpoint

    step = tmp_path / "step_3"
    (step / "dcp").mkdir(parents=True)
    for name in ("COMPLETE", "trainer_state.json", "dcp/.metadata"):
        (step / name).write_text("{}")
    (step / remove).unlink()
    with pytest.raises(FileNotFoundError, match=rf"checkpoint {step} is not complete: {step / named} is missing"):
        export_checkpoint(step, tmp_path / "out")


def test_export_of_a_folder_without_checkpoints_says_so(tmp_path):
    from skyrl_stepwise.cli.export import export_checkpoint

    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
