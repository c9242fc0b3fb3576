"""SKVQ decode-attention kernel: variable vs fixed-size groups after the reorder, against KIVI and fp16 segments.

For each shape (batch x tokens, model shape) every layout below holds the same ``n`` tokens of one layer and
``kernels.decode_attention`` is timed on it (median of ``--iters`` calls, CUDA events; ``--graphs`` replays a
captured CUDA graph, which removes the host cost that dominates small calls):

* ``fp16``: a dense segment (what the fp16 cache reads);
* ``kivi-2``: the KIVI/XQuant layout at 2 bits, group 32;
* ``skvq-K2V2-g{G}-{nat,var,fix}``: natural-order fixed groups (RTN / ``reorder=off``), reordered variable
  groups (per-channel group ids), reordered fixed groups (no group-id load) — the comparison the issue asks for;
* ``skvq-K2V1.5-g{G}-var[-fp8]``: ternary values, fp16 or FP8 scales;
* ``--kernels gluon,triton``: each SKVQ layout once per kernel (``MMKV_SKVQ_GLUON``); Triton rows are
  suffixed ``-triton``. On the GPU the SKVQ segments are drawn on the device (random code bytes: every byte is a
  valid 1/2-bit code), so large shapes do not wait on the CPU.

Prints a table (us per call, GB/s of segment bytes read) and writes JSON. ``--smoke`` runs tiny shapes on the CPU
(torch reference path) so that a test exercises the machinery.

    python -m eval.bench.skvq_attention --tokens 16384 --batches 1,16 --groups 64,32 --graphs --out results/skvq_kernel.json
    python -m eval.bench.skvq_attention --shapes internvl2.5-8b,smollm2-135m --tokens 4096,32768 --batches 1,16,64 \
        --groups 128,64 --variants var,fix --kernels gluon,triton --graphs --out results/skvq_gluon.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from kernels import testing
from kernels.layouts import SkvqSeg
from kernels.testing import event_median_s, median_us
from mmkv.cache import segments as S

from ..jsonout import save_json
from .switch_env import parse_variants, switches

# (query heads, KV heads, head_dim); InternVL2.5-8B's language model has Llama-8B's heads
SHAPES = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128), "internvl2.5-8b": (32, 8, 128)}


def _device_side(b, h, n, d, bits, ng, fixed, perm, fp8, g):
    """One side of a random SKVQ segment drawn on ``g``'s (CUDA) device: code bytes, scale/zero, perm, gid."""
    dev = g.device
    nb = -(-d // 5) if bits == 1.5 else d * int(bits) // 8
    codes = torch.randint(0, 243 if bits == 1.5 else 256, (b, h, n, nb), generator=g, device=dev, dtype=torch.uint8)
    scale = torch.rand(b, h, n, ng, generator=g, device=dev) * 0.1 + 0.02
    zero = torch.randn(b, h, n, ng, generator=g, device=dev)
    dt = torch.float8_e4m3fn if fp8 else torch.float16
    p = torch.stack([torch.randperm(d, generator=g, device=dev) for _ in range(h)]).to(torch.uint8) if perm else None
    gid = testing.random_groups(h, d, ng).to(dev) if not fixed else \
        (torch.arange(d, device=dev) // (d // ng)).to(torch.uint8).expand(h, d).contiguous()
    return codes, scale.to(dt), zero.to(dt), p, gid, (d // ng if fixed else 0)


def skvq_segment(b, h, n, d, k_bits, v_bits, group, variant, fp8, device, g, gd=None):
    """An SKVQ segment: ``nat`` natural order, fixed groups; ``var`` reordered, variable groups; ``fix`` reordered,
    fixed groups. kernels.testing's (drawn on the CPU) unless ``gd``, a generator on the GPU."""
    ng = d // group
    fixed, perm = variant != "var", variant != "nat"
    if gd is None:
        return testing.skvq_seg(b, h, n, d, n, k_bits, v_bits, ng, fixed=fixed, perm=perm, fp8=fp8, g=g,
                                device=device)
    kc, ks, kz, kp, kg, kf = _device_side(b, h, n, d, k_bits, ng, fixed, perm, fp8, gd)
    vc, vs, vz, vp, vg, vf = _device_side(b, h, n, d, v_bits, ng, fixed, perm, fp8, gd)
    return SkvqSeg(kc, None, ks, kz, vc, None, vs, vz, k_bits, float(v_bits), kp, kg, kf, vp, vg, vf,
                   torch.full((b,), n, dtype=torch.int32, device=device))


def layouts(b, h, n, d, groups, device, dtype, variants=("nat", "var", "fix")):
    """name -> (segment, whether it has a Gluon kernel to compare)."""
    g = torch.Generator().manual_seed(0)
    gd = torch.Generator(device=device).manual_seed(0) if torch.device(device).type == "cuda" else None
    out = {"fp16": (testing.dense_seg(b, h, n, d, n, dtype=dtype, g=g, device=device), False),
           "kivi-2": (testing.kivi_seg(b, h, n, d, n, g=g, device=device), False)}
    for grp in dict.fromkeys(min(x, d) for x in groups):
        vs = [v for v in variants if d // grp > 1 or v == "nat"] or ["nat"]
        for v in vs:
            out[f"skvq-K2V2-g{grp}-{v}"] = (skvq_segment(b, h, n, d, 2, 2.0, grp, v, False, device, g, gd), True)
        v = "var" if "var" in vs else vs[0]
        out[f"skvq-K2V1.5-g{grp}-{v}"] = (skvq_segment(b, h, n, d, 2, 1.5, grp, v, False, device, g, gd), True)
        out[f"skvq-K2V1.5-g{grp}-{v}-fp8"] = (skvq_segment(b, h, n, d, 2, 1.5, grp, v, True, device, g, gd), True)
    return out


def _timed(fn, iters, device, graphs, gluon: bool | None, env: dict | None = None, timer: str = "events") -> float:
    env = dict(env or {})
    if gluon is not None:
        env["MMKV_SKVQ_GLUON"] = "1" if gluon else "0"
    with switches(env):
        if timer == "unrolled" and graphs:
            return median_us(fn, graphs=True, rep=iters) / 1e6
        return event_median_s(fn, iters, device, graphs)


def run(shape: str, batches, tokens, groups, iters: int, device, graphs: bool, variants=("nat", "var", "fix"),
        kernels_=("gluon",), ab=(("", {}),), timer: str = "events") -> list[dict]:
    hq, h, d = SHAPES[shape]
    rows = []

    def row(b, n, name, sec, nbytes):
        rows.append({"shape": shape, "batch": b, "tokens": n, "layout": name, "us": sec * 1e6,
                     "segment_bytes": nbytes, "gb_per_s": nbytes / sec / 1e9})
        print(f"{shape} b={b:3d} n={n:6d} {name:34s} {sec * 1e6:9.1f} us  {nbytes / sec / 1e9:7.1f} GB/s", flush=True)

    for n in tokens:
        for b in batches:
            q = torch.randn(b, hq, d, device=device, dtype=torch.float16)
            out = torch.empty_like(q)
            if torch.device(device).type == "cuda":
                k = torch.randn(b, h, n, d, device=device, dtype=torch.float16)
                v = torch.randn_like(k)
                sec = _timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q[:, :, None], k, v, enable_gqa=True), iters, device, graphs, None, None, timer)
                row(b, n, "sdpa", sec, 2 * k.numel() * k.element_size())
                del k, v
            for name, (seg, has_gluon) in layouts(b, h, n, d, groups, device, torch.float16, variants).items():
                nbytes = S.nbytes(seg)
                fn = lambda seg=seg, q=q, out=out: kernels.decode_attention(q, [seg], out=out)  # noqa: E731
                for kern in (kernels_ if has_gluon else (None,)):
                    for tag, env in (ab if kern == "gluon" else (("", {}),)):
                        sec = _timed(fn, iters, device, graphs, None if kern is None else kern == "gluon", env,
                                     timer)
                        row(b, n, name + ("-triton" if kern == "triton" else "") + (f"@{tag}" if tag else ""), sec,
                            nbytes)
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict], label: str) -> str:
    base_name = "sdpa" if any(r["layout"] == "sdpa" for r in rows) else "fp16"
    out = [f"SKVQ decode attention, one layer, {label}",
           f"| shape | batch | tokens | layout | us/call | segment MB | GB/s | x {base_name} |",
           "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        base = next(x for x in rows if x["layout"] == base_name and x["batch"] == r["batch"]
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
    ap.add_argument("--variants", default="nat,var,fix", help="SKVQ K2V2 channel orders/groupings to time")
    ap.add_argument("--kernels", default="gluon", help="gluon,triton: time each 1/2-bit SKVQ layout per kernel")
    ap.add_argument("--ab", default="", help="name:MMKV_X=v;MMKV_Y=w,name2:... switch variants of the Gluon kernel, "
                    "each SKVQ layout timed once per variant (rows suffixed @name)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (no host overhead)")
    ap.add_argument("--timer", choices=("events", "unrolled"), default="events",
                    help="with --graphs: events = median of --iters replays of a one-call graph; unrolled = "
                    "triton's do_bench_cudagraph, calls back to back in one graph for --iters ms, as "
                    "text_attention times (a decode step's graph; the one-call replays of a few-us call move by "
                    "up to 5 us between captures)")
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
        rows += run(shape, batches, tokens, groups, iters, device, args.graphs and device.type == "cuda",
                    tuple(args.variants.split(",")), tuple(args.kernels.split(",")),
                    parse_variants(args.ab) or (("", {}),), args.timer)
    label = (torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke (torch reference, not a timing)")
    if device.type == "cuda":
        import triton

        label += f", triton {triton.__version__}"
    label += f", torch {torch.__version__}" + (", CUDA graphs" if args.graphs and device.type == "cuda" else "")
    label += ", unrolled graphs (do_bench_cudagraph)" if args.timer == "unrolled" and args.graphs else ""
    print(format_table(rows, label))
    save_json(args.out, {"label": label, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
