"""Perplexity of several cache specs on WikiText-2 test, windows scored together as one batch (fast on a GPU).

Each spec scores the same ``--windows`` windows of ``--context`` tokens with ``Engine.score(chunk=1)``: one token
per step, so every prediction reads the compressed cache exactly as decoding would (not a parallel pass that
bypasses it). A parallel fp16 pass over the same windows is printed first as a sanity check of the cached path.
``mmkv-eval perplexity`` is the same measurement one window at a time, resumable; this is the quick study form.

    python -m eval.studies.ppl --model smollm2-135m --windows 8 --context 1024 \
        --spec fp16 --spec "text=kivi:bits=2" --spec "text=xquant:kq=28,vq=2,km=30,vm=14" --out results/ppl.json
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from mmkv.methods.xquant import XQuant
from mmkv.spec import CacheSpec

from ..jsonout import save_json
from .common import wikitext_test


def windows(tok, path: Path | None, n: int, context: int) -> torch.Tensor:
    """The first ``n`` windows of ``context`` tokens of ``path`` (``None``: WikiText-2 test)."""
    path = path or wikitext_test()
    ids = tok(path.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    if len(ids) < n * context:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than {n} x {context}")
    return ids[: n * context].view(n, context)


def run(eng, ids: torch.Tensor, specs: list[str]) -> dict:
    with torch.inference_mode():
        logits = eng.model(input_ids=ids.to(eng.device)).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten().to(eng.device))
    rows = [{"spec": "fp16, parallel pass (no cache)", "ppl": math.exp(nll.item())}]
    for spec in specs:
        t0 = time.perf_counter()
        res = eng.score(ids, spec=spec, chunk=1)
        parsed = CacheSpec.parse(spec)
        eq = parsed.text.equivalent_bits(eng.adapter.num_layers) if isinstance(parsed.text, XQuant) else None
        rows.append({"spec": spec, "ppl": res["ppl"], "tokens": res["tokens"],
                     "text_bits": res["stats"]["effective_bits"]["text"],
                     "total_bits": res["stats"]["effective_bits"]["total"], "equivalent_bits": eq,
                     "seconds": time.perf_counter() - t0})
        print(f"{spec:55s} ppl {res['ppl']:8.3f}  text bits {rows[-1]['text_bits']:.3f}", flush=True)
    return {"windows": ids.shape[0], "context": ids.shape[1], "rows": rows}


def format_table(res: dict, label: str) -> str:
    out = [f"WikiText-2 test perplexity, {label}, {res['windows']} windows x {res['context']} tokens, "
           "cache maintained token by token",
           "| spec | PPL | text bits/elem (true) | XQuant equivalent bits (App. A) | all tokens bits/elem |",
           "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        eq = f"{r['equivalent_bits']:.3f}" if r.get("equivalent_bits") is not None else "-"
        tb = f"{r['text_bits']:.3f}" if "text_bits" in r else "-"
        ab = f"{r['total_bits']:.2f}" if "total_bits" in r else "-"
        out.append(f"| {r['spec']} | {r['ppl']:.3f} | {tb} | {eq} | {ab} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", action="append", required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--wikitext", type=Path, default=None)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv

    lm = mmkv.load_model(args.model)
    eng = mmkv.Engine(lm)
    ids = windows(eng.tokenizer, args.wikitext, args.windows, args.context)
    res = run(eng, ids, args.spec)
    label = f"{args.model} ({lm.model.dtype}, {eng.device})"
    print(format_table(res, label))
    save_json(args.out, {"label": label, **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
