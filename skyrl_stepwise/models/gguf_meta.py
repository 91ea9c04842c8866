"""What a GGUF file says about itself (architecture, name, chat template, BOS/EOS flags), read from its header
without loading any tensor, so a conversion that cannot succeed is refused before anything is written."""

from __future__ import annotations

import contextlib
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
        reader = gguf.GGUFReader(str(path))
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
    """Within it, every `gguf.GGUFReader` of one file is a single parse, shared by our header read and the three
    transformers makes for one conversion (tokenizer, config, weights). Parsing a file's metadata walks every
    vocabulary entry through numpy memmap views: Gemma 3's 262k tokens took ~30 s (quiet machine) to ~110 s (loaded)
    per parse, most of a conversion. transformers imports `GGUFReader` from `gguf` at call time, so the module
    attribute is what it gets; restored on exit."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
