"""Side-by-side timing of AlignedKV rule-path variants in one process, at one shape of
``eval/bench/alignedkv_attention.py`` (same synthetic K/V, same segment): fp16 SDPA (cuDNN, GQA) and each variant
as CUDA-graph replay medians (``do_bench_cudagraph``), the variants in turn and then again in reverse order, so
that drift between them shows. A variant sets environment switches (``MMKV_ALIGNED_KEYS=tile``, ...) and/or the
segment's ``values`` / ``force_bits``. Each variant's widths on the first batch row must equal the reference's
(``reference.aligned_attention``) on >= 99% of (block, channel) pairs, and its output must match it.

    python -m eval.bench.alignedkv_ab --variants "tile:MMKV_ALIGNED_KEYS=tile;MMKV_ALIGNED_VALUES=tile,phase:" \\
        --batch 16 --n 32768 --out results/alignedkv_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys

import torch
import triton

import kernels
from eval.bench.alignedkv_attention import SHAPES, make_kv, sdpa_variants
from eval.bench.switch_env import parse_variants, switches
from kernels.decode.alignedkv import aligned_decode
from kernels.reference import aligned_attention, bits_read
from kernels.testing import map_tensors, median_us
from mmkv.methods.alignedkv import AlignedKV

SEG_KEYS = {"keys": str, "values": str, "force_bits": int}  # segment fields a variant may set; ``pps``: programs_per_sm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", required=True, help="name:ENV=V;values=paper;force_bits=8;pps=6,name2:...")
    ap.add_argument("--shape", default="gqa8", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", action="store_true", help="no timing: two calls per variant (run it under ncu)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    HQ, H, D = SHAPES[args.shape]
    B, n, G = args.batch, args.n, HQ // H
    g = torch.Generator(device=dev).manual_seed(B * 7 + n)  # the attention bench's data at this shape
    k, v = make_kv(B, H, n, D, dev, g)
    q = torch.randn(B, HQ, D, generator=g, device=dev).half()
    lens = torch.full((B,), n, dtype=torch.int32, device=dev)
    seg = AlignedKV(block=64).quantize(k, v, lens)
    sdpa = sdpa_variants(G, H)["gqa/cudnn"]
    out = torch.empty_like(q)
    res = {"sdpa": [] if args.profile else [median_us(lambda: sdpa(q, k, v), True)]}
    variants = parse_variants(args.variants)
    info = {}
    for name, env in variants:
        segkw = {kk: SEG_KEYS[kk](env.pop(kk)) for kk in list(env) if kk in SEG_KEYS}
        call = {"programs_per_sm": float(env.pop("pps"))} if "pps" in env else {}
        s = dataclasses.replace(seg, **segkw)
        with switches(env):
            s1, q1 = map_tensors(s, lambda t: t[:1]), q[:1]
            o1, _, lk, lv = aligned_decode(q1, s1)
            ref, _, rk, rv = aligned_attention(q1.float(), s1)
            err = ((o1 - ref).norm() / ref.norm()).item()
            agree = min((lk == rk).float().mean().item(), (lv == rv).float().mean().item())
            info[name] = dict(env=env, seg=segkw, call=call, rel_err=err, width_agreement=agree,
                              k_bits=bits_read(lk, s1.lens, 64), v_bits=bits_read(lv, s1.lens, 64))
        info[name]["seg_obj"] = s
    if args.profile:  # for ncu: two plain calls per variant, nothing else launched after the checks
        for nm, _ in variants:
            with switches(info[nm]["env"]):
                for _ in range(2):
                    kernels.decode_attention(q, [info[nm]["seg_obj"]], out=out, **info[nm]["call"])
        torch.cuda.synchronize()
        return 0
    order = [nm for nm, _ in variants]
    for nm in order + order[::-1]:
        with switches(info[nm]["env"]):
            s, kw = info[nm]["seg_obj"], info[nm]["call"]
            res.setdefault(nm, []).append(median_us(lambda s=s, kw=kw: kernels.decode_attention(q, [s], out=out, **kw),
                                                    True))
    res["sdpa"].append(median_us(lambda: sdpa(q, k, v), True))
    sd = statistics.median(res["sdpa"])
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.shape} B{B} n{n}; graph replay medians (us), each variant twice (forward, reverse order)")
    print("| variant | us (runs) | vs SDPA | K / V bits | widths agree | rel. err |\n|---|---|---:|---|---:|---:|")
    print(f"| fp16 SDPA (cuDNN GQA) | {sd:.1f} ({', '.join(f'{t:.1f}' for t in res['sdpa'])}) | 1.00x | | | |")
    rows = []
    for nm in order:
        t = statistics.median(res[nm])
        i = info[nm]
        print(f"| {nm} | {t:.1f} ({', '.join(f'{x:.1f}' for x in res[nm])}) | {sd / t:.2f}x | "
              f"{i['k_bits']:.2f} / {i['v_bits']:.2f} | {i['width_agreement']:.4f} | {i['rel_err']:.1e} |")
        rows.append({"variant": nm, "us": t, "runs": res[nm], "speedup_vs_sdpa": sd / t,
                     **{kk: vv for kk, vv in i.items() if kk != "seg_obj"}})
    ok = all(r["width_agreement"] >= 0.99 and r["rel_err"] < 2e-3 for r in rows)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "shape": args.shape,
                "batch": B, "n": n, "sdpa_us": sd, "sdpa_runs": res["sdpa"]}
        with open(args.out, "w") as f:
            json.dump({"info": meta, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
