"""Scoring without running the answer (envs/inert.py): reasoning-gym scorers that `eval` the answer, or hand it to
sympy, never run the policy's code in the trainer; right answers still score in full; the partial credit for an
answer that merely contains the expected one is not paid. The attacks are the ones that earned reward before."""

from __future__ import annotations

import asyncio

import pytest

import skyrl_stepwise.envs.reasoning_gym as rg_env
from skyrl_stepwise.data.dataset import PromptRow
from skyrl_stepwise.data.reasoning_gym import TaskSpec, decode_entry, task_rows
from skyrl_stepwise.envs.inert import AnswerIsCode, inert_scoring, why_not_inert
from skyrl_stepwise.envs.reasoning_gym import ReasoningGymEnv


def _row(task: str, index: int = 0, seed: int = 0) -> dict:
    return task_rows(TaskSpec(task, index + 1, seed))[index]


def _play(row: dict, answer: str):
    async def play():
        extras = PromptRow(prompt=row["prompt"], env_class=row["env_class"], reward_spec=row["reward_spec"],
                           data_source=row["data_source"], instance_id=row["instance_id"]).env_extras()
        env = ReasoningGymEnv()
        await env.reset(row["prompt"], extras)
        return await env.step(f"<answer>{answer}</answer>")
    return asyncio.run(play())


@pytest.mark.parametrize("source, why", [
    ("[1, 2, 3]", None), ("x**2 + 3*x", None), ("[['_', 'Q'], ['Q', '_']]", None), ("'abc'", None),
    ("Symbol ('x' )**Integer (2 )+Float ('0.5' )", None), ("(-2*x - 8)**(Integer (3 )/Integer (2 ))", None),
    ("1 2 3", None),  # not Python: its compile fails, nothing runs
    ("__import__('os').getpid()", "a call to"), ("().__class__", "Attribute"), ("x[0]", "Subscript"),
    ("len('abc')", "a call to 'len'"), ("sin('__import__(1)')", "a string passed to 'sin'"),
    ("lambda: 1", "Lambda"), ("[c for c in 'ab']", "ListComp"), ("_x", "the name '_x'"), ("x = 1", "statements"),
    ("9**9**9**9", "an exponent"), ("((9**1000)**1000)**1000", "multiply past"), ("1 << 10**9", "exponent"),
    ("[0] * 10**8", "a repeated sequence"), ("'a' * 10**9", "a repeated sequence"), ("x" * 10_001, "longer than"),
])
def test_only_inert_data_passes(source, why):
    got = why_not_inert(source)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_code_compiled_while_scoring_never_runs_and_the_gate_is_idle_outside(tmp_path):
    canary = tmp_path / "ran"
    code = f"open({str(canary)!r}, 'w')"
    with inert_scoring() as gate:
        with pytest.raises(AnswerIsCode, match="the answer is code"):
            eval(code)
        with pytest.raises(AnswerIsCode):
            exec(code)
        assert eval("[1, 2] + [3]") == [1, 2, 3]  # data compiles and evaluates as before
        from collections import namedtuple
        assert namedtuple("Made", "a b")(1, 2).b == 2  # the standard library's own code generation is not an answer
    assert not canary.exists() and len(gate.refused) == 2
    eval(code)  # outside scoring nothing is gated
    assert canary.exists()


@pytest.mark.parametrize("attack", [
    # rewrote the env's scorer lookup in the trainer: every later episode paid 1.0
    "[setattr(__import__('skyrl_stepwise.envs.reasoning_gym',fromlist=['_']),'_scorer',lambda t:(lambda a,e:1.0)),'x'][1]",
    # read the expected answer out of the scorer's frame
    "__import__('sys')._getframe(1).f_locals['oracle_answer']",
])
def test_an_answer_that_is_code_pays_nothing_and_changes_nothing(attack):
    row = _row("string_insertion")
    scorer = rg_env._scorer
    result = _play(row, attack)
    assert result.reward == 0.0 and result.metrics["reasoning_gym_refused"] == 1.0
    assert rg_env._scorer is scorer
    later = _row("basic_arithmetic")
    assert _play(later, "banana").reward == 0.0
    right = decode_entry(row["reward_spec"]["entry"])["answer"]
    assert _play(row, right).reward == 1.0 and _play(row, right).metrics["reasoning_gym_refused"] == 0.0


def test_sympy_scored_tasks_refuse_code_and_pay_right_answers(tmp_path):
    """countdown hands the answer to sympy's parse_expr (an eval): a digit-free `len('xxx...')` made the target and
    was paid 1.0; it is code, refused. The task's own answer still scores in full."""
    row = _row("countdown")
    entry = decode_entry(row["reward_spec"]["entry"])
    numbers, target = entry["metadata"]["numbers"], entry["metadata"]["target"]
    attack = f"({'+'.join(map(str, numbers))})*(pi-pi)+len('{'x' * target}')"
    result = _play(row, attack)
    assert result.reward == 0.0 and result.metrics["reasoning_gym_refused"] == 1.0
    assert _play(row, entry["answer"]).reward == 1.0
    slow = _play(row, "9**9**9**9")  # would never finish
    assert slow.reward == 0.0 and slow.metrics["reasoning_gym_refused"] == 1.0


def test_containing_the_answer_is_not_partial_credit():
    """reasoning-gym's default scorer paid len(expected) / len(answer) for any answer containing the expected one:
    '31' for 3 earned 0.5, and '12131' 0.4 whichever of 12, 21, 13, 31 was right, more than any one guess."""
    row = _row("basic_arithmetic")
    expected = str(decode_entry(row["reward_spec"]["entry"])["answer"])
    assert _play(row, expected).reward == 1.0
    for hedge in (expected + "1", "1" + expected, f"{expected} or {int(expected) + 1}"):
        assert _play(row, hedge).reward == 0.0, hedge


def test_a_task_the_gate_would_underpay_is_refused_when_built(monkeypatch):
    """intermediate_integration's own answers can hold an unevaluated Integral(...): were that call not inert, the
    gate would pay its right answers 0, so building its rows fails naming the task and the call."""
    import skyrl_stepwise.envs.inert as inert

    monkeypatch.setattr(inert, "MATH_CALLS", inert.MATH_CALLS - {"Integral"})
    with pytest.raises(ValueError, match=r"task 'intermediate_integration': entry 5's own answer scores 1.0, but 0.0 "
                                         r"as the env scores it \(its scorer compiles a call to 'Integral'\)"):
        task_rows(TaskSpec("intermediate_integration", 6, 0))


def test_an_arithmetic_answer_must_use_the_puzzles_numbers():
    """puzzle24's scorer checked that four numbers 1-10 make 24, not that they were the puzzle's: `4*6*1*1` was paid
    1.0 on every puzzle. countdown read the numbers used from the answer's digits."""
    for index in range(6):
        row = _row("puzzle24", index)
        entry = decode_entry(row["reward_spec"]["entry"])
        assert _play(row, entry["answer"]).reward == 1.0
        if sorted(entry["metadata"]["numbers"]) != [1, 1, 4, 6]:
            assert _play(row, "4*6*1*1").reward == 0.0
    row = _row("countdown")
    entry = decode_entry(row["reward_spec"]["entry"])
    numbers = entry["metadata"]["numbers"]
    assert _play(row, f"{entry['answer']} + {numbers[0]} - {numbers[0]}").reward == 0.0  # a number used twice
    assert rg_env.uses_exactly_the_numbers("27*(-2 + (5 - 55 + 62)/2)", [27, 2, 62, 55, 2, 5])
    assert not rg_env.uses_exactly_the_numbers("27*(-2 + (5 - 55 + 62)/2.0)", [27, 2, 62, 55, 2, 5])


@pytest.mark.parametrize("task", ["countdown", "puzzle24", "basic_arithmetic"])
def test_no_answer_pays_nothing_whatever_the_scorer_gives_none(task):
    """countdown and puzzle24 paid 0.01 for no answer at all."""
    row = _row(task)

    async def play():
        env = ReasoningGymEnv()
        await env.reset(row["prompt"], {"reward_spec": row["reward_spec"], "instance_id": row["instance_id"]})
        return await env.step("I will not answer.")
    result = asyncio.run(play())
    assert result.reward == 0.0 and result.metrics["reasoning_gym_answered"] == 0.0
    given = rg_env._scorer(task)(None, decode_entry(row["reward_spec"]["entry"]))
    assert given == (0.0 if task == "basic_arithmetic" else 0.01)  # what the scorer alone would have paid


def test_math_answers_are_scored_not_refused():
    """What a wrong or right math answer makes sympy compile is not code: `cos(x)` becomes `cos(Symbol('x'))` (a
    string inside a wrapper), a many-symbol polynomial makes sympy generate its monomial arithmetic, and a power of
    a power with small exponents is a polynomial. Each was refused by a first version (a fuzz of 150 expressions)."""
    import reasoning_gym

    entry = reasoning_gym.create_dataset("intermediate_integration", size=1, seed=0)[0]
    for answer in ("sin(x) + C", "cos(x)**2 + log(x + 1) + C", "(((x)**11 - ((1)**2)**1))**10 + C"):
        score, refused = rg_env.score_answer("intermediate_integration", answer, entry)
        assert refused is None and score == 0.0, answer
    from sympy.polys.monomials import MonomialOps

    with inert_scoring() as gate:  # 17 generators: a ring no other test builds (sympy caches the generated code)
        assert MonomialOps(17).mul()((1,) * 17, (2,) * 17) == (3,) * 17
    assert gate.refused == []


def test_a_scoring_that_runs_too_long_is_cut_and_pays_nothing(monkeypatch):
    """An inert answer can still keep sympy busy: this one held intermediate_integration's simplify for 10 minutes
    in the trainer's event loop. It is cut at SCORE_TIMEOUT_S (1 s here) and pays 0; the next answer scores."""
    import time

    import reasoning_gym

    monkeypatch.setattr(rg_env, "SCORE_TIMEOUT_S", 1.0)
    entry = reasoning_gym.create_dataset("intermediate_integration", size=1, seed=0)[0]
    slow = "(sin(x)+cos(x)+tan(x)+exp(x))**12 + log(x+1)**7*sqrt(x**3+x+1)**9 + C"
    start = time.perf_counter()
    assert rg_env.score_answer("intermediate_integration", slow, entry) == (0.0, "scoring ran past 1.0 s")
    assert time.perf_counter() - start < 5.0
    assert rg_env.score_answer("intermediate_integration", entry["answer"], entry) == (1.0, None)
