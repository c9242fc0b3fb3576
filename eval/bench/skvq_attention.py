"""SKVQ decode-attention kernel: variable vs fixed-size groups after the reorder, against KIVI and fp16 segments.

For each shape (batch x tokens, model shape) every layout below holds the same ``n`` tokens of one layer and
``kernels.decode_attention`` is timed on it (median of ``--iters`` calls, CUDA events; ``--graphs`` replays a
captured CUDA graph, which removes the host cost that dominates small calls):

* ``fp16``: a dense segment (what the fp16 cache reads);
* ``kivi-2``: the KIVI/XQuant layout at 2 bits, group 32;
* ``skvq-K2V2-g{G}-{nat,var,fix}``: natural-order fixed groups (RTN / ``reorder=off``), reordered variable
  groups (per-channel group ids), reordered fixed groups (no group-id load) — the comparison the issue asks for;
* ``skvq-K2V1.5-g{G}-var[-fp8]``: ternary values, FP8 scales.

Prints a table (us per call, GB/s of segment bytes read) and writes JSON. ``--smoke`` runs tiny shapes on the CPU
(torch reference path) so that a test exercises the machinery.

    python -m eval.bench.skvq_attention --tokens 16384 --batches 1,16 --groups 64,32 --graphs --out results/skvq_kernel.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import kernels
from kernels import testing
from kernels.testing import event_median_s
from mmkv.cache import segments as S

from ..jsonout import save_json

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}  # (query heads, KV heads, head_dim)


def skvq_segment(b, h, n, d, k_bits, v_bits, group, variant, fp8, device, g):
    """kernels.testing's SKVQ segment: ``nat`` natural order, fixed groups; ``var`` reordered, variable groups;
    ``fix`` reordered, fixed groups."""
    return testing.skvq_seg(b, h, n, d, n, k_bits, v_bits, d // group, fixed=variant != "var",
                            perm=variant != "nat", fp8=fp8, g=g, device=device)


def layouts(b, h, n, d, groups, device, dtype):
    g = torch.Generator().manual_seed(0)
    out = {"fp16": testing.dense_seg(b, h, n, d, n, dtype=dtype, g=g, device=device),
           "kivi-2": testing.kivi_seg(b, h, n, d, n, g=g, device=device)}
    for grp in groups:
        grp = min(grp, d)
        variants = ("nat", "var", "fix") if d // grp > 1 else ("nat",)
        for v in variants:
            out[f"skvq-K2V2-g{grp}-{v}"] = skvq_segment(b, h, n, d, 2, 2.0, grp, v, False, device, g)
        v = variants[1] if len(variants) > 1 else "nat"
        out[f"skvq-K2V1.5-g{grp}-{v}"] = skvq_segment(b, h, n, d, 2, 1.5, grp, v, False, device, g)
        out[f"skvq-K2V1.5-g{grp}-{v}-fp8"] = skvq_segment(b, h, n, d, 2, 1.5, grp, v, True, device, g)
    return out


def run(shape: str, batches, tokens, groups, iters: int, device, graphs: bool) -> list[dict]:
    hq, h, d = SHAPES[shape]
    rows = []
    for n in tokens:
        for b in batches:
            q = torch.randn(b, hq, d, device=device, dtype=torch.float16)
            out = torch.empty_like(q)
            for name, seg in layouts(b, h, n, d, groups, device, torch.float16).items():
                sec = event_median_s(lambda seg=seg, q=q, out=out: kernels.decode_attention(q, [seg], out=out), iters,
                                device, graphs)
                nbytes = S.nbytes(seg)
                rows.append({"shape": shape, "batch": b, "tokens": n, "layout": name, "us": sec * 1e6,
                             "segment_bytes": nbytes, "gb_per_s": nbytes / sec / 1e9})
                print(f"{shape} b={b:3d} n={n:6d} {name:28s} {sec * 1e6:9.1f} us  {nbytes / sec / 1e9:7.1f} GB/s",
                      flush=True)
    return rows


def format_table(rows: list[dict], label: str) -> str:
    out = [f"SKVQ decode attention, one layer, {label}",
           "| shape | batch | tokens | layout | us/call | segment MB | GB/s | x fp16 |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        base = next(x for x in rows if x["layout"] == "fp16" and x["batch"] == r["batch"]
                    and x["tokens"] == r["tokens"] and x["shape"] == r["shape"])
        out.append(f"| {r['shape']} | {r['batch']} | {r['tokens']} | {r['layout']} | {r['us']:.1f} | "
                   f"{r['segment_bytes'] / 1e6:.2f} | {r['gb_per_s']:.0f} | {base['us'] / r['us']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama-8b")
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--groups", default="64,32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (no host overhead)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (torch reference path)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        device, tokens, batches, iters = torch.device("cpu"), [96], [2], 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_skvq_kernel times GPU kernels; use --smoke on a CPU")
        device = torch.device("cuda")
        tokens = [int(x) for x in args.tokens.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        iters = args.iters
    groups = [int(x) for x in args.groups.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        rows += run(shape, batches, tokens, groups, iters, device, args.graphs and device.type == "cuda")
    label = (torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke (torch reference, not a timing)")
    label += f", torch {torch.__version__}" + (", CUDA graphs" if args.graphs and device.type == "cuda" else "")
    print(format_table(rows, label))
    save_json(args.out, {"label": label, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
