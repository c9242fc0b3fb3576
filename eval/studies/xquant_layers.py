"""XQuant per layer on SmolLM2 (issue 27 item 4): where the perplexity gap to KIVI-2 comes from, and a check of the
cross-layer pairing on a model with 3 KV heads.

``--windows`` windows of ``--context`` WikiText-2 tokens go through the model (plain forwards); every layer's q,
k (after RoPE) and v are kept (``collect_qkv``). For each ``--spec`` the real ``MMKVCache`` (window 0, sinks 0:
every token quantized, so the error is the quantizer's alone) is filled layer by layer with a window's K/V and
read back through its segments (shared layers resolved to their partner's codes, as decode reads them). Per layer:

* ``k_err`` / ``v_err``: relative L2 error of the dequantized K / V vs the model's, over the window;
* ``attn_err``: relative L2 error of the attention output of the window's last ``--queries`` positions (each a
  causal query over the keys up to it, GQA), i.e. what one layer's cache error does to its output alone.

Pairing check (``--check``): for every layer that reads its partner's codes, the cache's dequantized K/V are
compared with an independent computation from the paper (Sec. 3.3.3-3.3.4: codes of layer l-1 from the plain
min/max quantizer, scale and zero-point of layer l with Eq. 12-13's calibration), head by head; reported as the
share of equal elements and the largest difference; as a negative control, the same with the partner's KV heads
rolled by one (what a head mix-up in the pairing would give).

    python -m eval.studies.xquant_layers --windows 2 --context 512 --check \\
        --spec "text=kivi:bits=2" --spec "text=xquant:kq=28,vq=2,km=30,vm=14" --out results/xquant_layers.json
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from kernels.reference import dequantize_segment
from mmkv.cache import MMKVCache
from mmkv.calibrate.collect import collect_qkv
from mmkv.methods.xquant import XQuant
from mmkv.spec import CacheSpec

from ..jsonout import save_json
from .common import wikitext_test


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fill_cache(spec: str, ks: list[torch.Tensor], vs: list[torch.Tensor], head_dim: int) -> MMKVCache:
    """``ks``/``vs``: per layer ``[T, H, D]`` -> a finalized cache holding them (one row)."""
    cache = MMKVCache(CacheSpec.parse(spec), num_layers=len(ks), head_dim=head_dim)
    for layer, (k, v) in enumerate(zip(ks, vs)):
        cache.update(k.permute(1, 0, 2)[None].float(), v.permute(1, 0, 2)[None].float(), layer)
    cache.finalize()
    return cache


def read_back(cache: MMKVCache, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K/V as decode reads them, ``[H, n, D]`` fp32 (segments in token order: sinks, text, window)."""
    ks, vs = [], []
    for seg in cache.layers[layer].segments():
        k, v = dequantize_segment(seg)
        m = int(seg.lens[0])
        ks.append(k[0, :, :m])
        vs.append(v[0, :, :m])
    k, v = torch.cat(ks, 1), torch.cat(vs, 1)
    assert k.shape[1] == n, f"layer {layer}: cache holds {k.shape[1]} tokens, expected {n}"
    return k, v


def causal_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: int) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[H, T, D]`` -> attention output of the last ``queries`` positions ``[queries, Hq, D]``."""
    t, hq, d = q.shape
    h = k.shape[0]
    qq = q[t - queries:].float().permute(1, 0, 2).reshape(h, hq // h, queries, d)
    x = torch.einsum("hgqd,htd->hgqt", qq, k.float()) / math.sqrt(d)
    pos = torch.arange(t - queries, t)[:, None]
    x = x.masked_fill(torch.arange(t)[None, :] > pos, float("-inf"))
    out = torch.einsum("hgqt,htd->hgqd", torch.softmax(x, -1), v.float())
    return out.reshape(hq, queries, d).permute(1, 0, 2)


# ---- independent XQuant (the paper's formulas, written again here: not mmkv's quantizer) ----------------------


def _minmax_codes(x: torch.Tensor, bits: int, dim: int, group: int):
    """x ``[H, T, D]``; groups of ``group`` along ``dim`` (1 = tokens: keys per channel; 2 = channels: values per
    token). Eq. 1-2: z = min, s = (max - min) / (2^B - 1), codes = round((x - z) / s)."""
    h, t, d = x.shape
    if dim == 1:
        xg = x.reshape(h, t // group, group, d)
        lo, hi = xg.amin(2, keepdim=True), xg.amax(2, keepdim=True)
    else:
        xg = x.reshape(h, t, d // group, group)
        lo, hi = xg.amin(3, keepdim=True), xg.amax(3, keepdim=True)
    s = (hi - lo) / ((1 << bits) - 1)
    codes = torch.where(s > 0, torch.round((xg - lo) / torch.where(s > 0, s, 1)), 0).clamp(0, (1 << bits) - 1)
    return codes, s, lo


def independent_shared(x_prev: torch.Tensor, x_own: torch.Tensor, bits: int, dim: int, group: int, eta: float):
    """Layer l reads layer l-1's codes with its own calibrated scale and zero (Eq. 12-13): ``[H, T, D]``."""
    codes, _, _ = _minmax_codes(x_prev, bits, dim, group)
    _, s, z = _minmax_codes(x_own, bits, dim, group)
    # mmkv stores scale/zero in fp16 (as KIVI does); round the same way so that only code flips can differ
    s16, z16 = s.half().float(), z.half().float()
    s_cal = ((1 - 2 * eta) * s16).half().float()
    z_cal = (z16 + eta * s16 * ((1 << bits) - 1)).half().float()
    out = codes * s_cal + z_cal
    return out.reshape(x_own.shape)


def pairing_check(method: XQuant, ks, vs, cache: MMKVCache, n: int) -> dict:
    plan = method.plan(len(ks))
    equal, equal_rolled, total, worst, layers = 0, 0, 0, 0.0, []
    for layer, p in enumerate(plan):
        kc, vc = read_back(cache, layer, n)
        for kind, dim, got in (("k", 1, kc), ("v", 2, vc)):
            if not p[f"{kind}_shared"]:
                continue
            bits = p[f"{kind}_bits"]
            eta = method.eta1 if bits == 1 else method.eta2
            src = ks if kind == "k" else vs
            want = independent_shared(src[layer - 1].permute(1, 0, 2).float(), src[layer].permute(1, 0, 2).float(),
                                      bits, dim, method.group, eta)
            diff = (got - want).abs()
            tol = 1e-3 * want.abs().amax()
            equal += int((diff <= tol).sum())
            total += diff.numel()
            worst = max(worst, float(diff.max()))
            layers.append(f"{kind}{layer}")
            # negative control: the partner's heads rolled by one (a head mix-up would look like this)
            rolled = independent_shared(src[layer - 1].permute(1, 0, 2).float().roll(1, 0),
                                        src[layer].permute(1, 0, 2).float(), bits, dim, method.group, eta)
            equal_rolled += int(((got - rolled).abs() <= tol).sum())
    return {"shared": layers, "equal_share": equal / total if total else None, "max_abs_diff": worst,
            "equal_share_heads_rolled": equal_rolled / total if total else None}


def run(lm, specs: list[str], windows: int, context: int, queries: int, data: Path | None, check: bool) -> dict:
    model, processor, adapter = lm
    data = data or wikitext_test()
    col = collect_qkv(lm, path=data, seq_len=context, max_tokens=windows * context, dtype=torch.float32)
    nl = adapter.num_layers
    out = {"data": str(data), "windows": col.meta["windows"], "context": context, "queries": queries, "specs": {}}
    for spec in specs:
        t0 = time.perf_counter()
        rows = [{"k_err": 0.0, "v_err": 0.0, "attn_err": 0.0} for _ in range(nl)]
        checks = []
        for w in range(col.meta["windows"]):
            off = w * context
            ks = [col.k[l][off:off + context] for l in range(nl)]
            vs = [col.v[l][off:off + context] for l in range(nl)]
            cache = fill_cache(spec, ks, vs, adapter.head_dim)
            for l in range(nl):
                kq, vq = read_back(cache, l, context)
                k, v = ks[l].permute(1, 0, 2).float(), vs[l].permute(1, 0, 2).float()
                q = col.q[l][off:off + context]
                rows[l]["k_err"] += rel(kq, k) / col.meta["windows"]
                rows[l]["v_err"] += rel(vq, v) / col.meta["windows"]
                rows[l]["attn_err"] += rel(causal_out(q, kq, vq, queries), causal_out(q, k, v, queries)) / col.meta["windows"]
            text = CacheSpec.parse(spec).text
            if check and isinstance(text, XQuant) and any(p["k_shared"] or p["v_shared"] for p in text.plan(nl)):
                checks.append(pairing_check(text, ks, vs, cache, context))
        res = {"layers": rows, "seconds": time.perf_counter() - t0}
        for key in ("k_err", "v_err", "attn_err"):
            res[f"mean_{key}"] = sum(r[key] for r in rows) / nl
        if checks:
            res["pairing_check"] = {"shared": checks[0]["shared"],
                                    "equal_share": min(c["equal_share"] for c in checks),
                                    "max_abs_diff": max(c["max_abs_diff"] for c in checks),
                                    "equal_share_heads_rolled": max(c["equal_share_heads_rolled"] for c in checks)}
        out["specs"][spec] = res
        print(f"{spec:50s} mean k {res['mean_k_err']:.4f} v {res['mean_v_err']:.4f} attn {res['mean_attn_err']:.4f}"
              + (f"  pairing {res['pairing_check']}" if checks else ""), flush=True)
    return out


def format_tables(res: dict) -> str:
    specs = list(res["specs"])
    out = [f"Per-layer relative L2 error (K / V / attention output of the last {res['queries']} positions), "
           f"{res['windows']} windows x {res['context']} tokens of {Path(res['data']).name}, every token quantized",
           "| layer | " + " | ".join(specs) + " |", "|---:|" + "---|" * len(specs)]
    nl = len(res["specs"][specs[0]]["layers"])
    for l in range(nl):
        cells = [f"{r['k_err']:.3f} / {r['v_err']:.3f} / {r['attn_err']:.3f}"
                 for r in (res["specs"][s]["layers"][l] for s in specs)]
        out.append(f"| {l} | " + " | ".join(cells) + " |")
    out.append("| mean | " + " | ".join(f"{res['specs'][s]['mean_k_err']:.3f} / {res['specs'][s]['mean_v_err']:.3f} / "
                                        f"{res['specs'][s]['mean_attn_err']:.3f}" for s in specs) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", action="append", required=True, help="cache spec; window=0 sinks=0 are appended")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--check", action="store_true", help="check shared layers against an independent computation")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv

    specs = [s if "window=" in s else f"{s} window=0 sinks=0" for s in args.spec]
    lm = mmkv.load_model(args.model, device="cpu")
    res = run(lm, specs, args.windows, args.context, args.queries, args.data, args.check)
    res["model"] = args.model
    print(format_tables(res))
    save_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
