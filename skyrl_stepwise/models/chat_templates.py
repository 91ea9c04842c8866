"""Which chat template a prepared model gets: one named on the command line (a file or a family name), the one
the model file carries, or, for a known architecture whose file carries none (base GGUFs), its family's template
with a warning. No template at all is refused before anything is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent / "templates"
# family name -> (template file, the token that closes a turn: generation stops there too)
FAMILIES = {"gemma": ("gemma.jinja", "<end_of_turn>"), "chatml": ("chatml.jinja", "<|im_end|>")}
ARCHITECTURE_FAMILY = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma"}


class MissingChatTemplate(ValueError):
    """The model carries no chat template and none was named: nothing can render a conversation for it."""


@dataclass(frozen=True)
class ChosenTemplate:
    """The template text, where it came from (said at prepare time) and the turn-closing token, if known."""

    text: str
    source: str
    turn_end: str | None = None
    guessed: bool = False  # taken from the architecture, not from the file or the user


def family_names() -> list[str]:
    """Every value `--chat-template` accepts besides a file path."""
    return sorted(FAMILIES)


def _family(name: str, source: str, guessed: bool = False) -> ChosenTemplate:
    file, turn_end = FAMILIES[name]
    return ChosenTemplate((TEMPLATE_DIR / file).read_text(), source, turn_end, guessed)


def choose_chat_template(requested: str | None, carried: str | None, architecture: str, model: str) -> ChosenTemplate:
    """`requested` (`--chat-template`: a family name or a jinja file) wins, then the model's own template, then
    the family of `architecture`; otherwise MissingChatTemplate naming the model and the option."""
    if requested:
        if requested in FAMILIES:
            return _family(requested, f"--chat-template {requested}")
        path = Path(requested).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {requested!r} is neither a file nor one of "
                                    f"{', '.join(family_names())}")
        return ChosenTemplate(path.read_text(), f"--chat-template {path}")
    if carried:
        return ChosenTemplate(carried, "the model's own chat template")
    family = ARCHITECTURE_FAMILY.get(architecture)
    if family:
        return _family(family, f"the {family} family template (the file carries none; architecture "
                               f"{architecture!r})", guessed=True)
    raise MissingChatTemplate(
        f"{model} carries no chat template and architecture {architecture!r} has no known family: pass "
        f"--chat-template FILE.jinja or one of {', '.join(family_names())}; nothing was written")
