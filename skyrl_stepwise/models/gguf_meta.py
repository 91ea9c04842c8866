"""What a GGUF file says about itself (architecture, name, chat template, BOS/EOS flags), read from its header
without loading any tensor, so a conversion that cannot succeed is refused before anything is written."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Iterator
from pathlib import Path

_INSTRUCT_HINTS = ("instruct", "-it", " it", "chat", "-sft", "-dpo", "-rl")


@dataclass(frozen=True)
class GGUFInfo:
    """The header fields a conversion needs; `None` where the file does not say."""

    path: Path
    architecture: str
    name: str
    chat_template: str | None
    add_bos_token: bool | None
    add_eos_token: bool | None
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def looks_instruct(self) -> bool:
        """A file with a chat template or an instruct-sounding name was tuned for chat; anything else is taken
        for a base model, which is worth a warning: RL from a base model rarely follows a chat format."""
        name = f"{self.name} {self.path.name}".lower()
        return bool(self.chat_template) or any(h in name for h in _INSTRUCT_HINTS)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """The header of `path`; a missing or non-GGUF file fails naming it."""
    import gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        opener = gguf.GGUFReader  # within gguf_parsed_once: the shared parse
        reader = (_array_backed(opener) if isinstance(opener, type) else opener)(str(path))
    except Exception as e:
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {type(e).__name__}: {e}") from e

    def flag(key: str) -> bool | None:
        value = _field(reader, key)
        return None if value is None else bool(value)

    def int_or_none(key: str) -> int | None:
        value = _field(reader, key)
        return None if value is None else int(value)

    return GGUFInfo(path=path, architecture=str(_field(reader, "general.architecture") or ""),
                    name=str(_field(reader, "general.name") or path.stem),
                    chat_template=_field(reader, "tokenizer.chat_template") or None,
                    add_bos_token=flag("tokenizer.ggml.add_bos_token"),
                    add_eos_token=flag("tokenizer.ggml.add_eos_token"),
                    bos_token_id=int_or_none("tokenizer.ggml.bos_token_id"),
                    eos_token_id=int_or_none("tokenizer.ggml.eos_token_id"))


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it, every `gguf.GGUFReader` of one file is a single parse, shared by our header read and the reads
    transformers makes for one conversion (tokenizer, config, weights); and transformers' metadata-only decode of
    the file (`load_gguf_checkpoint(..., return_tensors=False)`, called for the tokenizer's and each config's load)
    is done once and handed out as copies; and gguf's tensor name map of one (architecture, layer count) is built
    once, where transformers builds it again for every submodule of the model it maps (SmolLM2: 397 builds; its
    conversion 18.7 s -> 13.8 s on a quiet 2-core AVX2 EPYC, the same bytes written; the map is only read).

    Why: parsing a file's metadata walks every vocabulary entry through numpy memmap views, and transformers then
    decodes every entry again in Python on each call: Gemma 3's 262k tokens took ~30 s (quiet machine) to ~110 s
    (loaded) per parse, and ~8 s per decode, most of a conversion. transformers imports `GGUFReader` from `gguf` at
    call time and `load_gguf_checkpoint` into two modules at import, so those attributes are what it gets; all are
    restored on exit. The tensor-loading call (`return_tensors=True`) is left alone: it runs once anyway."""
    import gguf
    from transformers import configuration_utils
    from transformers.models.auto import tokenization_auto

    original_reader = gguf.GGUFReader
    original_name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = _array_backed(original_reader)(path, mode)
        return readers[key]

    callers = (configuration_utils, tokenization_auto)
    original_loads = [caller.load_gguf_checkpoint for caller in callers]
    metadata: dict[str, dict] = {}

    def metadata_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original_loads[0](path, return_tensors=return_tensors, **kwargs)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = original_loads[0](path, return_tensors=False)
        return _copied(metadata[key])  # callers pop and rename keys in what they get

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    for caller in callers:
        caller.load_gguf_checkpoint = metadata_once
    try:
        yield
    finally:
        gguf.GGUFReader = original_reader
        gguf.get_tensor_name_map = original_name_map
        for caller, original_load in zip(callers, original_loads):
            caller.load_gguf_checkpoint = original_load


def _copied(value):
    """copy.deepcopy of decoded GGUF metadata (dicts and lists of str, int, float, bool): every container new, the
    immutable leaves shared. deepcopy's memo of each of a vocabulary's entries was ~6 s of Gemma 3's conversion."""
    import copy

    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_copied(item) for item in value)
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return value
    return copy.deepcopy(value)


@functools.lru_cache(maxsize=None)
def _array_backed(reader_class: type) -> type:
    """`reader_class` (gguf.GGUFReader) reading through a plain ndarray view of its file map instead of the
    np.memmap itself: the same bytes, mapped once, but each of the parse's millions of small slices (every
    vocabulary string is a length and its bytes) is a plain view, without np.memmap's per-slice bookkeeping
    (__getitem__ and __array_finalize__ were 28 of the parse's 39 s, profiled on Gemma 3's 262k tokens). Measured
    on that file: 20.1 s -> 8.2-9.3 s, every field and tensor equal (2-core AVX2 EPYC, loaded)."""
    import numpy as np

    class ArrayBackedReader(reader_class):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, value):
            self._array = np.asarray(value) if isinstance(value, np.memmap) else value

    return ArrayBackedReader
