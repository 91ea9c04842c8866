"""Search-R1's exact-match reward: SQuAD normalization, `<answer>` extraction, EM and sub-EM.

Kept byte-for-byte equivalent to Search-R1's `qa_em.py` normalization so our EM numbers compare with
the paper's; only the answer counting differs (see `last_answer`).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop articles, collapse whitespace: SR1/SQuAD order, so 'The U.S.' == 'us'."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _as_list(golden: str | Iterable[str]) -> list[str]:
    return [golden] if isinstance(golden, str) else [str(g) for g in golden]


def em_check(prediction: str, golden_answers: str | Iterable[str]) -> bool:
    """True if the normalized prediction equals any normalized golden answer (the training reward). A golden answer
    that normalizes to nothing ("The The", "...") is no answer: an empty or one-article prediction never matches it."""
    pred = normalize_answer(prediction)
    return any(pred == g for g in map(normalize_answer, _as_list(golden_answers)) if g)


def subem_check(prediction: str, golden_answers: str | Iterable[str]) -> bool:
    """True if a normalized golden answer is inside the normalized prediction (a looser eval metric); one that
    normalizes to nothing is inside every prediction, so it counts as no answer."""
    pred = normalize_answer(prediction)
    return any(g in pred for g in map(normalize_answer, _as_list(golden_answers)) if g)


def words_contain(text: str, golden_answers: str | Iterable[str]) -> bool:
    """True if a normalized golden answer occurs in the normalized text as a run of whole words (a plain substring
    finds "us" in "business"); an answer that normalizes to nothing is never found."""
    words = f" {normalize_answer(text)} "
    return any(f" {g} " in words for g in map(normalize_answer, _as_list(golden_answers)) if g)


def extract_answers(text: str) -> list[str]:
    """Every `<answer>...</answer>` body, stripped, in order."""
    return [m.strip() for m in ANSWER_RE.findall(text)]


def last_answer(text: str) -> str | None:
    """The last `<answer>` in `text`, or None.

    SR1 asks for >=2 matches because it scores prompt + response and the prompt's own example
    `<answer> Beijing </answer>` is one of them; we only ever pass the model's actions, so >=1 is right.
    """
    answers = extract_answers(text)
    return answers[-1] if answers else None


def exact_match_score(answer: str | None, golden_answers: str | Iterable[str]) -> float:
    """1.0 for an exact match, else 0.0; a missing answer scores 0 (SR1's format_score default)."""
    return float(answer is not None and em_check(answer, golden_answers))
