"""Greedy agreement with FP16: the same WikiText-2 prompts decoded greedily with the fp16 cache and with each
spec. Prefix agreement = share of generated tokens identical before the first divergence; token agreement =
share of positions with the same token overall (a length mismatch counts as disagreement)."""

from __future__ import annotations

import torch

from ...runtime import Runtime, generate, mean
from . import wikitext


def load_samples(opts: dict, rt: Runtime) -> list[dict]:
    corpus = wikitext.token_ids(rt, opts)
    n, length = opts["num_prompts"], opts["prompt_tokens"]
    stride = max((len(corpus) - length) // max(n, 1), 1)
    return [{"id": f"p{i}", "start": i * stride} for i in range(n) if i * stride + length <= len(corpus)]


def run_sample(rt: Runtime, sample: dict, spec: str, opts: dict) -> dict:
    ids = wikitext.token_ids(rt, opts)[sample["start"]:sample["start"] + opts["prompt_tokens"]]
    return generate(rt, torch.tensor([ids]), spec, opts["max_new_tokens"])


def compare(ref: list[int], out: list[int]) -> tuple[float, float]:
    """(prefix agreement, token agreement) of out against the fp16 reference tokens."""
    longest = max(len(ref), len(out))
    if longest == 0:
        return 1.0, 1.0
    prefix = 0
    while prefix < min(len(ref), len(out)) and ref[prefix] == out[prefix]:
        prefix += 1
    same = sum(a == b for a, b in zip(ref, out, strict=False))
    return prefix / longest, same / longest


def score(records: list[dict], baseline: list[dict], opts: dict) -> tuple[dict, list[str]]:
    ref = {r["id"]: r["tokens"] for r in baseline}
    pairs = [compare(ref[r["id"]], r["tokens"]) for r in records if r["id"] in ref]
    return {"Prefix agreement": mean(p for p, _ in pairs) if pairs else None,
            "Token agreement": mean(t for _, t in pairs) if pairs else None}, [
        f"{opts['prompt_tokens']}-token prompts, {opts['max_new_tokens']} greedy tokens, compared with fp16"]


TASK = {
    "title": "Greedy agreement with the FP16 cache (WikiText-2 prompts)",
    "paper": "fidelity check (no paper table)",
    "load": load_samples, "run": run_sample, "score": score,
    "metrics": ["Prefix agreement", "Token agreement"], "digits": 3, "needs": "text",
    "defaults": {"max_new_tokens": 64},
    "options": [
        wikitext.OPTION,
        (["--prompt-tokens"], {"type": int, "default": 512, "help": "prompt length in tokens"}),
        (["--num-prompts"], {"type": int, "default": 50, "help": "prompts drawn evenly from the text"}),
    ],
}
