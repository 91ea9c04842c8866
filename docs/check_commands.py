"""Check that what the docs tell a reader to type still exists: commands, modules, make targets, config keys, files.

Docs drift when code moves (#48 moved every module into rooms by role). Every command in a code block of README.md
and docs/*.md, and every inline code span that is a command, an override or a key path, is checked against this
checkout: `python -m MODULE` -> the module is importable from this checkout; `skyrl_stepwise.a.b.Name` -> a module
of this checkout (and at most one attribute under it); `skyrl-stepwise WORDS` -> a command of
`skyrl_stepwise.cli.COMMANDS`; `make TARGET [VAR=...]` -> a Makefile target and variable; `key=value` overrides
on a Hydra command (`+key=` adds a key: skipped) and `section.key` spans -> keys of the composed config;
`experiment=NAME` -> conf/experiment/NAME.yaml; repo paths (`skyrl_stepwise/...`, `conf/...`, `examples/...`,
`benchmarks/...`, `tests/...`, `docs/...`) -> they exist. `python docs/check_commands.py` prints what is stale.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO_DIRS = ("skyrl_stepwise", "conf", "examples", "benchmarks", "tests", "docs", ".ci")
PATH_RE = re.compile(r"(?<![\w./~-])((?:%s)/[\w./*-]*)" % "|".join(re.escape(d) for d in REPO_DIRS))
OVERRIDE_RE = re.compile(r"^(\+{0,2})([A-Za-z_][\w]*(?:\.[\w]+)*)=(.*)$", re.S)
KEY_SPAN_RE = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)+)(\.\*)?$")
FILE_EXTS = (".py", ".yaml", ".yml", ".json", ".jsonl", ".md", ".parquet", ".png", ".gguf", ".txt", ".log", ".pkl")
DOTTED_RE = re.compile(r"^(skyrl_stepwise(?:\.\w+)*)(?::(\w+))?(?:\(.*\))?$")
PACKAGE_PATH_RE = re.compile(r"^[a-z_]+/[\w/.-]*\.py$")
FENCE_RE = re.compile(r"^(```+|~~~+)[ \t]*([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
INLINE_RE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
SHELL_LANGS = ("", "bash", "sh", "shell", "console", "zsh")
PYTHONS = ("python", "python3", "python3.11", ".venv/bin/python", "$(BIN)/python")
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\{[^}]*\}|\[[^\]]*\]")


@dataclasses.dataclass
class Facts:
    """What exists in this checkout: the CLI's commands and which are Hydra apps, Makefile targets and variables,
    the composed config, the recipes."""

    root: Path
    commands: dict[tuple[str, ...], str]
    hydra_modules: set[str]
    make_targets: set[str]
    make_vars: set[str]
    config: object  # the composed conf/config.yaml (an OmegaConf DictConfig over RunConfig)
    sections: set[str]
    experiments: set[str]


def load_facts(root: Path = ROOT) -> Facts:
    """Read everything the checks compare against, once (composing the config takes a few seconds)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from hydra import compose, initialize_config_dir

    cli = importlib.import_module("skyrl_stepwise.cli")
    config_module = importlib.import_module("skyrl_stepwise.run.config")
    config_module.register_configs()
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        composed = compose(config_name="config")
    makefile = (root / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+)\s*:(?!=)", makefile, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:+]?=", makefile, re.M))
    hydra_modules = {module for words, (module, _) in cli.COMMANDS.items() if words[0] in ("train", "sft", "ablate")}
    return Facts(root=root, commands={words: module for words, (module, _) in cli.COMMANDS.items()},
                 hydra_modules=hydra_modules, make_targets=targets, make_vars=variables, config=composed,
                 sections={str(k) for k in composed.keys()},
                 experiments={p.stem for p in (root / "conf" / "experiment").glob("*.yaml")})


def module_exists(name: str, facts: Facts) -> bool:
    """Importable, and for this package's modules from this checkout (an editable install of another checkout
    must not make a stale name pass)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if name.split(".")[0] == "skyrl_stepwise":
        return spec.origin is not None and Path(spec.origin).resolve().is_relative_to(facts.root.resolve())
    return True


def check_dotted(name: str, facts: Facts) -> str | None:
    """None if a dotted name of this package (`skyrl_stepwise.run.config.RunConfig`, `pkg.mod:Class`) names a
    module of this checkout, or an attribute right under one (read from the files: nothing is imported)."""
    m = DOTTED_RE.match(name)
    parts = m.group(1).split(".")
    for n in range(len(parts), 0, -1):
        base = facts.root.joinpath(*parts[:n])
        if base.with_suffix(".py").exists() or base.is_dir():  # a package, namespace ones (envs/) included
            left = len(parts) - n + (1 if m.group(2) else 0)
            return None if left <= 1 else f"{name}: no module {'.'.join(parts[:n + 1])}"
    return f"{name}: no such module"


def check_key(key: str, facts: Facts) -> str | None:
    """None if `key` (a dotted path, `.*` allowed at the end) is a key of the composed config, else the error.
    Keys under a dict-typed field (environment.env_classes.NAME) are the user's own: any is fine."""
    from omegaconf import DictConfig

    node = facts.config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part == "*":
            return None
        if not isinstance(node, DictConfig):
            return f"config key {key}: {'.'.join(parts[:i])} has no sub-keys"
        if part not in node:
            object_type = node._metadata.object_type
            if object_type is None or object_type is dict:  # a free dict field: its keys are the user's
                return None
            return f"config key {key}: no `{part}` in {'.'.join(parts[:i]) or 'the config'}"
        node = node._get_node(part)
    return None


def check_overrides(words: list[str], facts: Facts) -> list[str]:
    """Hydra overrides of a command line: keys exist, recipes exist; `+key` adds a key, `hydra.*` is Hydra's own."""
    errors = []
    for word in words:
        m = OVERRIDE_RE.match(word)
        if not m:
            continue
        plus, key, value = m.groups()
        if plus or key.startswith("hydra.") or key == "hydra":
            continue
        if key == "experiment":
            if not PLACEHOLDER.search(value) and value not in facts.experiments:
                errors.append(f"experiment={value}: no conf/experiment/{value}.yaml")
            continue
        error = check_key(key, facts)
        if error:
            errors.append(error)
    return errors


def check_path(path: str, facts: Facts) -> str | None:
    """None if a repo path named in the docs exists (a glob must match something), else the error."""
    path = path.split("::")[0].rstrip(".,:;)")
    if not path or PLACEHOLDER.search(path):
        return None
    if "*" in path:
        return None if glob.glob(str(facts.root / path)) else f"path {path}: matches no file"
    return None if (facts.root / path).exists() else f"path {path}: no such file or directory"


def _strip_env(words: list[str]) -> list[str]:
    """`PYTHONPATH=. RAY_ADDRESS=x cmd ...` -> `cmd ...`."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return words


def check_command(words: list[str], facts: Facts) -> list[str]:
    """Errors of one simple command (already split into words)."""
    words = _strip_env(words)
    if not words:
        return []
    head, rest = words[0], words[1:]
    if head == "skyrl-stepwise":
        if not rest or rest[0].startswith("-"):
            return []
        for cmd_words, module in facts.commands.items():
            if tuple(rest[: len(cmd_words)]) == cmd_words:
                return check_overrides(rest[len(cmd_words):], facts) if module in facts.hydra_modules else []
        return [f"skyrl-stepwise {' '.join(rest[:2])}: no such command in skyrl_stepwise.cli.COMMANDS"]
    if head in PYTHONS:
        if rest[:1] == ["-m"] and len(rest) > 1:
            module = rest[1]
            if module == "pytest":
                return [e for w in rest[2:] if PATH_RE.fullmatch(w.split("::")[0]) for e in [check_path(w, facts)] if e]
            if not module_exists(module, facts):
                return [f"python -m {module}: no such module"]
            return check_overrides(rest[2:], facts) if module in facts.hydra_modules else []
        if rest and rest[0].endswith(".py"):
            error = check_path(rest[0], facts)
            return [f"python {rest[0]}: {error}"] if error else []
        return []
    if head == "make":
        errors = []
        for word in rest:
            if word.startswith("-"):
                continue
            m = re.match(r"^([A-Za-z_]\w*)=(.*)$", word, re.S)
            if m:
                if m.group(1) not in facts.make_vars:
                    errors.append(f"make {word}: no variable {m.group(1)} in the Makefile")
                elif m.group(1) == "ARGS":
                    errors += check_overrides(shlex.split(m.group(2)), facts)
            elif word not in facts.make_targets:
                errors.append(f"make {word}: no target {word} in the Makefile")
        return errors
    if head == "pytest":
        return [e for w in rest if PATH_RE.fullmatch(w.split("::")[0]) for e in [check_path(w, facts)] if e]
    return []


def command_lines(block: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, split at && ; |."""
    text = re.sub(r"\\\n", " ", block)
    commands = []
    for line in text.splitlines():
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            tokens = list(lexer)
        except ValueError:  # an unbalanced quote in prose-like text: not a command
            continue
        current: list[str] = []
        for token in tokens:
            if token and set(token) <= set(";&|"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def _is_command(words: list[str]) -> bool:
    """Whether an inline code span reads as a command to type (not a fragment of prose)."""
    words = _strip_env(words)
    return bool(words) and (words[0] in ("skyrl-stepwise", "make", "pytest") or
                            (words[0] in PYTHONS and len(words) > 1 and
                             (words[1] == "-m" or words[1].endswith(".py"))))


def check_markdown(text: str, facts: Facts, where: str = "") -> list[str]:
    """Every stale command, key or path in one Markdown text, as `where: error` lines."""
    errors: list[str] = []
    prose = text
    for m in FENCE_RE.finditer(text):
        lang, block = m.group(2).lower(), m.group(3)
        prose = prose.replace(m.group(0), "\n" * m.group(0).count("\n"))
        if lang in SHELL_LANGS:
            for words in command_lines(block):
                errors += check_command(words, facts)
        if lang not in ("text", "") or any(_is_command(w) for w in command_lines(block)):
            errors += [e for p in PATH_RE.findall(block) for e in [check_path(p, facts)] if e]
    for m in INLINE_RE.finditer(prose):
        span = m.group(2).strip()
        words = command_lines(span)
        if words and _is_command(words[0]):
            errors += check_command(words[0], facts)
            continue
        override = OVERRIDE_RE.match(span.split(" ")[0])
        if override and override.group(2).split(".")[0] in facts.sections and "." in override.group(2):
            errors += check_overrides([span.split(" ")[0]], facts)
        elif DOTTED_RE.match(span):
            error = check_dotted(span, facts)
            if error:
                errors.append(error)
        elif PACKAGE_PATH_RE.match(span) and span.split("/")[0] not in REPO_DIRS:
            # a path inside the package (`inference/weights.py`): it must still be there
            if not (facts.root / "skyrl_stepwise" / span).exists() and not (facts.root / span).exists():
                errors.append(f"path {span}: no such file in skyrl_stepwise/ (write the path from the repo root)")
        elif KEY_SPAN_RE.match(span) and span.split(".")[0] in facts.sections and not span.endswith(FILE_EXTS):
            error = check_key(span.removesuffix(".*"), facts)
            if error:
                errors.append(error)
    for path in PATH_RE.findall(INLINE_RE.sub(lambda m: " " + m.group(2) + " ", prose)):
        error = check_path(path, facts)
        if error:
            errors.append(error)
    return [f"{where}: {e}" for e in dict.fromkeys(errors)]


def doc_files(root: Path = ROOT) -> list[Path]:
    """The Markdown a reader follows: README.md and the site's pages."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def check_docs(root: Path = ROOT, facts: Facts | None = None) -> list[str]:
    """Every stale command, key or path in README.md and docs/*.md."""
    facts = facts or load_facts(root)
    return [e for path in doc_files(root) for e in check_markdown(path.read_text(), facts, path.relative_to(root).as_posix())]


if __name__ == "__main__":
    problems = check_docs()
    print("\n".join(problems) or "docs: every command, key and path exists")
    sys.exit(1 if problems else 0)
