"""XQuant Sec. 3.3.2 on a real model: how often do adjacent layers' quantized codes agree?

One prefill of wikitext-2 text through ``smollm2-135m``; each layer's K and V are quantized as the KIVI layout does
(keys per channel in blocks of ``group`` tokens, values per token in groups of ``group`` channels) at ``bits``;
for each pair (l, l+1) we report the share of positions whose codes are equal, next to what independent codes
with the same code frequencies would give; at 2 bits also the paper's Fig. 2 view (share of |delta| <= 1 and of
|delta| = 3, and the top bit, i.e. {0,1} -> 0, {2,3} -> 1). The paper's observation (Mistral-7B, LongBench) is that
adjacent layers agree far more than chance, which is what makes sharing codes across layers cheap.

    python -m eval.studies.xquant_agreement --tokens 1024 --bits 1 --out results/xquant_agreement.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import DynamicCache

from mmkv.cache import cache_kwargs
from mmkv.methods.quant import channel_quantize, token_group_quantize

from ..jsonout import save_json
from .common import wikitext_test


def layer_codes(model, ids: torch.Tensor, bits: int, group: int):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    out = []
    for layer in cache.layers:
        k, v = layer.keys.float(), layer.values.float()
        t = k.shape[2] // group * group
        k, v = k[:, :, :t], v[:, :, :t]
        lens = torch.tensor([t])
        kc, _, _ = channel_quantize(k, lens, bits, group)
        vc, _, _ = token_group_quantize(v, bits, group)
        out.append((kc, vc))
    return out


def _compare(a: torch.Tensor, b: torch.Tensor, bits: int) -> dict:
    """Agreement of two layers' codes, and what independent codes with the same per-layer code frequencies would
    give (a fairer chance level than 1/2**bits: codes are not uniform)."""
    levels = 1 << bits
    pa = torch.bincount(a.flatten().long(), minlength=levels).double() / a.numel()
    pb = torch.bincount(b.flatten().long(), minlength=levels).double() / b.numel()
    out = {"equal": (a == b).float().mean().item(), "equal_chance": float((pa * pb).sum())}
    if bits == 2:  # Fig. 2 of the paper: |delta| <= 1, |delta| = 3, and the 1-bit view {0,1}->0, {2,3}->1
        d = (a.long() - b.long()).abs()
        out["absdiff_le1"] = (d <= 1).float().mean().item()
        near = (torch.arange(levels)[:, None] - torch.arange(levels)[None, :]).abs() <= 1
        out["absdiff_le1_chance"] = float((pa[:, None] * pb[None, :] * near).sum())
        out["absdiff_3"] = (d == 3).float().mean().item()
        out["top_bit_equal"] = ((a >> 1) == (b >> 1)).float().mean().item()
        ta, tb = pa[:2].sum(), pb[:2].sum()
        out["top_bit_chance"] = float(ta * tb + (1 - ta) * (1 - tb))
    return out


def run(model, tok, n_tokens: int, bits: int, group: int, offset: int = 0) -> dict:
    text = wikitext_test().read_text(encoding="utf-8")[offset : offset + 40 * n_tokens]
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens].to(model.device)
    codes = layer_codes(model, ids, bits, group)
    rows = []
    for l in range(len(codes) - 1):
        (k0, v0), (k1, v1) = codes[l], codes[l + 1]
        rows.append({"layers": f"{l}-{l + 1}", "keys": _compare(k0, k1, bits), "values": _compare(v0, v1, bits)})
    mean = {kind: {m: sum(r[kind][m] for r in rows) / len(rows) for m in rows[0][kind]} for kind in ("keys", "values")}
    return {"tokens": ids.shape[1], "bits": bits, "group": group, "uniform_chance": 1 / 2**bits, "pairs": rows,
            "mean": mean}


def format_table(res: dict) -> str:
    metrics = list(res["mean"]["keys"])
    lines = [f"Adjacent-layer agreement of {res['bits']}-bit codes (KIVI layout, group {res['group']}), "
             f"{res['tokens']} wikitext-2 tokens; *_chance = independent codes with each layer's own code frequencies",
             "| layers | " + " | ".join(f"K {m}" for m in metrics) + " | " + " | ".join(f"V {m}" for m in metrics) + " |",
             "|---|" + "---:|" * (2 * len(metrics))]
    for r in res["pairs"] + [{"layers": "mean", **res["mean"]}]:
        cells = [f"{r[kind][m]:.3f}" for kind in ("keys", "values") for m in metrics]
        lines.append(f"| {r['layers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv

    model, tok, _ = mmkv.load_model(args.model)
    res = run(model, getattr(tok, "tokenizer", tok), args.tokens, args.bits, args.group)
    print(format_table(res))
    save_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
