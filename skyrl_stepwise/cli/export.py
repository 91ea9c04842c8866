"""`skyrl-stepwise model export <checkpoint or run dir> --out DIR [--adapter-only]`: a trained policy as files.

Writes a plain Hugging Face folder (config, tokenizer files, model.safetensors) that transformers and vLLM load like
any model, with a LoRA adapter merged in exactly as the weight sync merges it for the engines (policy/lora.py's
`merged_items`); with --adapter-only, a LoRA run's adapter alone in peft's format (adapter_config.json +
adapter_model.safetensors, base_model_name_or_path set) for `PeftModel.from_pretrained` or vLLM's LoRA path.

It reads the checkpoint the run saved (checkpoint/store.py's DCP folder) into a plain, unsharded model in one
process, no GPU and no process group: the base from the folder the checkpoint records (`model` in
trainer_state.json, the run's trainer.model_path), the adapter or the full weights from dcp/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# what a checkpoint folder must hold for an export (the optimizer, scheduler and RNG files are not needed)
NEEDED = ("COMPLETE", "trainer_state.json", "dcp/.metadata")
# the files of a model folder that are not weights: copied as they are, so the export tokenizes and chats the same
AUXILIARY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
             "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
             "generation_config.json")


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder `path` names: a step folder itself, the newest complete one of a checkpoint dir, or
    that of a run dir (its `ckpts/`). An incomplete step folder is refused naming the missing file."""
    from skyrl_stepwise.checkpoint.store import find_latest_complete

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model export: {path} is not a directory (a checkpoint step_N folder, a "
                                "trainer.ckpt_dir or a run dir)")
    looks_like_step = (path / "dcp").exists() or (path / "trainer_state.json").exists() or \
        path.name.startswith("step_")
    if looks_like_step:
        missing = [name for name in NEEDED if not (path / name).exists()]
        if missing:
            raise FileNotFoundError(f"model export: checkpoint {path} is not complete: {path / missing[0]} is "
                                    f"missing{' (the save did not finish)' if missing[0] == 'COMPLETE' else ''}")
        return path
    for folder in (path, path / "ckpts"):
        latest = find_latest_complete(folder)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"model export: no complete checkpoint (step_N folder with a COMPLETE marker) in {path} "
                            f"or {path / 'ckpts'}")


def _identity(ckpt: Path, model_path: str | None) -> dict:
    """The checkpoint's model record; checkpoints written before it existed need --model-path (full weights)."""
    saved = dict(json.loads((ckpt / "trainer_state.json").read_text()).get("model") or {})
    if model_path:
        saved["model_path"] = model_path
    if not saved.get("model_path"):
        raise ValueError(f"model export: {ckpt / 'trainer_state.json'} records no model folder (a checkpoint "
                         "written before exports); pass --model-path <the run's trainer.model_path>")
    return saved


def load_trained_model(ckpt: Path, model_path: str | None = None):
    """(plain HF model with the checkpoint's weights, peft model or None, the checkpoint's model record): the base
    from the recorded folder, a LoRA adapter rebuilt from the recorded recipe and both loaded from dcp/."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.policy.lora import is_adapter_key, peft_lora_config

    identity = _identity(ckpt, model_path)
    base_path = resolve_model_path(identity["model_path"])
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    peft_model = None
    target = model
    if identity.get("lora"):
        from peft import get_peft_model

        peft_model = get_peft_model(model, peft_lora_config(model, identity["lora"], str(base_path)))
        target = peft_model.base_model.model  # the same module names as the trainer's injected model
    state = get_model_state_dict(target)
    if identity.get("adapter_only"):
        state = {k: v for k, v in state.items() if is_adapter_key(k)}
    dcp.load({"model": state}, checkpoint_id=ckpt / "dcp", no_dist=True)
    set_model_state_dict(target, state, options=StateDictOptions(strict=not identity.get("adapter_only")))
    return target, peft_model, dict(identity, model_path=str(base_path))


def export_checkpoint(path: str | Path, out: str | Path, adapter_only: bool = False,
                      model_path: str | None = None) -> Path:
    """Write the export of the checkpoint `path` names into `out` (created; must be empty or absent); returns it."""
    import torch

    from skyrl_stepwise.policy.lora import adapted_layers, merged_items

    ckpt = find_checkpoint(path)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"model export: --out {out} is not empty")
    model, peft_model, identity = load_trained_model(ckpt, model_path)
    if adapter_only and peft_model is None:
        raise ValueError(f"model export --adapter-only: checkpoint {ckpt} is a full fine-tune (no LoRA adapter); "
                         "export it without --adapter-only")
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        peft_model.save_pretrained(out)  # adapter_config.json + adapter_model.safetensors
    else:
        if peft_model is not None:
            merged = dict(merged_items(model.state_dict(), adapted_layers(model)))  # what the engines receive
            model = peft_model.unload()  # the plain model, its adapter layers replaced by their base layers
            with torch.no_grad():
                model.load_state_dict(merged, strict=True)
        model.save_pretrained(out)
    _copy_auxiliary(Path(identity["model_path"]), out)
    (out / "EXPORT.json").write_text(json.dumps({"checkpoint": str(ckpt.resolve()), "adapter_only": adapter_only,
                                                 "base_model": identity["model_path"]}, indent=1))
    return out


def _copy_auxiliary(base: Path, out: Path) -> None:
    """The base folder's tokenizer and generation files (absent ones skipped: a hub id has no local folder)."""
    if not base.is_dir():
        return
    for name in AUXILIARY:
        if (base / name).is_file() and not (out / name).exists():
            shutil.copy2(base / name, out / name)


def main(argv: list[str] | None = None) -> int:
    """Export one checkpoint and print where it went."""
    parser = argparse.ArgumentParser(prog="skyrl-stepwise model export", description=__doc__.split("\n\n")[1])
    parser.add_argument("path", help="a checkpoint step_N folder, a trainer.ckpt_dir (its newest complete "
                                     "checkpoint) or a run dir (its ckpts/)")
    parser.add_argument("--out", required=True, help="the folder to write (absent or empty)")
    parser.add_argument("--adapter-only", action="store_true",
                        help="a LoRA run's adapter alone, in peft's format, instead of the merged model")
    parser.add_argument("--model-path", default=None,
                        help="the base model folder, for checkpoints that do not record it")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        out = export_checkpoint(args.path, args.out, args.adapter_only, args.model_path)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    kind = "adapter (peft)" if args.adapter_only else "model (Hugging Face folder)"
    print(f"exported the {kind} to {out.resolve()}")
    return 0
