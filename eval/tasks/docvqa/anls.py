"""ANLS, the DocVQA metric (Biten et al., ICCV 2019; Mathew et al., WACV 2021): per question, the best over the
gold answers of 1 - NL(pred, gold) where NL is the Levenshtein distance divided by the longer string's length,
cut to 0 when NL >= 0.5; the score is the mean over questions. Our own implementation, no dependency."""

from __future__ import annotations

THRESHOLD = 0.5


def normalize(text: str) -> str:
    """Case- and whitespace-insensitive: lower case, trimmed, inner runs of whitespace collapsed to one space."""
    return " ".join(str(text).lower().split())


def levenshtein(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def similarity(prediction: str, gold: str, threshold: float = THRESHOLD) -> float:
    p, g = normalize(prediction), normalize(gold)
    longest = max(len(p), len(g))
    if longest == 0:
        return 1.0  # both empty: identical
    nl = levenshtein(p, g) / longest
    return 1.0 - nl if nl < threshold else 0.0


def question_score(prediction: str, golds: list[str], threshold: float = THRESHOLD) -> float:
    """Best match over the gold answers; a question without any gold answer scores 0 (nothing can match)."""
    return max((similarity(prediction, g, threshold) for g in golds), default=0.0)


def anls(predictions: list[str], golds: list[list[str]], threshold: float = THRESHOLD) -> float:
    """Mean ANLS over questions. predictions[i] is scored against every answer in golds[i]."""
    if len(predictions) != len(golds):
        raise ValueError(f"anls: {len(predictions)} predictions but {len(golds)} gold lists")
    if isinstance(golds, (str, bytes)) or any(isinstance(g, str) for g in golds):
        raise ValueError("anls: golds must be a list of lists of strings (one list of answers per question)")
    if not predictions:
        return 0.0
    return sum(question_score(p, g, threshold) for p, g in zip(predictions, golds, strict=True)) / len(predictions)
