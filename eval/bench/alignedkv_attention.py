"""AlignedKV decode attention vs fp16 SDPA on one GPU: does reading fewer bit planes make decode faster?

Shapes: ``smollm2`` (9 query heads, 3 KV heads, head_dim 64: SmolLM2-135M's layout) and ``gqa8`` (32 query heads,
8 KV heads, head_dim 128); one decode token per row over n in {8192, 32768} cached tokens; batch 1 and 16.
K/V are **synthetic** (random; no model weights needed): K channels spread over 7 binades (the columnar magnitude
pattern of real keys, which Rule 1 exploits), V standard normal, q standard normal. The widths Rule 1/2 choose on
such data are not a real model's (see docs/ALIGNEDKV.md for SmolLM2's); the forced rows read every block at 16, 12
or 8 bits and so show the speed at each width whatever the data.

Rows per (shape, batch, n):
* ``fp16 sdpa``: ``F.scaled_dot_product_attention`` on fp16 K/V, the fastest backend that is correct
  (flash / efficient / cudnn, GQA as G query rows per KV head or ``enable_gqa``);
* ``fp16 mmkv dense``: mmkv's own Triton split-K kernel on the same fp16 K/V;
* ``alignedkv paper``: the method's default (Rule 1 keys, the authors' value rule ``values=paper``), bits read
  measured by the kernel on this data (K and V separately in the JSON and the table);
* ``alignedkv conservative``: the same with ``values=conservative`` (mmkv's earlier value rule, more V bits);
* ``alignedkv 16/12/8``: ``force_bits`` (16 = the paper's control group: same code, every plane read).
Times are medians of ``triton.testing.do_bench`` (L2 flushed before every call) in microseconds, host launch
included; ``--graphs`` adds CUDA-graph replay medians (launch overhead removed). Bytes = what a call must move once:
planes read (by the widths chosen) + K/V colmax + for the rule rows the fp32 logit scratch written and read back
(forced widths run as one pass without it) + q + out; fp16:
K + V + q + out. Each alignedkv row is checked against the torch reference on its first batch row.

    python -m eval.bench.alignedkv_attention --out results/bench_alignedkv --graphs
    TRITON_INTERPRET=1 python -m eval.bench.alignedkv_attention --smoke --out /tmp/b   # CPU, tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import kernels
from kernels.decode.alignedkv import aligned_decode
from kernels.layouts import AlignedSeg, DenseSeg
from kernels.reference import aligned_attention, bits_read
from kernels.testing import aligned_kv, map_tensors, median_us
from mmkv.methods.alignedkv import AlignedKV

SHAPES = {"smollm2": (9, 3, 64), "gqa8": (32, 8, 128)}
VARIANTS = ("fp16 sdpa", "fp16 mmkv dense", "alignedkv paper", "alignedkv conservative", "alignedkv 16",
            "alignedkv 12", "alignedkv 8")
READS = (("alignedkv paper", "paper", 0), ("alignedkv conservative", "conservative", 0), ("alignedkv 16", "paper", 16),
         ("alignedkv 12", "paper", 12), ("alignedkv 8", "paper", 8))


def make_kv(B, H, n, D, dev, g):
    return aligned_kv(B, H, n, D, g, binades=3, per_head=True, device=dev, dtype=torch.float16)


def sdpa_variants(G: int, H: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}

    def make(layout, be):
        def run(q, k, v):
            with sdpa_kernel([backends[be]]):
                if layout == "gqa":
                    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)
                b, hq, d = q.shape  # the G query heads of a KV head as G query rows (no mask needed)
                return F.scaled_dot_product_attention(q.view(b, H, G, d), k, v).reshape(b, hq, d)
        return run

    return {f"{lay}/{be}": make(lay, be) for lay in ("rows", "gqa") for be in backends}


def timer(smoke: bool, graphs: bool):
    if smoke:
        def t(fn):  # one interpreted call: checks that it runs, the number means nothing
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        return t
    return lambda fn: median_us(fn, graphs, rep=100)


def first_row(seg: AlignedSeg) -> AlignedSeg:
    return map_tensors(seg, lambda t: t[:1])


def bench_case(shape: str, B: int, n: int, dev, smoke: bool, graphs: bool) -> list[dict]:
    HQ, H, D = SHAPES[shape]
    G = HQ // H
    g = torch.Generator(device=dev).manual_seed(B * 7 + n)
    k, v = make_kv(B, H, n, D, dev, g)
    q = torch.randn(B, HQ, D, generator=g, device=dev).half()
    lens = torch.full((B,), n, dtype=torch.int32, device=dev)
    ref = F.scaled_dot_product_attention(q.float().view(B, H, G, D), k.float(), v.float()).reshape(B, HQ, D)
    io_bytes = 2 * B * HQ * D * 2
    fp16_bytes = 2 * B * H * n * D * 2 + io_bytes
    rows = []

    def row(variant, us, nbytes, err, bits=None, us_graph=None):
        rows.append({"shape": shape, "batch": B, "n": n, "variant": variant, "us": us, "bytes": nbytes,
                     "gbs": nbytes / us / 1e3 if us and us == us else float("nan"), "bits_read": bits,
                     "max_rel_err": err, "us_graph": us_graph})
        print(f"  {shape:8s} B={B:<3d} n={n:<6d} {variant:18s} {us:10.1f} us  bits {bits if bits else '-'}  "
              f"err {err:.1e}", flush=True)

    time_eager = timer(smoke, False)
    time_graph = timer(smoke, True) if graphs and not smoke else None
    rel = lambda o, r: ((o.float() - r.float()).norm() / r.float().norm()).item()  # noqa: E731

    # fp16 SDPA: fastest correct backend
    best = (float("inf"), None, float("nan"))
    for name, fn in sdpa_variants(G, H).items():
        try:
            err = rel(fn(q, k, v), ref)
            if err > 2e-3:
                continue
            t = time_eager(lambda fn=fn: fn(q, k, v))
        except Exception:
            continue
        if t < best[0]:
            best = (t, name, err)
    t_graph = None
    if time_graph is not None and best[1] is not None:
        fn = sdpa_variants(G, H)[best[1]]
        t_graph = _safe(lambda: time_graph(lambda: fn(q, k, v)))
    row(f"fp16 sdpa ({best[1]})", best[0], fp16_bytes, best[2], 16, t_graph)

    dense = [DenseSeg(k, v, lens)]
    out = torch.empty_like(q)
    err = rel(kernels.decode_attention(q, dense), ref)
    t = time_eager(lambda: kernels.decode_attention(q, dense, out=out))
    t_graph = _safe(lambda: time_graph(lambda: kernels.decode_attention(q, dense, out=out))) if time_graph else None
    row("fp16 mmkv dense", t, fp16_bytes, err, 16, t_graph)

    seg = AlignedKV(block=64).quantize(k, v, lens)
    colmax = 2 * B * H * (n // 64) * D  # K and V
    scratch = 2 * B * HQ * n * 4 + colmax  # logits written + read (rule rows: three passes)
    for name, values, force in READS:
        s = dataclasses.replace(seg, values=values, force_bits=force)
        s1, q1 = first_row(s), q[:1]
        o1, _, lk, lv = aligned_decode(q1, s1)
        want = aligned_attention(q1.float(), s1)[0]
        err = rel(o1, want)
        bk, bv = bits_read(lk, s1.lens, 64), bits_read(lv, s1.lens, 64)
        one_pass = values == "full" or force  # fixed value widths: one pass, no logits scratch
        nbytes = int(B * H * n * D * (bk + bv) / 8) + (colmax if one_pass else scratch) + io_bytes
        t = time_eager(lambda s=s: kernels.decode_attention(q, [s], out=out))
        t_graph = (_safe(lambda s=s: time_graph(lambda: kernels.decode_attention(q, [s], out=out)))
                   if time_graph else None)
        row(name, t, nbytes, err, round((bk + bv) / 2, 3), t_graph)
        rows[-1].update(k_bits=bk, v_bits=bv)
    base = rows[0]["us"]
    for r in rows:
        r["speedup_vs_sdpa"] = base / r["us"] if r["us"] else float("nan")
    return rows


def _safe(fn):
    try:
        return fn()
    except Exception as e:  # a capture problem must not lose the eager numbers
        print(f"  (graph timing failed: {e!r:.200})")
        return float("nan")


def format_table(rows: list[dict], graphs: bool) -> str:
    head = "| shape | batch | n | read | us | " + ("graph us | " if graphs else "") + \
        "bits read (K+V avg) | K / V bits | GB/s | vs fp16 SDPA | rel. err |"
    out = [head, "|---|---:|---:|---|---:|" + ("---:|" if graphs else "") + "---:|---|---:|---:|---:|"]
    for r in rows:
        gcol = f"{r['us_graph']:.1f} | " if graphs and r.get("us_graph") is not None else ("- | " if graphs else "")
        kv = f"{r['k_bits']:.2f} / {r['v_bits']:.2f}" if r.get("k_bits") is not None else "-"
        out.append(f"| {r['shape']} | {r['batch']} | {r['n']} | {r['variant']} | {r['us']:.1f} | {gcol}"
                   f"{r['bits_read'] if r['bits_read'] else '-'} | {kv} | {r['gbs']:.0f} | {r['speedup_vs_sdpa']:.2f}x | "
                   f"{r['max_rel_err']:.1e} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=UserWarning)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/bench_alignedkv"))
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--shapes", default="smollm2,gqa8")
    ap.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (TRITON_INTERPRET=1): checks the plumbing")
    args = ap.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels under the Triton interpreter: set TRITON_INTERPRET=1")
        dev, lengths, batches, shapes = torch.device("cpu"), [64], [2], ["smollm2"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --smoke with TRITON_INTERPRET=1 on CPU)")
        dev = torch.device("cuda")
        lengths = [int(x) for x in args.lengths.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        shapes = args.shapes.split(",")
    info = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (Triton interpreter, smoke)",
            "torch": torch.__version__, "triton": triton.__version__, "date": datetime.date.today().isoformat(),
            "command": " ".join(sys.argv), "data": "synthetic K/V (random; see the module docstring)"}
    print(f"# {info['device']}, torch {info['torch']}, triton {info['triton']}; synthetic K/V")
    rows = []
    for shape in shapes:
        for B in batches:
            for n in lengths:
                rows += bench_case(shape, B, n, dev, args.smoke, args.graphs)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    table = format_table(rows, args.graphs and not args.smoke)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    (args.out / "bench_alignedkv.json").write_text(json.dumps({"info": info, "rows": clean}, indent=1))
    (args.out / "bench_alignedkv.md").write_text(table + "\n")
    return 0 if all(math.isfinite(r["max_rel_err"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
