"""Needle in a haystack: a synthetic "special magic number" sentence hidden at a given depth inside WikiText-2
text of a given total length; the model must repeat the number (greedy). Exact match on the digits."""

from __future__ import annotations

import hashlib
import re

import torch

from ...runtime import Runtime, generate
from . import wikitext

QUESTION = "\nWhat is the special magic number mentioned in the text above? The special magic number is"


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def _label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def load_samples(opts: dict, rt: Runtime) -> list[dict]:
    return [{"id": f"n{n}-d{d:g}", "context": n, "depth": d} for n in _ints(opts["contexts"])
            for d in _floats(opts["depths"])]


def build(rt: Runtime, sample: dict, opts: dict) -> tuple[list[int], str]:
    digest = int(hashlib.sha256(sample["id"].encode()).hexdigest(), 16)
    number = str(1_000_000 + digest % 9_000_000)  # 7 digits, fixed per sample so every spec sees the same
    tok = rt.tokenizer
    needle = tok(f" The special magic number is {number}. ", add_special_tokens=False)["input_ids"]
    question = tok(QUESTION, add_special_tokens=False)["input_ids"]
    hay_len = sample["context"] - len(needle) - len(question)
    corpus = wikitext.token_ids(rt, opts)
    if hay_len <= 0 or hay_len > len(corpus):
        raise ValueError(f"context {sample['context']} does not fit the needle/question or the corpus")
    start = (digest >> 32) % (len(corpus) - hay_len + 1)
    hay = corpus[start:start + hay_len]
    at = int(round(sample["depth"] * hay_len))
    return hay[:at] + needle + hay[at:] + question, number


def run_sample(rt: Runtime, sample: dict, spec: str, opts: dict) -> dict:
    ids, number = build(rt, sample, opts)
    rec = generate(rt, torch.tensor([ids]), spec, opts["max_new_tokens"])
    found = re.findall(r"\d+", rec["prediction"].replace(",", ""))
    rec.update(context=sample["context"], depth=sample["depth"], expected=number,
               correct=bool(found) and found[0] == number)
    rec.pop("tokens")
    return rec


def metrics(opts: dict) -> list[str]:
    return ["Accuracy"] + [_label(n) for n in _ints(opts["contexts"])]


def score(records: list[dict], baseline: list[dict], opts: dict) -> tuple[dict, list[str]]:
    out: dict = {"Accuracy": sum(r["correct"] for r in records) / len(records) if records else None}
    for n in _ints(opts["contexts"]):
        hits = [r["correct"] for r in records if r["context"] == n]
        out[_label(n)] = sum(hits) / len(hits) if hits else None
    return out, [f"depths {opts['depths']}; exact match of the 7-digit number (first number in the answer)"]


TASK = {
    "title": "Needle in a haystack (WikiText-2 haystack, exact-match retrieval)",
    "paper": "long-context retrieval check (text methods)",
    "load": load_samples, "run": run_sample, "score": score,
    "metrics": metrics, "digits": 3, "needs": "text",
    "defaults": {"max_new_tokens": 12},
    "options": [
        wikitext.OPTION,
        (["--contexts"], {"default": "1024,2048,4096,8192,16384,32768", "help": "total prompt lengths, tokens"}),
        (["--depths"], {"default": "0.1,0.3,0.5,0.7,0.9", "help": "needle positions as fractions of the haystack"}),
    ],
}
