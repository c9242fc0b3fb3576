"""Token-level diff of the FP16 answer against the quantized one, as ``gr.HighlightedText`` pairs."""

from __future__ import annotations

import difflib
import re

SAME, FP16_ONLY, QUANT_ONLY = None, "FP16 only", "quantized only"
COLORS = {FP16_ONLY: "#f59e0b", QUANT_ONLY: "#3b82f6"}


def words(text: str) -> list[str]:
    """Fallback tokenization: words with their leading whitespace, punctuation on its own."""
    return re.findall(r"\s*\w+|\s*[^\w\s]|\s+", text or "")


def tokenizer_of(engine):
    for obj in (engine, getattr(engine, "lm", None), getattr(engine, "model", None)):
        if obj is None:
            continue
        for attr in ("tokenizer", "processor"):
            tok = getattr(obj, attr, None)
            tok = getattr(tok, "tokenizer", tok)
            if tok is not None and hasattr(tok, "decode"):
                return tok
    return None


def token_pieces(text: str, output, engine) -> list[str]:
    """The answer as the model's own tokens when the output and a tokenizer are at hand, else as words."""
    tok = tokenizer_of(engine)
    ids = getattr(output, "tokens", None)
    if tok is not None and ids is not None:
        try:
            row = ids[0].tolist() if hasattr(ids[0], "tolist") else list(ids[0])
            pieces = whole_characters(tok, row)
            if "".join(pieces).strip() == (text or "").strip():
                return pieces
        except Exception:
            pass
    return words(text)


def whole_characters(tok, row: list[int]) -> list[str]:
    """One piece per token, except that a character whose UTF-8 bytes span several tokens is held back until it is
    whole (as transformers' streamers do) and given to the token that completes it: decoded alone, each of its
    tokens would read as U+FFFD."""
    pieces, start = [], 0
    for end in range(1, len(row) + 1):
        text = tok.decode(row[start:end], skip_special_tokens=True)
        if text.endswith("\ufffd") and end < len(row):
            pieces.append("")
            continue
        pieces.append(text)
        start = end
    return [p for p in pieces if p]


def diff_pieces(a: list[str], b: list[str]) -> list[tuple[str, str | None]]:
    """Pairs (piece, label): shared pieces unlabeled, FP16-only and quantized-only pieces labeled."""
    out: list[tuple[str, str | None]] = []
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            out.append(("".join(a[i1:i2]), SAME))
            continue
        if i2 > i1:
            out.append(("".join(a[i1:i2]), FP16_ONLY))
        if j2 > j1:
            out.append(("".join(b[j1:j2]), QUANT_ONLY))
    return [(p, label) for p, label in out if p]


def token_diff(fp16_text: str, quant_text: str, fp16_out=None, quant_out=None, engine=None):
    return diff_pieces(token_pieces(fp16_text, fp16_out, engine), token_pieces(quant_text, quant_out, engine))


def agreement(pairs: list[tuple[str, str | None]]) -> float:
    """Share of characters the two answers have in common (1.0 = identical)."""
    same = sum(len(p) for p, label in pairs if label is SAME)
    total = sum(len(p) for p, label in pairs if label in (SAME, QUANT_ONLY))
    return same / total if total else 1.0
