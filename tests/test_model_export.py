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

# single-process DCP warns that it assumes a single process, which is exactly the case here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


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


# ------------------------------------------- what export checks before it writes (issue 59: hashes, base, travel)

def _lora_checkpoint(base_dir, root):
    """A LoRA checkpoint as the worker saves one (adapter tensors alone, the recipe and the base's checksum in
    trainer_state's `model`), written directly from a tiny peft-injected model: no worker, so it is fast."""
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.checkpoint.store import save_checkpoint
    from skyrl_stepwise.policy.fsdp_worker import weights_checksum
    from skyrl_stepwise.policy.lora import adapter_recipe, apply_lora, base_weights_checksum, is_adapter_key

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8.0)
    apply_lora(model, cfg)
    torch.manual_seed(1)
    with torch.no_grad():  # a trained adapter: B moved away from its zero start
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.1)
    identity = {"model_path": str(base_dir), "adapter_only": True, "lora": adapter_recipe(model, cfg),
                "base_weights": base_weights_checksum(model.named_parameters(), weights_checksum)}
    return save_checkpoint(root, 2, model, trainer_state={"model": identity}, model_keys=is_adapter_key)


@pytest.fixture
def lora_ckpt(tiny_model_dir, tmp_path):
    """(a private copy of the tiny base, a LoRA checkpoint trained on it)."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    return base, _lora_checkpoint(base, tmp_path / "ckpts")


@pytest.mark.parametrize("adapter_only", [False, True])
def test_export_refuses_a_base_whose_weights_changed_since_training(lora_ckpt, tmp_path, capsys, adapter_only):
    """It used to merge the adapter into whatever the recorded folder held by then, without a word."""
    from safetensors.torch import load_file, save_file

    base, ckpt = lora_ckpt
    weights = load_file(base / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] += 0.5
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    args = ["model", "export", str(ckpt), "--out", str(tmp_path / "out")] + (["--adapter-only"] if adapter_only else [])
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert f"the base {base} is not the model the LoRA adapter of {ckpt} was trained on" in err
    assert "when the checkpoint was saved" in err and "--model-path" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, named", [("flip", "dcp/__0_0.distcp"), ("drop manifest", "MANIFEST.json")])
def test_export_refuses_a_checkpoint_whose_bytes_are_not_the_saved_ones(lora_ckpt, tmp_path, capsys, damage, named):
    """A flipped exponent bit in the adapter's shard (it used to be exported as is) or a deleted manifest: the
    export checks the content hashes as a resume does, and writes nothing."""
    import struct

    _, ckpt = lora_ckpt
    if damage == "flip":
        shard = ckpt / "dcp" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        value = next(t for n, t in _saved_adapter(ckpt).items() if ".lora_B." in n).flatten()[:2]
        at = data.find(struct.pack("<ff", *value.tolist()))
        assert at >= 0
        data[at + 3] ^= 0x40  # an exponent bit of the first float
        shard.write_bytes(bytes(data))
    else:
        (ckpt / "MANIFEST.json").unlink()
    assert cli_main(["model", "export", str(ckpt), "--out", str(tmp_path / "out"), "--adapter-only"]) == 1
    err = capsys.readouterr().err
    assert f"{ckpt / named} cannot be read" in err
    assert not (tmp_path / "out").exists()


def _saved_adapter(ckpt) -> dict[str, torch.Tensor]:
    """The adapter tensors a checkpoint holds, read with DCP in this process."""
    import torch.distributed.checkpoint as dcp

    from skyrl_stepwise.checkpoint.store import saved_model_shapes

    state = {"model": {name: torch.empty(shape) for name, shape in saved_model_shapes(ckpt).items()}}
    dcp.load(state, checkpoint_id=ckpt / "dcp", no_dist=True)
    return state["model"]


def test_an_adapter_export_says_which_base_must_travel_with_it(lora_ckpt, tmp_path, capsys):
    """The adapter's base_model_name_or_path is a folder of this machine (here a supervised warm start, like the
    main job's 651 MB SFT model): README.md, EXPORT.json and the console say it must travel with the adapter."""
    import json

    base, ckpt = lora_ckpt
    (base / "sft_metrics.json").write_text("[]")  # what marks a warm start of this library
    assert cli_main(["model", "export", str(ckpt), "--out", str(tmp_path / "out"), "--adapter-only"]) == 0
    out = capsys.readouterr().out
    assert f"its base model: {base}: a supervised warm start trained by skyrl-stepwise (published nowhere)" in out
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "its base must travel with it" in readme and str(base) in readme
    record = json.loads((tmp_path / "out" / "EXPORT.json").read_text())["base"]
    assert record["name"] == str(base) and record["portable"] is False and record["weight_bytes"] > 0
    assert record["base_weights"] == json.loads((ckpt / "trainer_state.json").read_text())["model"]["base_weights"]
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)


def test_a_hub_base_is_named_as_portable():
    from skyrl_stepwise.cli.export import describe_base

    base = describe_base("HuggingFaceTB/SmolLM2-135M-Instruct", "abc")
    assert base.portable and "loads anywhere" in base.where and base.weight_bytes == 0
