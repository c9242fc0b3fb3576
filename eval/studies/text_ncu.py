"""One decode attention call over a KIVI segment, for Nsight Compute: the plan's kernels are compiled and launched
(so the whole-wave split rule, which needs a compiled variant, plans as in the bench) before the profiled call,
which runs between ``cudaProfilerStart`` and ``cudaProfilerStop``.

    ncu --profile-from-start off --clock-control none -k regex:"_text_kernel|_merge_kernel" \\
        python -m eval.studies.text_ncu --layout internvl2.5-8b --B 1 --n 32768 --variant kivi2

``--env NAME=V`` (repeatable) sets switches for the profiled call only (the warm-up calls run under them too).
"""

from __future__ import annotations

import argparse
import os

import torch

import kernels
from eval.bench.text_attention import LAYOUTS, VARIANTS, kivi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="internvl2.5-8b", choices=list(LAYOUTS))
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--variant", default="kivi2", choices=[v[0] for v in VARIANTS])
    ap.add_argument("--env", action="append", default=[])
    args = ap.parse_args(argv)
    for e in args.env:
        k, _, v = e.partition("=")
        os.environ[k] = v
    HQ, H, D = LAYOUTS[args.layout]
    _, kb, vb = next(v for v in VARIANTS if v[0] == args.variant)
    q = torch.randn(args.B, HQ, D, device="cuda", dtype=torch.float16)
    seg = kivi(args.B, H, args.n, D, kb, v_bits=vb)
    for _ in range(3):
        kernels.decode_attention(q, [seg])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    kernels.decode_attention(q, [seg])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {args.layout} B{args.B} n{args.n} {args.variant} env={args.env}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
