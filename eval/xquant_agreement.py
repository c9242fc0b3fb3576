"""XQuant Sec. 3.3.2 on a real model: how often do adjacent layers' quantized codes agree?

One prefill of wikitext-2 text through ``smollm2-135m``; each layer's K and V are quantized as the KIVI layout does
(keys per channel in blocks of ``group`` tokens, values per token in groups of ``group`` channels) at ``bits``;
for each pair (l, l+1) we report the share of positions whose codes are equal. A value of ``1 / 2**bits`` is what
independent uniform codes would give (0.5 at 1 bit): the paper's observation is that quantized adjacent layers
agree far more than that, which is what makes sharing codes across layers cheap.

    python -m eval.xquant_agreement --tokens 1024 --bits 1 --out results/xquant_agreement.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DynamicCache

from mmkv.methods.quant import channel_quantize, token_group_quantize

from .calibquant_fidelity import WIKITEXT


def layer_codes(model, ids: torch.Tensor, bits: int, group: int):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
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


def run(model, tok, n_tokens: int, bits: int, group: int, offset: int = 0) -> dict:
    text = WIKITEXT.read_text(encoding="utf-8")[offset : offset + 40 * n_tokens]
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens].to(model.device)
    codes = layer_codes(model, ids, bits, group)
    rows = []
    for l in range(len(codes) - 1):
        (k0, v0), (k1, v1) = codes[l], codes[l + 1]
        rows.append({"layers": f"{l}-{l + 1}", "keys": (k0 == k1).float().mean().item(),
                     "values": (v0 == v1).float().mean().item()})
    mean = {"keys": sum(r["keys"] for r in rows) / len(rows), "values": sum(r["values"] for r in rows) / len(rows)}
    return {"tokens": ids.shape[1], "bits": bits, "group": group, "chance": 1 / 2**bits, "pairs": rows, "mean": mean}


def format_table(res: dict) -> str:
    lines = [f"Adjacent-layer agreement of {res['bits']}-bit codes (KIVI layout, group {res['group']}), "
             f"{res['tokens']} wikitext-2 tokens; chance = {res['chance']:.2f}",
             "| layers | keys | values |", "|---|---:|---:|"]
    for r in res["pairs"] + [{"layers": "mean", **res["mean"]}]:
        lines.append(f"| {r['layers']} | {r['keys']:.3f} | {r['values']:.3f} |")
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
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
