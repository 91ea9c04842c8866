"""Grading the agent cannot reach (issue 58): one API for every env that grades code (repo fixing, mini-swe-agent,
HumanEval, a user's own code env; docs/own-task.md).

Why: RL optimises whatever the grader pays. A grader that runs in the agent's sandbox, pastes the answer into its
own program, or asks the graded process for a verdict can be talked into paying (a patched `json.dumps`, a
`json.py` in the working dir, an object whose `==` is always true, a token read from the program's constants: each
one earned reward before this module). So:

- the expected values stay on the host and never enter any sandbox; a task is a list of `Call`s (module, function,
  plain-data arguments) and what each should give (`Case`), or a test function run ON THE HOST (`grade_check`);
- the calls run in a FRESH sandbox holding only the files the env hands over (`task_sources` takes a package's
  sources from the episode's working dir, nothing else): no process of the episode survives into it and no stray
  top-level module comes along;
- the grading program (grading_harness.py, ours, the same text every time) runs as `python3 -I -S -B`: no user
  site, no site-packages, no cwd on the path, no bytecode; the working dir is appended AFTER the standard library;
- each call's result leaves that process as a type-tagged plain value, never as a `==` evaluated inside it; the
  host compares it with the expected value, type included (`same`): an object that is not plain data fails;
- the score counts exactly the cases the task defines: a missing, duplicated, extra or unparseable result fails
  its case, and so does the whole run when it stops at a limit.

Suspected tampering (`reward/tamper_suspected`, 1 for the episode): the grading saw a value that is not plain data,
a result it did not ask for, a line it cannot read, a program that exited before its last line, or a change to
builtins / the grading program / a module loaded before the code under test; or the episode wrote a module where a
grader importing from the working dir would read it (`json.py`, `sitecustomize.py`, a `.pth`). A suspicion never
pays and never costs reward by itself: the reward is the cases.
"""

from __future__ import annotations

import ast
import builtins
import json
import logging
import random
import shlex
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from skyrl_stepwise.envs.base import TAMPER_METRIC
from skyrl_stepwise.envs.grading_harness import NotPlain, decode, encode
from skyrl_stepwise.sandbox import Limits, RunResult, SandboxMetrics, StopReason
from skyrl_stepwise.sandbox.backends import open_sandbox

logger = logging.getLogger(__name__)
GRADE_LIMITS = Limits(wall_s=20.0, cpu_s=10, memory_bytes=1 << 30, output_bytes=1 << 20)
HARNESS = (Path(__file__).with_name("grading_harness.py")).read_text()
GRADE_COMMAND = f"python3 -I -S -B -c {shlex.quote(HARNESS)}"
MAX_ROUNDS = 4  # grade_check: sandbox runs at most (a call whose argument is another call's result needs a round)
MAX_CHECK_CALLS = 10_000  # grade_check: candidate calls per pass, so a loop over a probe cannot run forever
GRADER_READS = ("sitecustomize.py", "usercustomize.py")
# what code reads to find a grader's secrets in its own process (a token among a frame's constants, a verdict in a
# caller's locals): graded code that names one of these is suspected, whatever it found
INTROSPECTION = ("_getframe", "f_back", "co_consts", "f_globals", "f_locals", "get_objects", "currentframe",
                 "inspect.stack", "import __main__")


@dataclass(frozen=True)
class Call:
    """One call the grading sandbox makes: `module.function(*args, **kwargs)`, arguments plain data only."""

    module: str
    function: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def request(self) -> dict[str, Any]:
        """The call as the grading program reads it (arguments type-tagged)."""
        return {"module": self.module, "function": self.function, "args": encode(list(self.args)),
                "kwargs": encode(dict(self.kwargs))}


@dataclass(frozen=True)
class Outcome:
    """What one call gave: kind "value" (plain data in `value`), "raised" (the exception's class name in
    `detail`), or a failure of the case: "bad" (not plain data), "missing", "duplicate"."""

    kind: str
    value: Any = None
    detail: str = ""


@dataclass(frozen=True)
class CallsRun:
    """One grading sandbox run: an outcome per call, in order, the suspicions it raised, and why it stopped."""

    outcomes: tuple[Outcome, ...]
    tamper: tuple[str, ...]
    stop_reason: StopReason


@dataclass(frozen=True)
class Raises:
    """An expected outcome that is an exception of this class name (e.g. Raises("ValueError"))."""

    name: str


@dataclass(frozen=True)
class Case:
    """A case of a task: a call and what it must give (a plain value, type included, or Raises). `group` lets a task
    pay per group of cases (repo fixing: one group per bug)."""

    call: Call
    expected: Any
    group: str = ""


@dataclass(frozen=True)
class Grade:
    """The verdict, computed on the host: each case passed or not, and every suspicion seen on the way."""

    passed: tuple[bool, ...]
    tamper: tuple[str, ...] = ()
    stop_reason: StopReason | None = None

    @property
    def tamper_suspected(self) -> bool:
        """Whether anything on the way looked like a forgery attempt (the reward is the cases either way)."""
        return bool(self.tamper)

    def metrics(self) -> dict[str, float]:
        """`reward/tamper_suspected` (0/1), the cases and those passed, and a non-exit stop of the grading run."""
        out = {TAMPER_METRIC: float(self.tamper_suspected), "grading/cases": float(len(self.passed)),
               "grading/cases_passed": float(sum(self.passed))}
        if self.stop_reason is not None and self.stop_reason is not StopReason.EXITED:
            out[f"grading/stop/{self.stop_reason.value}"] = 1.0
        return out

    def with_tamper(self, reasons: Sequence[str]) -> Grade:
        """The same verdict with the env's own suspicions added (e.g. task_sources' stray modules)."""
        return Grade(self.passed, self.tamper + tuple(reasons), self.stop_reason)

    def log_suspicions(self, instance_id: Any) -> None:
        """Name why an episode was suspected in the run's log (the metric is a number; the reasons are here)."""
        if self.tamper:
            logger.warning(f"grading: instance {instance_id!r} suspected of tampering: "
                           f"{'; '.join(self.tamper[:3])}{' ...' if len(self.tamper) > 3 else ''}")


# ------------------------------------------------------------------------------------------- the sandbox run

def run_calls(files: Mapping[str, str | bytes], calls: Sequence[Call], limits: Limits = GRADE_LIMITS,
              metrics: SandboxMetrics | None = None) -> CallsRun:
    """Make `calls` in a fresh sandbox holding exactly `files` (relative path -> content); blocking."""
    request = json.dumps({"calls": [c.request() for c in calls]})
    with open_sandbox(limits=limits, metrics=metrics) as sandbox:
        for path, content in files.items():
            sandbox.write_file(path, content)
        result = sandbox.run(GRADE_COMMAND, stdin=request, limits=limits)
    return parse_results(result, len(calls))


def parse_results(result: RunResult, n: int) -> CallsRun:
    """The outcome of each of the `n` calls from the grading program's lines; anything it did not ask for (an
    unreadable line, an index out of range or seen twice, a line after the end) is a suspicion and a seen-twice
    index fails its call."""
    outcomes: list[Outcome | None] = [None] * n
    tamper: list[str] = []
    ended = False
    for line in result.stdout.splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            tamper.append(f"an unreadable line in the grading output: {line[:80]!r}")
            continue
        if ended or not isinstance(message, dict):
            tamper.append(f"a line after the grading program's last: {line[:80]!r}")
        elif message.get("end") is True:
            ended = True
            changed = message.get("changed")
            if not isinstance(changed, list) or changed:
                tamper.append(f"the code under test changed {changed!r:.300}")
        else:
            _place(message, outcomes, tamper)
    if result.stop_reason is StopReason.EXITED and not ended:
        tamper.append("the grading program exited before its last line (an exit at import or in a call)")
    filled = tuple(o if o is not None else Outcome("missing") for o in outcomes)
    tamper += [f"call {k}: not plain data ({o.detail})" for k, o in enumerate(filled) if o.kind == "bad"]
    return CallsRun(filled, tuple(tamper), result.stop_reason)


def _place(message: dict, outcomes: list[Outcome | None], tamper: list[str]) -> None:
    """One result line into its slot."""
    k = message.get("i")
    if type(k) is not int or not 0 <= k < len(outcomes):
        tamper.append(f"a result for a call nobody made: {str(message)[:80]}")
        return
    if outcomes[k] is not None:
        tamper.append(f"call {k}: a second result")
        outcomes[k] = Outcome("duplicate")
        return
    try:
        outcomes[k] = _outcome(message)
    except (ValueError, TypeError, KeyError) as e:
        tamper.append(f"call {k}: an unreadable result ({e})")
        outcomes[k] = Outcome("bad", detail="unreadable")


def _outcome(message: dict) -> Outcome:
    if set(message) == {"i", "value"}:
        return Outcome("value", decode(message["value"]))
    if set(message) == {"i", "raised"} and isinstance(message["raised"], str):
        return Outcome("raised", detail=message["raised"])
    if set(message) == {"i", "bad"} and isinstance(message["bad"], str):
        return Outcome("bad", detail=message["bad"])
    raise ValueError(f"keys {sorted(message)}")


def same(got: Any, expected: Any) -> bool:
    """Plain values equal with their types: 1 is not True, 1.0 is not 1, a tuple is not a list (the tagged trees
    compare; a dict or set ignores order as `==` does, NaN equals NaN)."""
    try:
        return _canonical(encode(got)) == _canonical(encode(expected))
    except NotPlain:
        return False


def _canonical(tree: list) -> Any:
    tag = tree[0]
    if tag in ("list", "tuple"):
        return [tag, [_canonical(v) for v in tree[1]]]
    if tag in ("set", "frozenset", "dict"):
        items = [[_canonical(k), _canonical(v)] for k, v in tree[1]] if tag == "dict" else \
            [_canonical(v) for v in tree[1]]
        return [tag, sorted(items, key=json.dumps)]
    if tag == "float" and tree[1] == "-0.0":
        return ["float", "0.0"]
    return tree


def case_passes(case: Case, outcome: Outcome) -> bool:
    """The host's comparison: a value against the expected one (type included), an exception against Raises."""
    if isinstance(case.expected, Raises):
        return outcome.kind == "raised" and outcome.detail == case.expected.name
    return outcome.kind == "value" and same(outcome.value, case.expected)


def grade_cases(files: Mapping[str, str | bytes], cases: Sequence[Case], limits: Limits = GRADE_LIMITS,
                metrics: SandboxMetrics | None = None) -> Grade:
    """Every case of the task, one grading sandbox run; each passes only by its own result."""
    run = run_calls(files, [c.call for c in cases], limits, metrics)
    return Grade(tuple(case_passes(c, o) for c, o in zip(cases, run.outcomes)), run.tamper, run.stop_reason)


# ----------------------------------------------------------------------- a test function run on the host

class _Abort(BaseException):
    """Ends a pass of the check (a BaseException: the test's own `except Exception` cannot swallow it)."""


class _Probe:
    """The stand-in for a result not known yet: absorbs whatever the test does with it, so the pass goes on to
    find the next calls. A pass that met a probe never decides the verdict."""

    def __getattr__(self, name: str) -> _Probe:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _Probe:
        return self

    def _any(self, *args: Any) -> _Probe:
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _any
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = _any
    __getitem__ = __and__ = __or__ = __xor__ = __round__ = _any

    def _true(self, *args: Any) -> bool:
        return True

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = __bool__ = _true

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0

    def __hash__(self) -> int:
        return 0

    def __float__(self) -> float:
        return 0.0

    def __int__(self) -> int:
        return 0

    __index__ = __int__


class _Replay:
    """The candidate the host's test calls: the value the grading sandbox returned for these arguments, the
    exception it raised, or (not run yet) a probe, recording the arguments for the next sandbox run."""

    def __init__(self, known: dict[str, Outcome], pending: dict[str, tuple[tuple, dict]]) -> None:
        self.known, self.pending, self.calls = known, pending, 0
        self.consulted = 0  # the answer's outcomes met by the test (a value, its exception, a bad or missing one)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > MAX_CHECK_CALLS:
            raise _Abort(f"more than {MAX_CHECK_CALLS} calls")
        try:
            key = json.dumps(encode([list(args), kwargs]))
        except NotPlain as e:
            if any(isinstance(a, _Probe) for a in (*args, *kwargs.values())):
                return _Probe()  # an argument is a result still pending: this call waits for the next round
            raise _Abort(f"an argument that is not plain data ({e})") from None
        outcome = self.known.get(key)
        if outcome is None:
            self.pending.setdefault(key, (decode(encode(list(args))), decode(encode(kwargs))))
            return _Probe()
        self.consulted += 1
        if outcome.kind == "value":
            return decode(encode(outcome.value))  # a fresh copy each time: the test may mutate it
        if outcome.kind == "raised":
            cls = getattr(builtins, outcome.detail, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(f"{outcome.detail} raised in the grading sandbox")
            raise Exception(f"{outcome.detail} raised in the grading sandbox")
        raise _Abort(f"the call's result is {outcome.kind}")


def _test_builtins(seed: int) -> dict[str, Any]:
    """Builtins whose `import random` gives a private generator seeded the same on every pass (tests that draw
    unseeded inputs make the same calls on each pass; the process's own random state is untouched)."""
    rng = random.Random(seed)
    private = types.ModuleType("random")
    for name in dir(random):
        value = getattr(random, name)
        bound = getattr(value, "__self__", None) is getattr(random, "_inst", None)
        setattr(private, name, getattr(rng, name) if bound and callable(value) else value)

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "random" and level == 0:
            return private
        return builtins.__import__(name, globals, locals, fromlist, level)

    space = dict(vars(builtins))
    space["__import__"] = importer
    return space


class _AssertsAsExpressions(ast.NodeTransformer):
    """`assert test, msg` -> `test`: a probing pass evaluates every assertion's calls without stopping at one
    that a stand-in result fails (`assert not candidate(x)`, `... is True`)."""

    def visit_Assert(self, node: ast.Assert) -> ast.Expr:
        return ast.copy_location(ast.Expr(self.visit(node.test)), node)


def _compiled(source: str, name: str, probing: bool):
    tree = ast.parse(source, name)
    if probing:
        tree = ast.fix_missing_locations(_AssertsAsExpressions().visit(tree))
    return compile(tree, name, "exec")


class GradingError(RuntimeError):
    """The host's own pass of a test failed where the answer cannot have caused it, twice in a row: it raised
    before any result of the answer's reached it or any call was asked of it: only the task's code had run (a
    MemoryError there too). That is a broken task or a sick host, never a verdict: the env's step raises it, so the
    trajectory fails by cause and is never trained (generator/agent_loop.py), instead of paying a 0 nobody earned.
    After the answer's first result, any exception is a verdict: an answer must not dodge its 0 by making the
    host's test fail."""


class _HostFault(Exception):
    """A pass of the test failed on the host's side (see GradingError); `grade_check` runs the pass once more."""


def _pass(check_source: str, prelude: str, replay: _Replay, entry: str, function: str, probing: bool) -> bool:
    """One pass of the test on the host against the replay (the function's own name in the prelude is the replay
    too: a test may call it by name); True when `check(candidate)` finished. A probing pass skips the assertions'
    verdicts, to find every call at once. _HostFault where the failure cannot be the answer's."""
    namespace: dict[str, Any] = {"__name__": "__grading_check__", "__builtins__": _test_builtins(0)}
    try:
        exec(_compiled(prelude, "<task prelude>", False), namespace)  # noqa: S102 - the task's code, not the model's
        namespace[function.rsplit(".", 1)[-1]] = replay
        exec(_compiled(check_source, "<task test>", probing), namespace)  # noqa: S102
        namespace[entry](replay)
    except (Exception, _Abort) as e:
        if not replay.consulted and not replay.pending:  # nothing of the answer's met yet, nothing asked of it
            raise _HostFault(e) from e
        return False
    return True


def _host_pass(check_source: str, prelude: str, known: dict[str, Outcome], pending: dict[str, tuple[tuple, dict]],
               entry: str, function: str, probing: bool) -> bool:
    """`_pass`, run once more where the host failed it (the pass is deterministic: a second failure is the task's
    or the host's for good); GradingError, naming the cause, where it fails again."""
    try:
        return _pass(check_source, prelude, _Replay(known, pending), entry, function, probing)
    except _HostFault as fault:
        logger.warning(f"grading: the task's test {_fault(fault)} on the host; running the pass again")
    pending.clear()
    try:
        return _pass(check_source, prelude, _Replay(known, pending), entry, function, probing)
    except _HostFault as fault:
        raise GradingError(f"the task's test {_fault(fault)} on the host, twice (a broken task or a sick host, "
                           "not a verdict)") from fault.__cause__


def _fault(fault: _HostFault) -> str:
    return f"raised before calling the answer: {fault.__cause__!r}"


def grade_check(files: Mapping[str, str | bytes], module: str, function: str, check_source: str, prelude: str = "",
                entry: str = "check", limits: Limits = GRADE_LIMITS, metrics: SandboxMetrics | None = None) -> Grade:
    """A task whose test is a function `check(candidate)` (HumanEval's form). The test runs on the HOST, never near
    the model's code; `candidate` replays what `module.function` returned in the grading sandbox for the same
    arguments. A probing pass (assertions evaluated, not enforced) records the calls, their results stand-ins; the
    sandbox makes them; the next probing pass replays them and finds no new call, unless a later argument depends
    on an earlier result (another round, at most MAX_ROUNDS). Then the test runs for real, every result known. One
    case: passed when that run finishes."""
    known: dict[str, Outcome] = {}
    tamper: list[str] = []
    stop = None
    for _ in range(MAX_ROUNDS):
        pending: dict[str, tuple[tuple, dict]] = {}
        _host_pass(check_source, prelude, known, pending, entry, function, probing=True)
        if not pending:
            finished = _host_pass(check_source, prelude, known, pending, entry, function, probing=False)
            return Grade((finished and not pending,), tuple(tamper), stop)
        run = run_calls(files, [Call(module, function, tuple(a), k) for a, k in pending.values()], limits, metrics)
        known.update(zip(pending, run.outcomes))
        tamper += run.tamper
        stop = run.stop_reason
        if stop is not StopReason.EXITED:
            break
    return Grade((False,), tuple(tamper), stop)


# ------------------------------------------------------------------- what the grading sandbox starts from

def task_sources(sandbox, roots: Sequence[str], max_bytes: int = 16 << 20) -> tuple[dict[str, bytes], list[str]]:
    """The Python sources under the task's own top-level dirs (`roots`, e.g. the package) as the episode left them,
    and the suspicions the episode's working dir raises. Everything else stays behind: a top-level module, a
    `.pth`, bytecode, a symlink."""
    with tempfile.TemporaryDirectory(prefix="skyrl-grading-") as tmp:
        copied = sandbox.export(Path(tmp), max_bytes)
        files = {}
        for rel in copied:
            parts = Path(rel).parts
            if parts[0] in roots and rel.endswith(".py") and "__pycache__" not in parts:
                files[rel] = (Path(tmp) / rel).read_bytes()
    return files, stray_modules(copied)


def introspection(files: Mapping[str, str | bytes]) -> list[str]:
    """Graded sources that read their own process's frames or the grading program's module (INTROSPECTION)."""
    found = []
    for path, content in sorted(files.items()):
        text = content.decode("utf-8", "replace") if isinstance(content, bytes) else content
        names = [n for n in INTROSPECTION if n in text]
        if names:
            found.append(f"{path} reads the grading process itself ({', '.join(names)})")
    return found


def stray_modules(paths: Sequence[str]) -> list[str]:
    """Files the episode wrote where a grader that imports from the working dir would read them: a top-level
    module or package named like a standard-library module, a site hook, a `.pth`."""
    found = []
    for rel in paths:
        parts = Path(rel).parts
        name = parts[-1]
        top = Path(parts[0]).stem
        if name in GRADER_READS or name.endswith(".pth"):
            found.append(f"the episode wrote {rel} (a hook an interpreter reads at start-up)")
        elif top in sys.stdlib_module_names and (len(parts) == 1 and name.endswith(".py") or
                                                 len(parts) == 2 and name == "__init__.py"):
            found.append(f"the episode wrote {rel}, which shadows the standard library's `{top}` for a grader "
                         "that imports from the working dir")
    return found
