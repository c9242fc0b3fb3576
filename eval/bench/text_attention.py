"""Text-segment decode attention (KIVI / XQuant layouts) vs fp16, and a sweep of the text kernel's tile knobs.

For a head layout (SmolLM2: 9 query / 3 KV heads, head_dim 64; InternVL2.5-8B's LM: 32 / 8, 128), each context n
and batch B times one decode-attention call over a single text segment: fp16 torch SDPA (fastest of the GQA
backends), mmkv's dense fp16 segment, and KIVI segments at 2 and 1 bits (group 32). Times are CUDA-graph replay
medians (``triton.testing.do_bench_cudagraph``; host launch cost removed, as in graph-replayed decoding), inputs
rotated over several sets so L2 does not hold them. ``--sweep`` first tries the text kernel's tile / warps /
pipeline-depth settings at B=16, n=32768 and uses the best one for the table. ``--ab`` times every KIVI cell under
several switch settings in one process (before/after on the same GPU), e.g. the merge launch's wide rounds against
the old ones:

    python -m eval.bench.text_attention --out results/text_kernels.json --sweep
    python -m eval.bench.text_attention --ab MMKV_MERGE_WIDE=0,1 --no-baselines --batches 1,16,64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F
import triton

import kernels
from kernels import testing
from kernels.reference import attention_over_segments
from kernels.testing import Rotator, median_us, n_sets, seg_bytes

from .switch_env import switches

LAYOUTS = {"smollm2": (9, 3, 64), "internvl2.5-8b": (32, 8, 128)}
DEV = "cuda"
L2 = 50 * 2**20


# (name, key bits, value bits): KIVI-2, XQuant's most common layer (2-bit keys, 1-bit values), KIVI-1
VARIANTS = (("kivi2", 2, 2), ("k2v1", 2, 1), ("kivi1", 1, 1))


def kivi(B, H, n, D, bits, group=32, v_bits=None):
    return testing.kivi_seg(B, H, n, D, n, bits, bits if v_bits is None else v_bits, group, group, device=DEV)


def dense(B, H, n, D):
    return testing.dense_seg(B, H, n, D, device=DEV)


def graph_us(make, call) -> tuple[float, int]:
    """Median CUDA-graph replay time of ``call(*inputs)`` rotating over input sets from ``make()``."""
    first = make()
    size = sum(seg_bytes(x, with_lens=True) if not isinstance(x, torch.Tensor) else x.numel() * x.element_size()
               for x in first)
    sets = [first] + [make() for _ in range(n_sets(size, least=1, most=5, l2_bytes=L2) - 1)]
    return median_us(Rotator(sets, call), graphs=True, rep=100), size


def sdpa(q, seg, H, G, D):
    return F.scaled_dot_product_attention(q.unsqueeze(2), seg.k, seg.v, enable_gqa=True)


def check(HQ, H, D, kw) -> float:
    g = torch.Generator(device=DEV).manual_seed(0)
    seg = kivi(2, H, 777, D, 2)
    q = torch.randn(2, HQ, D, device=DEV, dtype=torch.float16, generator=g)
    out = torch.full_like(q, float("nan"))
    kernels.decode_attention(q, [seg], out=out, **kw)
    ref = attention_over_segments(q.float().unsqueeze(2), [seg])[0].squeeze(2)
    return ((out.float() - ref).norm() / ref.norm()).item()


def measure(B, HQ, H, D, n, kw, variants=VARIANTS, baselines=True, ab=({},)) -> dict:
    """One table row. ``ab``: switch settings (environment variables; ``PPS``: programs per SM) to time each KIVI
    variant under, in turn, on the same inputs (``--ab``); the first setting's times are the row's
    ``<variant>_us``, setting i's ``..._us_i``."""
    def q():
        return torch.randn(B, HQ, D, device=DEV, dtype=torch.float16)

    def ours(qq, seg):
        return kernels.decode_attention(qq, [seg], **kw)

    def ours_ab(env):  # PPS in a setting: programs per SM for decode_attention, not an environment variable
        pps = {"programs_per_sm": float(env["PPS"])} if env.get("PPS", "") not in ("", "plan") else {}
        return lambda qq, seg: kernels.decode_attention(qq, [seg], **{**kw, **pps})

    row = {}
    row["sdpa_us"], row["fp16_bytes"] = graph_us(lambda: (q(), dense(B, H, n, D)),
                                                 lambda qq, seg: sdpa(qq, seg, H, HQ // H, D))
    if baselines:
        row["dense_us"], _ = graph_us(lambda: (q(), dense(B, H, n, D)), ours)
    for key, kb, vb in variants:
        for i, env in enumerate(ab):
            with switches({k: v for k, v in env.items() if k != "PPS"}):
                t, row[f"{key}_bytes"] = graph_us(lambda kb=kb, vb=vb: (q(), kivi(B, H, n, D, kb, v_bits=vb)),
                                                  ours_ab(env))
            row[f"{key}_us" + (f"_{i}" if i else "")] = t
    if baselines:
        with switches({"MMKV_TEXT_GLUON": "0"}):  # the Triton kernel on the same shapes, side by side
            row["kivi2_triton_us"], _ = graph_us(lambda: (q(), kivi(B, H, n, D, 2)), ours)
    return row


def ab_settings(specs: list[str]) -> list[dict]:
    """``["MMKV_MERGE_WIDE=0,1", "MMKV_TEXT_WARPS=2,4"]`` -> every combination, the first value of each first.
    Names joined by ``:`` take values joined by ``:`` together: ``A:B=0:0,1:8`` is the two settings (A=0, B=0) and
    (A=1, B=8), not their four combinations."""
    out = [{}]
    for spec in specs:
        name, _, values = spec.partition("=")
        if not name or not values:
            raise ValueError(f"--ab takes NAME=v1,v2,..., got {spec!r}")
        names = name.split(":")
        sets = [v.split(":") for v in values.split(",")]
        if any(len(v) != len(names) for v in sets):
            raise ValueError(f"--ab {spec!r}: each value needs one part per name ({len(names)})")
        out = [dict(o, **dict(zip(names, v, strict=True))) for o in out for v in sets]
    return out


def measure_extend(B, HQ, H, D, n, tq) -> dict:
    """``tq`` new tokens over ``n`` stored ones: fp16 SDPA over all ``n + tq`` tokens (causal for the new ones) vs
    mmkv's extend path over a KIVI-2 segment (``kernels/decode/extend.py``: stored tokens and the new tokens' causal
    part, merged), as chosen by its rows rule and with each of its two history reads forced (decode kernels with
    the tokens folded into query rows; the tile kernel over chunks dequantized to scratch)."""
    from kernels.decode.extend import extend_attention

    def q():
        return torch.randn(B, HQ, tq, D, device=DEV, dtype=torch.float16)

    def full(qq, seg, kn, vn):
        k = torch.cat([seg.k, kn], 2)
        v = torch.cat([seg.v, vn], 2)
        mask = torch.ones(tq, n + tq, dtype=torch.bool, device=DEV).tril(n)
        return F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True)

    def new():
        return (torch.randn(B, H, tq, D, device=DEV, dtype=torch.float16),
                torch.randn(B, H, tq, D, device=DEV, dtype=torch.float16))

    row = {}
    row["sdpa_us"], _ = graph_us(lambda: (q(), dense(B, H, n, D), *new()), full)
    for key, tile in (("kivi2_us", None), ("kivi2_fold_us", False), ("kivi2_tile_us", True)):
        row[key], _ = graph_us(lambda: (q(), kivi(B, H, n, D, 2), *new()),
                               lambda qq, seg, kn, vn, tile=tile: extend_attention(qq, [seg], kn, vn, tile=tile))
    return row


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", category=UserWarning)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/text_kernels.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="head layouts, of " + ", ".join(LAYOUTS))
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS), help="KIVI variants, of kivi2, k2v1, kivi1")
    ap.add_argument("--no-baselines", action="store_true", help="skip the mmkv fp16 and Triton-kernel columns")
    ap.add_argument("--ab", action="append", default=[], help="NAME=v1,v2,...: time every KIVI cell under each "
                    "switch setting in turn (repeatable: every combination), the first one the table's; PPS=... "
                    "sets decode_attention's programs_per_sm instead (plan: the plan's); A:B=a1:b1,a2:b2 sets "
                    "several switches together")
    ap.add_argument("--extend", default="", help="new-token counts, e.g. 16,128,512: the extend table instead "
                    "(InternVL heads, over --contexts and --batches)")
    args = ap.parse_args(argv)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
            "copy_gb_s": testing.copy_bandwidth()}  # what the GB/s columns are a fraction of
    if args.extend:
        HQ, H, D = LAYOUTS["internvl2.5-8b"]
        rows = []
        print("| B | n | new tokens | fp16 SDPA us | mmkv KIVI-2 extend us | x SDPA | folded us | tile us |\n"
              "|---:|---:|---:|---:|---:|---:|---:|---:|")
        for B in map(int, args.batches.split(",")):
            for n in map(int, args.contexts.split(",")):
                for tq in map(int, args.extend.split(",")):
                    r = {"B": B, "n": n, "tq": tq, **measure_extend(B, HQ, H, D, n, tq)}
                    rows.append(r)
                    print(f"| {B} | {n} | {tq} | {r['sdpa_us']:.1f} | {r['kivi2_us']:.1f} | "
                          f"{r['sdpa_us'] / r['kivi2_us']:.2f} | {r['kivi2_fold_us']:.1f} | {r['kivi2_tile_us']:.1f} |",
                          flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"info": info, "extend": rows}, f, indent=1)
        return 0
    kw = {}
    if args.sweep:
        HQ, H, D = LAYOUTS["smollm2"]
        best, sweep = (float("inf"), {}), []
        for tile in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    cfg = dict(text_tile=tile, text_warps=warps, text_stages=stages)
                    try:
                        err = check(HQ, H, D, cfg)
                        t, _ = graph_us(lambda: (torch.randn(16, HQ, D, device=DEV, dtype=torch.float16),
                                                 kivi(16, H, 32768, D, 2)),
                                        lambda q, s, cfg=cfg: kernels.decode_attention(q, [s], **cfg))
                    except Exception as e:  # a config the compiler rejects (registers, shared memory)
                        sweep.append({**cfg, "error": repr(e)[:200]})
                        continue
                    sweep.append({**cfg, "us": t, "rel_err": err})
                    print(f"sweep tile={tile} warps={warps} stages={stages}: {t:.1f} us, rel err {err:.1e}", flush=True)
                    if t < best[0] and err < 2e-3:
                        best = (t, cfg)
        kw = best[1]
        info["sweep"], info["best"] = sweep, kw
        print("# table config:", kw, flush=True)
    variants = [v for v in VARIANTS if v[0] in args.variants.split(",")]
    ab = ab_settings(args.ab)
    info["ab"] = ab
    rows = []
    for name in args.layouts.split(","):
        HQ, H, D = LAYOUTS[name]
        for n in map(int, args.contexts.split(",")):
            for B in map(int, args.batches.split(",")):
                row = {"layout": name, "B": B, "n": n,
                       **measure(B, HQ, H, D, n, kw, variants, not args.no_baselines, ab)}
                rows.append(row)
                cells = [f"{k} " + " / ".join(f"{row[k + '_us' + (f'_{i}' if i else '')]:7.1f}"
                                              for i in range(len(ab)))
                         + f" ({row['sdpa_us'] / row[k + '_us']:.2f}x)" for k, _, _ in variants]
                print(f"{name:15s} B={B:3d} n={n:6d}  sdpa {row['sdpa_us']:7.1f}  "
                      + (f"mmkv fp16 {row['dense_us']:7.1f}  " if "dense_us" in row else "") + "  ".join(cells)
                      + (f"  kivi2 triton {row['kivi2_triton_us']:7.1f} us" if "kivi2_triton_us" in row else ""),
                      flush=True)
    if len(ab) > 1:
        print("\nus per switch setting (" + " / ".join(" ".join(f"{k}={v}" for k, v in e.items()) for e in ab) + ")")
        for r in rows:
            print(f"| {r['layout']} | {r['B']} | {r['n']} | {r['sdpa_us']:.1f} | " + " | ".join(
                " / ".join(f"{r[k + '_us' + (f'_{i}' if i else '')]:.1f}" for i in range(len(ab))) + " ("
                + " / ".join(f"{r['sdpa_us'] / r[k + '_us' + (f'_{i}' if i else '')]:.2f}x" for i in range(len(ab)))
                + ")" for k, _, _ in variants) + " |")
    print(f"\ncopy bandwidth {info['copy_gb_s']:.0f} GB/s (a 1 GiB device copy, read + write)")
    if args.no_baselines or len(variants) < len(VARIANTS):
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
        return 0
    print("\n| layout | B | n | fp16 SDPA us | mmkv fp16 us | KIVI-2 us (x SDPA, GB/s, % copy) | K2/V1 us (...) "
          "| KIVI-1 us (...) | KIVI-2 Triton kernel us (x SDPA) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [f"{r[f'{k}_us']:.1f} ({r['sdpa_us'] / r[f'{k}_us']:.2f}x, {r[f'{k}_bytes'] / r[f'{k}_us'] / 1e3:.0f}, "
                 f"{100 * r[f'{k}_bytes'] / r[f'{k}_us'] / 1e3 / info['copy_gb_s']:.0f}%)" for k, _, _ in VARIANTS]
        print(f"| {r['layout']} | {r['B']} | {r['n']} | {r['sdpa_us']:.1f} | {r['dense_us']:.1f} | "
              + " | ".join(cells) + f" | {r['kivi2_triton_us']:.1f} ({r['sdpa_us'] / r['kivi2_triton_us']:.2f}x) |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
