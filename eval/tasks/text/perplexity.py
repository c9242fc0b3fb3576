"""Perplexity on WikiText-2 test with the compressed cache maintained autoregressively: each window of --context
tokens is scored by Engine.score, which feeds the tokens --chunk at a time through the quantized cache, so later
tokens see the compressed history exactly as in decoding (not an fp16 prefill)."""

from __future__ import annotations

import math

import torch

from ...runtime import Runtime, compact_stats
from . import wikitext


def load_samples(opts: dict, rt: Runtime) -> list[dict]:
    n = len(wikitext.token_ids(rt, opts)) // opts["context"]
    return [{"id": f"c{opts['context']}-w{i}", "start": i * opts["context"]} for i in range(n)]


def run_sample(rt: Runtime, sample: dict, spec: str, opts: dict) -> dict:
    window = wikitext.token_ids(rt, opts)[sample["start"]:sample["start"] + opts["context"]]
    res = rt.engine.score(torch.tensor([window]), spec=spec, chunk=opts["chunk"])
    return {"nll": float(res["nll"]), "tokens": int(res["tokens"]), "stats": compact_stats(res.get("stats", {}))}


def score(records: list[dict], baseline: list[dict], opts: dict) -> tuple[dict, list[str]]:
    tokens = sum(r["tokens"] for r in records)
    if not tokens:
        return {"PPL": None, "tokens": 0}, []
    return {"PPL": math.exp(sum(r["nll"] for r in records) / tokens), "tokens": tokens}, [
        f"{len(records)} windows of {opts['context']} tokens, fed {opts['chunk']} token(s) per step"]


TASK = {
    "title": "WikiText-2 test perplexity (compressed cache maintained autoregressively)",
    "paper": "XQuant / SKVQ / AQUA-KV perplexity protocol",
    "load": load_samples, "run": run_sample, "score": score,
    "metrics": ["PPL", "tokens"], "digits": 3, "needs": "text",
    "defaults": {"max_new_tokens": 0},
    "options": [
        wikitext.OPTION,
        (["--context"], {"type": int, "default": 2048, "help": "tokens per window (default 2048)"}),
        (["--chunk"], {"type": int, "default": 1, "help": "tokens fed per step (1 = fully autoregressive)"}),
    ],
}
