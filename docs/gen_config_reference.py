"""The config reference page, generated from the typed config so it cannot drift from what a run accepts.

Walks `RunConfig` (the structured config Hydra composes conf/ into), nested dataclass by nested dataclass, and
writes one table per section: every key path, its type, the schema's default, the value conf/config.yaml gives it
where that differs, and the comment written beside the field. docs/hooks.py calls `render()` at every build;
`python docs/gen_config_reference.py` prints the page.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "skyrl_stepwise.run.config.RunConfig"


def run_config_class() -> type:
    """The run's config schema, imported from this checkout (not an installed copy elsewhere)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from skyrl_stepwise.run.config import RunConfig

    return RunConfig


def base_config() -> dict:
    """conf/config.yaml composed over the schema, interpolations kept: the values a run starts from before a recipe."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    run_config_class()
    from skyrl_stepwise.run.app_config import CONF_DIR
    from skyrl_stepwise.run.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        composed = compose(config_name="config")
    return OmegaConf.to_container(composed, resolve=False)


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the comment lines right above it plus the one at the end of its line(s), joined; the
    comments are where this codebase documents a key, so the reference quotes them."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].strip() != tok.string.strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    import ast

    comments = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, i = [], node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        after = [trailing[n] for n in range(node.lineno, node.end_lineno + 1) if n in trailing]
        comments[node.target.id] = " ".join(above + after)
    return comments


def inherited_comments(cls: type) -> dict[str, str]:
    """`field_comments` of `cls` and of every dataclass it inherits fields from, the nearest class winning: a field is
    documented where it is declared (SearchEnvConfig's retriever keys are RetrieverEndpointConfig's), and
    `inspect.getsource(cls)` shows only the class's own body."""
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base is not object and dataclasses.is_dataclass(base):
            comments.update({name: text for name, text in field_comments(base).items() if text})
    return comments


def type_name(hint) -> str:
    """A readable type: `int | None`, `list[str]`, not `typing.Optional[int]`."""
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def default_of(f: dataclasses.Field):
    """The schema's default of a field (a factory is called)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def _cell(text: str) -> str:
    """Table-safe text: a `|` or a line break would end the cell."""
    return str(text).replace("|", "&#124;").replace("\n", " ")


def _code(value) -> str:
    """A value as inline code, YAML-like (null, true) so it reads as an override would write it."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = repr(value) if isinstance(value, str) and (value == "" or value.strip() != value) else str(value)
    return "<code>" + _cell(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")) + "</code>"


def sections(cls: type, prefix: str = "", base: dict | None = None):
    """(key path of a section, its class, rows of its own leaf fields), depth first: the tree as a run reads it."""
    hints = typing.get_type_hints(cls)
    comments = inherited_comments(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        hint = hints[f.name]
        sub = base.get(f.name) if isinstance(base, dict) else None
        if dataclasses.is_dataclass(hint):
            nested.append((f"{path}.", hint, sub))
            continue
        default = default_of(f)
        in_conf = sub if isinstance(base, dict) and f.name in base and sub != default else None
        rows.append((path, type_name(hint), default, in_conf, comments.get(f.name, "")))
    yield prefix.rstrip("."), cls, rows
    for sub_prefix, sub_cls, sub_base in nested:
        yield from sections(sub_cls, sub_prefix, sub_base)


def render(cls: type | None = None, base: dict | None = None) -> str:
    """The whole page as Markdown."""
    cls = cls or run_config_class()
    base = base_config() if base is None else base
    out = ["# Config reference", "",
           f"Generated at build time from `{SCHEMA}` by `docs/gen_config_reference.py` (run by the mkdocs hook "
           "`docs/hooks.py`), so every key a run accepts is here and nothing else. A key is set by a Hydra override "
           "(`skyrl-stepwise train experiment=search_r1_tiny trainer.packing=rows`) or in a recipe "
           "(`conf/experiment/*.yaml`). *default*: the schema's; *conf/config.yaml*: the base config's value where it "
           "differs (`${...}` follows another key). Recipes set more; `skyrl-stepwise train experiment=NAME --cfg job` "
           "prints a recipe's composed values.", ""]
    for path, section_cls, rows in sections(cls, "", base):
        if not rows:
            continue
        out += [f"## {path or '(top level)'}", ""]
        doc = inspect.getdoc(section_cls) or ""
        if doc and not doc.startswith(section_cls.__name__ + "("):
            out += [" ".join(doc.split()), ""]
        out += [f"*{section_cls.__module__}.{section_cls.__name__}*", "",
                "| key | type | default | conf/config.yaml | description |", "|---|---|---|---|---|"]
        for key, typ, default, in_conf, comment in rows:
            conf = _code(in_conf) if in_conf is not None else ""
            out.append(f"| `{key}` | {_cell(typ)} | {_code(default)} | {conf} | {_cell(comment)} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render())
