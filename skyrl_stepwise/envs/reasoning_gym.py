"""A reasoning-gym row scored by the task's own scorer: one turn, the last `<answer>...</answer>` is the answer.

A missing answer pays 0: the model produced no answer, a real outcome. A scorer that raises is not an outcome: the error propagates and the generator drops the trajectory
(counted), so no made-up reward is trained.

What is paid is what was solved, whatever the answer tries:
- the scorer runs under envs/inert.py's gate: an answer that would be run as code (several scorers `eval` it or
  hand it to sympy) is refused before any of it runs and pays 0 (`reasoning_gym_refused`), and so is one whose
  scoring runs past SCORE_TIMEOUT_S (an inert integral kept sympy's simplify busy for 10 minutes);
- a missing answer pays 0 whatever the scorer gives `None` (countdown and puzzle24 gave 0.01): nothing was solved;
- where a task's scorer judges an arithmetic answer's value but not which numbers it uses (puzzle24 paid
  `4*6*1*1` on every puzzle; countdown read the numbers used from the answer's digits, so `(...)*(pi-pi)+...` with
  the target spelled without digits passed), the answer must be +, -, *, / over exactly the puzzle's numbers
  (`NUMBERS_CHECKED`) or it pays 0;
- the partial credit reasoning-gym's default scorer gives an answer that merely contains the expected one
  (`len(expected) / len(answer)`: "31" earned 0.5 for 3, and "12131" 0.4 whichever of 12, 21, 13, 31 was right, more
  than a guess) is not paid: with that scorer only the exact answer scores. A task that defines its own scorer keeps
  its own partial credit.
"""

from __future__ import annotations

import ast
import json
import signal
import threading
from contextlib import contextmanager
from fractions import Fraction
from typing import Any, Callable

from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.envs.inert import inert_scoring
from skyrl_stepwise.envs.rewards import ANSWER_RE

ENTRY_ENCODING = "tagged-json/1"  # reward_spec.entry_encoding: rows without it are from the lossy format
_TAG = "__rg_type__"


def _tagged(value: Any, path: str) -> Any:
    """`value` as plain JSON values, tuples/sets/frozensets/bytes/fractions and dicts with non-string keys tagged so
    `decode_entry` gives them back as they were; any other type fails naming where it is (never its repr)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_tagged(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (tuple, set, frozenset)):
        return {_TAG: type(value).__name__, "items": [_tagged(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, bytes):
        return {_TAG: "bytes", "hex": value.hex()}
    if isinstance(value, Fraction):  # gsm_symbolic's variables
        return {_TAG: "fraction", "numerator": value.numerator, "denominator": value.denominator}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _tagged(v, f"{path}.{k}") for k, v in value.items()}
        return {_TAG: "dict", "items": [[_tagged(k, f"{path} key {k!r}"), _tagged(v, f"{path}[{k!r}]")]
                                        for k, v in value.items()]}
    raise TypeError(f"{path}: a value of type {type(value).__name__} cannot be stored losslessly")


def _untagged(obj: dict) -> Any:
    """json.loads' object_hook (called innermost first): a tagged value back as its type (`_tagged`'s inverse)."""
    kind = obj.get(_TAG)
    if kind is None:
        return obj
    if kind == "bytes":
        return bytes.fromhex(obj["hex"])
    if kind == "fraction":
        return Fraction(obj["numerator"], obj["denominator"])
    if kind == "dict":
        return {k: v for k, v in obj["items"]}
    return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](obj["items"])


def encode_entry(entry: dict[str, Any]) -> str:
    """A reasoning-gym entry as text that `decode_entry` turns back into an equal entry (tuples stay tuples, int
    keys stay ints). Plain `json.dumps(default=str)` lost both, and a scorer comparing grids then never matched."""
    return json.dumps(_tagged(entry, "entry"))


def decode_entry(text: str) -> dict[str, Any]:
    """`encode_entry`'s inverse."""
    return json.loads(text, object_hook=_untagged)


def _scorer(task: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def _contains_credit(scorer: Callable) -> bool:
    """True where `scorer` is reasoning-gym's default one, whose partial credit pays for containing the answer."""
    from reasoning_gym.dataset import ProceduralDataset

    return getattr(scorer, "__func__", None) is ProceduralDataset.score_answer


_warmed: set[str] = set()
# the wall-clock limit of one scoring: sympy simplified an inert but adversarial integral answer for 10 minutes in
# the trainer's event loop; right answers score in milliseconds
SCORE_TIMEOUT_S = 10.0


class _Expired(BaseException):
    """Raised into a scorer that ran past SCORE_TIMEOUT_S (a BaseException: `except Exception` does not keep it)."""


@contextmanager
def _time_limit(seconds: float):
    """Interrupt the block after `seconds`, and every second after that until it ends (a scorer that swallows the
    first interruption gets the next); yields the record of whether it fired. A SIGALRM timer, so only on the main
    thread (where the generator's event loop runs envs); elsewhere the block runs unbounded."""
    fired = {"expired": False}
    if threading.current_thread() is not threading.main_thread():
        yield fired
        return

    def expire(signum, frame):
        fired["expired"] = True
        raise _Expired(f"scoring ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    earlier = signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, *earlier)
        signal.signal(signal.SIGALRM, previous)
# tasks whose scorer checks an arithmetic answer's value, not that it uses the puzzle's numbers (entry metadata)
NUMBERS_CHECKED = frozenset({"puzzle24", "countdown"})
_ARITHMETIC = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.UnaryOp, ast.USub, ast.UAdd,
               ast.Constant)


def uses_exactly_the_numbers(answer: str, numbers: list[int]) -> bool:
    """`answer` is +, -, *, / (and a sign) and parentheses over integer literals that are `numbers`, each used once."""
    try:
        tree = ast.parse(answer.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    nodes = list(ast.walk(tree))
    if not all(isinstance(n, _ARITHMETIC) for n in nodes):
        return False
    used = [n.value for n in nodes if isinstance(n, ast.Constant)]
    return all(type(v) is int for v in used) and sorted(used) == sorted(int(n) for n in numbers)


def score_answer(task: str, answer: str | None, entry: dict[str, Any]) -> tuple[float, str | None]:
    """What `answer` is paid on `entry` of `task`, and why it was refused (None: it was not): code, or a scoring
    that ran past SCORE_TIMEOUT_S (neither is a solution shown).

    The first call of a task in this process scores the entry's own answer outside the gate, so what the scorer
    builds once (lazy imports, cached types) is built from trusted text, not while an answer is graded."""
    scorer = _scorer(task)
    if task not in _warmed:
        _warmed.add(task)
        try:
            scorer(None if entry.get("answer") is None else str(entry["answer"]), entry)
        except Exception:  # noqa: BLE001 - the build-time check (data/reasoning_gym.py) names such a task
            pass
    with inert_scoring() as gate, _time_limit(SCORE_TIMEOUT_S) as limit:
        try:
            score = float(scorer(answer, entry))
        except (Exception, _Expired):
            if not gate.refused and not limit["expired"]:
                raise
            score = 0.0
    if limit["expired"]:
        return 0.0, f"scoring ran past {SCORE_TIMEOUT_S} s"
    if gate.refused:
        return 0.0, gate.refused[0]
    if answer is None or score < 1.0 and _contains_credit(scorer):
        return 0.0, None
    if task in NUMBERS_CHECKED and not uses_exactly_the_numbers(answer, entry["metadata"]["numbers"]):
        return 0.0, None
    return score, None


class ReasoningGymEnv:
    """One question of a reasoning-gym task; the reward is the task scorer's value for the sampled answer."""

    def __init__(self) -> None:
        self.task: str = ""
        self.entry: dict[str, Any] = {}

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Read the task and its entry from reward_spec (written by data/reasoning_gym.py); a row without them
        fails naming what is missing, and a row from before the lossless encoding fails asking for a rebuild (its
        tuples and int keys are gone, so the right answer of some tasks would score like a wrong one)."""
        spec = extras.get("reward_spec") or {}
        if not spec.get("task") or not spec.get("entry"):
            raise ValueError(f"instance {extras.get('instance_id')!r}: env_class reasoning_gym needs reward_spec.task "
                             "and reward_spec.entry (rows from `skyrl-stepwise data reasoning-gym`)")
        if spec.get("entry_encoding") != ENTRY_ENCODING:
            raise ValueError(f"instance {extras.get('instance_id')!r}: reasoning_gym row with "
                             f"reward_spec.entry_encoding {spec.get('entry_encoding')!r}, expected {ENTRY_ENCODING!r}: "
                             "its entry was stored by an older, lossy version; rebuild the rows with "
                             "`skyrl-stepwise data reasoning-gym`")
        self.task = str(spec["task"])
        self.entry = decode_entry(spec["entry"])
        return list(prompt_messages)

    async def step(self, action_text: str) -> StepResult:
        """Score the last <answer> with the task's scorer; the episode ends after this one turn."""
        answers = ANSWER_RE.findall(action_text)
        answer = answers[-1].strip() if answers else None
        score, refused = score_answer(self.task, answer, self.entry)
        return StepResult(observations=[], reward=score, done=True,
                          metrics={"reasoning_gym_answered": float(answer is not None),
                                   "reasoning_gym_score": score,
                                   "reasoning_gym_refused": float(refused is not None)})
