"""A CPU-sized repo-fixing task set (env class `repo_fix`, envs/repo_fix.py), generated deterministically from a seed.

Each task is a small Python package (2-4 modules out of: string utils, arithmetic, list ops, a tiny config parser;
a few functions each) with injected bugs (off-by-one, wrong operator, swapped arguments, wrong default, missing
edge case), a visible test file that fails (plain `assert`s run by `python3 test_x.py`: no pytest in the sandbox)
and hidden cases (calls and their expected values, graded on the host by envs/grading.py), in groups: `bug<k>` per
bug plus `regression` over the functions no bug touches.
Difficulty: 1, the bug is in the function the failing test names; 2, it is in the helper that function calls
(the test never names it); 3, two bugs in two modules.

Held-out split: the bug sites in HELD_OUT_SITES appear only in validation tasks (a validation task has at least
one), train tasks only use the others, so validation measures fixing bugs never seen in training.

SFT demonstrations (train tasks only) are played through the real RepoFixEnv, so every tool output in them is the
sandbox's own, byte for byte, and each one is checked to earn reward 1: run the test, view the module, edit the
buggy line back, run the test again, answer.

`skyrl-stepwise data repo-fix --out DIR` writes DIR/train.parquet, DIR/validation.parquet and DIR/demos.parquet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_CLASS = "repo_fix"
SYSTEM_PROMPT = (
    "You are a careful software engineer working in a small Python repository. Tools: `bash` runs a shell command "
    "in the repository, `view` shows a file with line numbers, `edit` replaces an exact piece of text in a file. "
    "Find and fix the bug in the package (never change the tests), check that the test passes, then answer "
    "without a tool call in one line saying what you fixed."
)


@dataclass(frozen=True)
class Bug:
    """One injectable bug: the correct text in the function's module and what it becomes."""

    kind: str  # off-by-one | wrong operator | swapped args | wrong default | missing edge case
    correct: str
    buggy: str


@dataclass(frozen=True)
class Function:
    """A function of a module template: its cases (Python expressions; expected values come from the correct
    code), its bugs, and the helper it calls (a bug there is one call away)."""

    name: str
    visible: tuple[str, ...]
    hidden: tuple[str, ...]
    bugs: tuple[Bug, ...] = ()
    calls: str | None = None


@dataclass(frozen=True)
class Module:
    """A module template: its source (correct) and its functions."""

    name: str
    source: str
    functions: tuple[Function, ...]


MODULES: tuple[Module, ...] = (
    Module("strings", '''"""String helpers."""


def normalize(text):
    """Lower-case text and collapse runs of whitespace into one space."""
    return " ".join(text.lower().split())


def slugify(text):
    """A URL slug: the normalized words joined by '-'."""
    return normalize(text).replace(" ", "-")


def truncate(text, width, suffix="..."):
    """text cut to at most width characters, ending in suffix when it was cut."""
    if len(text) <= width:
        return text
    return text[:width - len(suffix)] + suffix


def count_vowels(text):
    """How many of the letters a, e, i, o, u (either case) text holds."""
    return sum(1 for ch in text.lower() if ch in "aeiou")
''', (
        Function("normalize", (r'normalize("  Hello   World ")',),
                 (r'normalize("A\tb  C")', r'normalize("x")', r'normalize("Two  spaces")'),
                 (Bug("missing edge case", 'text.lower().split())', 'text.lower().split(" "))'),)),
        Function("slugify", (r'slugify("Hello World")', r'slugify("  Many   Spaces here ")'),
                 (r'slugify("A  B")', r'slugify("One")', r'slugify("Tab\tSeparated  Words")'),
                 (Bug("swapped args", '.replace(" ", "-")', '.replace("-", " ")'),), calls="normalize"),
        Function("truncate", (r'truncate("hello world", 8)', r'truncate("hello", 5)', r'truncate("hi", 10)'),
                 (r'truncate("abcdef", 6)', r'truncate("abcdefgh", 6)', r'truncate("abcdefgh", 5, suffix="!")'),
                 (Bug("off-by-one", "if len(text) <= width:", "if len(text) < width:"),
                  Bug("wrong default", 'suffix="...")', 'suffix="..")'))),
        Function("count_vowels", (r'count_vowels("banana")', r'count_vowels("AEIOU")'),
                 (r'count_vowels("Education")', r'count_vowels("xyz")', r'count_vowels("OpenAI")'),
                 (Bug("missing edge case", "for ch in text.lower() if", "for ch in text if"),)),
    )),
    Module("mathx", '''"""Arithmetic helpers."""


def clamp(value, low, high):
    """value limited to the range [low, high]."""
    return max(low, min(value, high))


def mean(values):
    """The arithmetic mean of values; 0.0 for an empty list."""
    if not values:
        return 0.0
    return sum(values) / len(values)


def percent(part, whole):
    """part as a percentage of whole, rounded to one decimal."""
    return round(100 * part / whole, 1)


def shares(values):
    """Each value's percentage of the total."""
    total = sum(values)
    return [percent(v, total) for v in values]
''', (
        Function("clamp", (r'clamp(5, 0, 10)', r'clamp(-3, 0, 10)', r'clamp(12, 0, 10)'),
                 (r'clamp(7, 1, 9)', r'clamp(0, 1, 9)', r'clamp(10, 1, 9)'),
                 (Bug("swapped args", "max(low, min(value, high))", "max(high, min(value, low))"),)),
        Function("mean", (r'mean([1, 2, 3, 4])', r'mean([])'),
                 (r'mean([5])', r'mean([1, 2])', r'mean([])', r'mean([2, 4, 9])'),
                 (Bug("off-by-one", "sum(values) / len(values)", "sum(values) / (len(values) + 1)"),
                  Bug("wrong operator", "sum(values) / len(values)", "sum(values) // len(values)"),
                  Bug("missing edge case", "    if not values:\n        return 0.0\n    return sum(values)",
                      "    return sum(values)"))),
        Function("percent", (r'percent(1, 4)', r'percent(3, 3)'),
                 (r'percent(1, 3)', r'percent(2, 8)', r'percent(5, 10)'),
                 (Bug("swapped args", "100 * part / whole", "100 * whole / part"),)),
        Function("shares", (r'shares([1, 1, 2])',), (r'shares([3, 1])', r'shares([5])'), calls="percent"),
    )),
    Module("lists", '''"""List helpers."""


def chunk(items, size):
    """items split into consecutive lists of size items (the last one may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]


def page_count(items, size):
    """How many pages of size items it takes to show every item."""
    return len(chunk(items, size))


def last(items, n=1):
    """The last n items (the last one by default)."""
    return items[len(items) - n:]


def window_sums(items, k):
    """The sum of every run of k consecutive items."""
    return [sum(items[i:i + k]) for i in range(len(items) - k + 1)]
''', (
        Function("chunk", (r'chunk([1, 2, 3, 4, 5], 2)', r'chunk([1, 2, 3], 3)'),
                 (r'chunk([1, 2, 3, 4, 5, 6, 7], 3)', r'chunk([], 2)', r'chunk([1], 1)'),
                 (Bug("off-by-one", "range(0, len(items), size)", "range(0, len(items) - 1, size)"),)),
        Function("page_count", (r'page_count([1, 2, 3, 4, 5], 2)', r'page_count(list(range(10)), 5)'),
                 (r'page_count([1, 2, 3], 2)', r'page_count([1], 1)'), calls="chunk"),
        Function("last", (r'last([1, 2, 3])', r'last([1, 2, 3], 2)'),
                 (r'last(["a", "b"])', r'last([4, 5, 6, 7], 3)', r'last([9])'),
                 (Bug("wrong default", "def last(items, n=1):", "def last(items, n=2):"),
                  Bug("off-by-one", "items[len(items) - n:]", "items[len(items) - n - 1:]"))),
        Function("window_sums", (r'window_sums([1, 2, 3, 4], 2)',),
                 (r'window_sums([5, 5, 5], 3)', r'window_sums([1, 2, 3], 1)'),
                 (Bug("off-by-one", "range(len(items) - k + 1)", "range(len(items) - k)"),)),
    )),
    Module("parser", '''"""A tiny config parser."""


def parse_pair(text, sep="="):
    """'key = value' -> ('key', 'value'): split at the first sep, spaces stripped."""
    key, _, value = text.partition(sep)
    return key.strip(), value.strip()


def parse_config(text):
    """'key = value' lines -> a dict; blank lines and '#' comments are skipped."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = parse_pair(line)
        out[key] = value
    return out


def parse_ints(text):
    """'1, 2,3' -> [1, 2, 3]; empty items are skipped."""
    return [int(tok) for tok in text.split(",") if tok.strip()]
''', (
        Function("parse_pair", (r'parse_pair("name = Ada")', r'parse_pair("url=http://x?a=b")'),
                 (r'parse_pair("a = b = c")', r'parse_pair("k:v", sep=":")', r'parse_pair("x=1")'),
                 (Bug("wrong operator", "text.partition(sep)", "text.rpartition(sep)"),
                  Bug("wrong default", 'def parse_pair(text, sep="="):', 'def parse_pair(text, sep=":"):'),
                  Bug("swapped args", "return key.strip(), value.strip()", "return value.strip(), key.strip()"))),
        Function("parse_config", (r'parse_config("a = 1\n# note\n\nb=2")', r'parse_config("url = http://x?q=1")'),
                 (r'parse_config("# only a comment")', r'parse_config("x = y\n  # indented\nz=w")',
                  r'parse_config("")'),
                 (Bug("missing edge case", 'if not line or line.startswith("#"):', "if not line:"),),
                 calls="parse_pair"),
        Function("parse_ints", (r'parse_ints("1, 2,3")', r'parse_ints("4,,5,")'),
                 (r'parse_ints("")', r'parse_ints(" 7 ")', r'parse_ints("1,2,,")'),
                 (Bug("missing edge case", ' for tok in text.split(",") if tok.strip()]',
                      ' for tok in text.split(",")]'),)),
    )),
)
MODULES_BY_NAME = {m.name: m for m in MODULES}
# bug sites "module.function.k" only validation tasks use (one is a helper's, so level 2 is held out too)
HELD_OUT_SITES = frozenset({"strings.truncate.0", "mathx.mean.2", "lists.last.1", "parser.parse_pair.1",
                            "parser.parse_ints.0"})
PACKAGE_WORDS = ("toolkit", "utilkit", "helpers", "common", "corelib", "basics", "smalllib", "tinyutils")


@dataclass(frozen=True)
class Site:
    """One bug at one function: `module.function.k`."""

    module: str
    function: str
    index: int

    @property
    def id(self) -> str:
        return f"{self.module}.{self.function}.{self.index}"

    @property
    def bug(self) -> Bug:
        return function_of(self.module, self.function).bugs[self.index]


def function_of(module: str, name: str) -> Function:
    """A module template's function by name."""
    return next(f for f in MODULES_BY_NAME[module].functions if f.name == name)


def all_sites() -> list[Site]:
    """Every bug site, in template order."""
    return [Site(m.name, f.name, k) for m in MODULES for f in m.functions for k in range(len(f.bugs))]


def callers_of(module: str, name: str) -> list[str]:
    """The functions of `module` that call `name` (a bug in `name` is one call away from them)."""
    return [f.name for f in MODULES_BY_NAME[module].functions if f.calls == name]


def affected(module: str, site: Site) -> set[str]:
    """The functions of `module` whose behaviour a bug at `site` changes: its own and its callers'."""
    return {site.function, *callers_of(site.module, site.function)} if module == site.module else set()


# --------------------------------------------------------------------------------------------------- the task

@dataclass
class Task:
    """A generated task: files as the model finds them, the hidden cases, the fix."""

    instance_id: str
    package: str
    difficulty: int
    sites: list[Site]
    test_file: str
    files: dict[str, str]
    cases: list[dict[str, str]]
    split: str

    def fix(self) -> list[dict[str, str]]:
        """The demonstration's edits: each buggy text back to the correct one, in its module's file."""
        return [{"path": f"{self.package}/{s.module}.py", "old": s.bug.buggy, "new": s.bug.correct}
                for s in self.sites]

    def row(self) -> dict[str, Any]:
        """The task as a dataset row: files and hidden cases in reward_spec (the prompt shows neither)."""
        command = f"python3 {self.test_file}"
        user = (f"The package `{self.package}` has a bug: `{command}` fails. Fix the package so that the test "
                f"passes.")
        return {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
            "env_class": ENV_CLASS,
            "reward_spec": {"files": [{"path": p, "content": c} for p, c in sorted(self.files.items())],
                            "cases": self.cases, "test_command": command},
            "data_source": "repo_fix",
            "extra_info": {"split": self.split, "difficulty": self.difficulty, "package": self.package,
                           "bugs": [{"site": s.id, "kind": s.bug.kind} for s in self.sites],
                           "fix": self.fix()},
            "instance_id": self.instance_id,
        }


def _namespace(source: str) -> dict[str, Any]:
    """The module's functions, for computing expected values from the correct code (our own templates)."""
    namespace: dict[str, Any] = {}
    exec(compile(source, "<template>", "exec"), namespace)  # noqa: S102 - our own template source, not model code
    return namespace


def _outcome(namespace: dict[str, Any], expr: str) -> Any:
    """What `expr` gives (or the exception type it raises)."""
    try:
        return ("value", eval(expr, dict(namespace)))  # noqa: S307 - our own test cases
    except Exception as e:  # a bug may make a case raise
        return ("raises", type(e).__name__)


def inject(module: Module, sites: list[Site]) -> str:
    """The module's source with the bugs of `sites` in it; each correct text must occur once, each buggy text
    must then occur once (so the demonstration's edit is unambiguous)."""
    source = module.source
    for site in sites:
        bug = site.bug
        if source.count(bug.correct) != 1:
            raise ValueError(f"bug site {site.id}: its correct text occurs {source.count(bug.correct)} times")
        source = source.replace(bug.correct, bug.buggy)
        if source.count(bug.buggy) != 1:
            raise ValueError(f"bug site {site.id}: its buggy text occurs {source.count(bug.buggy)} times")
    return source


def _check_line(expr: str, want: Any, indent: str = "    ") -> str:
    """One visible assertion."""
    return f"{indent}check({expr!r}, {expr}, {want!r})\n"


CHECK_DEF = ('def check(expr, got, want):\n    assert got == want, f"{expr} returned {got!r}, expected {want!r}"'
             "\n")


def test_file_source(package: str, tested: list[tuple[str, Function]], expected: dict[str, Any]) -> str:
    """The visible test: `test_<function>` per tested function, run in order by `python3 test_x.py`."""
    imports = {}
    for module, fn in tested:
        imports.setdefault(module, []).append(fn.name)
    lines = [f'"""Tests of {package}: run `python3 <this file>`."""\n']
    lines += [f"from {package}.{m} import {', '.join(names)}\n" for m, names in imports.items()]
    lines += ["\n\n", CHECK_DEF]
    for module, fn in tested:
        lines.append(f"\n\ndef test_{fn.name}():\n")
        lines += [_check_line(e, expected[e]) for e in fn.visible]
    lines.append('\n\nif __name__ == "__main__":\n')
    lines += [f"    test_{fn.name}()\n" for _, fn in tested]
    lines.append('    print("all tests passed")\n')
    return "".join(lines)


def hidden_cases(package: str, groups: dict[str, list[tuple[str, str]]], expected: dict[str, Any]) -> list[dict]:
    """The hidden tests as grading cases (envs/grading.py), one per (module, expression) of each group: the call's
    module, function and arguments (evaluated here, from our own template expressions), and the expected value.
    Arguments and expected values are type-tagged JSON (a parquet column holds one type); the expected values never
    leave the host: the grading sandbox gets the calls only."""
    from skyrl_stepwise.envs.grading_harness import encode

    cases = []
    for group, exprs in groups.items():
        for module, expr in exprs:
            function, args, kwargs = _split_call(expr)
            cases.append({"group": group, "module": f"{package}.{module}", "function": function,
                          "args": json.dumps(encode(list(args))), "kwargs": json.dumps(encode(kwargs)),
                          "expected": json.dumps(encode(expected[expr])), "expr": expr})
    return cases


def _split_call(expr: str) -> tuple[str, tuple, dict]:
    """`f(x, y=1)` -> ("f", (x,), {"y": 1}), the arguments evaluated (our own template cases)."""
    head, paren, rest = expr.partition("(")
    args, kwargs = eval(f"(lambda *a, **k: (a, k)){paren}{rest}", {})  # noqa: S307 - our own test cases
    return head, args, kwargs


def _sample_sites(rng: random.Random, difficulty: int, split: str) -> list[Site]:
    """The bug sites of one task: from the train sites, or (validation) with at least one held-out site."""
    sites = all_sites()
    pool = [s for s in sites if (s.id in HELD_OUT_SITES) == (split == "validation")]
    if difficulty == 1:
        return [rng.choice(pool)]
    if difficulty == 2:
        return [rng.choice([s for s in pool if callers_of(s.module, s.function)])]
    first = rng.choice(pool)
    others = [s for s in (sites if split == "validation" else pool) if s.module != first.module]
    return sorted([first, rng.choice(others)], key=lambda s: s.id)


def make_task(seed: int, split: str, index: int) -> Task:
    """Task `index` of `split`: a pure function of (seed, split, index)."""
    rng = random.Random(f"repo_fix:{seed}:{split}:{index}")
    difficulty = index % 3 + 1
    sites = _sample_sites(rng, difficulty, split)
    bug_modules = sorted({s.module for s in sites})
    extra = [m.name for m in MODULES if m.name not in bug_modules]
    rng.shuffle(extra)
    modules = sorted(bug_modules + extra[:rng.randint(max(0, 2 - len(bug_modules)), 4 - len(bug_modules))])
    package = f"{rng.choice(PACKAGE_WORDS)}{rng.randint(1, 99)}"
    files = {f"{package}/__init__.py": f'"""{package}: {", ".join(modules)}."""\n'}
    expected: dict[str, Any] = {}
    for name in modules:
        module = MODULES_BY_NAME[name]
        files[f"{package}/{name}.py"] = inject(module, [s for s in sites if s.module == name])
        correct, buggy = _namespace(module.source), _namespace(files[f"{package}/{name}.py"])
        for fn in module.functions:
            for expr in fn.visible + fn.hidden:
                outcome = _outcome(correct, expr)
                if outcome[0] != "value":
                    raise ValueError(f"template case {expr!r} of {name}.{fn.name} raises on the correct code")
                expected[expr] = outcome[1]
        for s in sites:
            if s.module == name:
                _check_caught(s, correct, buggy)
    # the visible test: the buggy function (level 1, 3) or its caller (level 2), plus one untouched function
    tested: list[tuple[str, Function]] = []
    for s in sites:
        target = rng.choice(callers_of(s.module, s.function)) if difficulty == 2 else s.function
        tested.append((s.module, function_of(s.module, target)))
    if difficulty < 3:
        module = sites[0].module
        spare = [f for f in MODULES_BY_NAME[module].functions if f.name not in affected(module, sites[0])]
        tested.insert(rng.randrange(2), (module, rng.choice(spare)))
    test_file = f"test_{sites[0].module}.py" if len(bug_modules) == 1 else f"test_{package}.py"
    files[test_file] = test_file_source(package, tested, expected)
    groups: dict[str, list[tuple[str, str]]] = {}
    for k, s in enumerate(sites):
        names = [s.function, *callers_of(s.module, s.function)]
        groups[f"bug{k}"] = [(s.module, e) for n in names for e in function_of(s.module, n).hidden]
    groups["regression"] = [(m, e) for m in modules for f in MODULES_BY_NAME[m].functions
                            if not any(f.name in affected(m, s) for s in sites) for e in f.hidden]
    split_tag = "val" if split == "validation" else split
    return Task(f"repo_fix-{split_tag}-{index:04d}", package, difficulty, sites, test_file, files,
                hidden_cases(package, groups, expected), split)


def _check_caught(site: Site, correct: dict[str, Any], buggy: dict[str, Any]) -> None:
    """A bug must change a visible case of every function a test may name for it (its own, its callers') and a
    hidden case of its group, else the task would be unnoticeable or free to pass (a generator defect)."""
    def noticed(exprs: tuple[str, ...]) -> bool:
        return any(_outcome(correct, e) != _outcome(buggy, e) for e in exprs)

    names = [site.function, *callers_of(site.module, site.function)]
    for name in names:
        if not noticed(function_of(site.module, name).visible):
            raise ValueError(f"bug site {site.id}: no visible case of {name} notices it")
    if not noticed(tuple(e for n in names for e in function_of(site.module, n).hidden)):
        raise ValueError(f"bug site {site.id}: no hidden case of {names} notices it")


def repo_fix_tasks(split: str, n: int, seed: int = 0) -> list[Task]:
    """`n` tasks of `split` ("train" or "validation"), difficulties 1, 2, 3 in turn."""
    if split not in ("train", "validation"):
        raise ValueError(f"repo-fix split must be 'train' or 'validation', got {split!r}")
    if n < 0:
        raise ValueError(f"repo-fix task count must be >= 0, got {n}")
    return [make_task(seed, split, i) for i in range(n)]


# -------------------------------------------------------------------------------------------- demonstrations

def demo_turns(task: Task) -> list[tuple[str, dict[str, Any] | None]]:
    """The correct sequence: (assistant content, tool call or None for the answer)."""
    command = f"python3 {task.test_file}"
    turns: list[tuple[str, dict[str, Any] | None]] = [
        ("I will run the failing test first.", {"name": "bash", "arguments": {"command": command}})]
    for s, edit in zip(task.sites, task.fix()):
        turns.append((f"The failure points to `{s.module}.py`; let me read it.",
                      {"name": "view", "arguments": {"path": edit["path"]}}))
        turns.append((f"`{s.function}` has a {s.bug.kind} bug; I will fix it.",
                      {"name": "edit", "arguments": edit}))
    turns.append(("Now the test again.", {"name": "bash", "arguments": {"command": command}}))
    fixed = "; ".join(f"{s.bug.kind} in `{s.function}` ({s.module}.py)" for s in task.sites)
    turns.append((f"Fixed the {fixed}. The test passes.", None))
    return turns


async def play_demo(task: Task) -> dict[str, Any]:
    """One demonstration, stepped through the real RepoFixEnv: its tool outputs, its reward."""
    from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest
    from skyrl_stepwise.envs.repo_fix import RepoFixEnv

    row = task.row()
    env = RepoFixEnv()
    try:
        messages = await env.reset(row["prompt"], {**row, "max_turns": RepoFixEnv.max_turns_default})
        step = None
        for k, (content, call) in enumerate(demo_turns(task)):
            if call is None:
                step = await env.step_turn(ParsedTurn(content))
                messages.append({"role": "assistant", "content": content})
                break
            call_id = f"call_{k}"
            step = await env.step_turn(ParsedTurn(content, tool_calls=[
                ToolCallRequest(call["name"], call["arguments"], id=call_id)]))
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"type": "function", "id": call_id,
                 "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]})
            messages += step.observations
    finally:
        await env.aclose()
    if step is None or not step.done or step.reward != 1.0:
        raise RuntimeError(f"demonstration of {task.instance_id} did not earn reward 1 "
                           f"(reward {None if step is None else step.reward}, metrics "
                           f"{None if step is None else step.metrics})")
    return {"messages": messages, "instance_id": task.instance_id, "difficulty": task.difficulty,
            "reward": step.reward}


def build_demos(tasks: list[Task]) -> list[dict[str, Any]]:
    """Demonstrations of train tasks only (a validation task is refused: it must stay held out)."""
    held = [t.instance_id for t in tasks if t.split != "train"]
    if held:
        raise ValueError(f"demonstrations must come from train tasks only, got {held[:3]}")

    async def play_all() -> list[dict[str, Any]]:
        return [await play_demo(t) for t in tasks]

    return asyncio.run(play_all())


def write_task_set(out: str | Path, train: int, validation: int, demos: int, seed: int = 0) -> dict[str, Path]:
    """DIR/train.parquet, DIR/validation.parquet and DIR/demos.parquet (the first `demos` train tasks)."""
    from skyrl_stepwise.data.dataset import write_parquet

    out = Path(out)
    train_tasks = repo_fix_tasks("train", train, seed)
    paths = {"train": out / "train.parquet", "validation": out / "validation.parquet", "demos": out / "demos.parquet"}
    write_parquet([t.row() for t in train_tasks], paths["train"])
    write_parquet([t.row() for t in repo_fix_tasks("validation", validation, seed)], paths["validation"])
    write_parquet(build_demos(train_tasks[:demos]), paths["demos"])
    return paths


def main(argv: list[str] | None = None) -> int:
    """`skyrl-stepwise data repo-fix --out DIR [--train N] [--validation N] [--demos N] [--seed S]`."""
    from skyrl_stepwise.data.dataset import load_prompt_dataset
    from skyrl_stepwise.data.demonstrations import load_conversations

    parser = argparse.ArgumentParser(prog="skyrl-stepwise data repo-fix", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="repo_fix", help="output folder")
    parser.add_argument("--train", type=int, default=96, help="train tasks")
    parser.add_argument("--validation", type=int, default=48, help="validation tasks (held-out bug sites)")
    parser.add_argument("--demos", type=int, default=64, help="SFT demonstrations (the first N train tasks)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.demos > args.train:
        parser.error(f"--demos {args.demos} > --train {args.train}: demonstrations come from train tasks")
    paths = write_task_set(args.out, args.train, args.validation, args.demos, args.seed)
    for split in ("train", "validation"):
        print(f"{paths[split]}: {len(load_prompt_dataset(paths[split]))} rows")
    print(f"{paths['demos']}: {len(load_conversations(paths['demos']))} demonstrations (each reward 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
