"""Launch the SKVQ decode kernel a fixed number of times per layout, for a profiler (ncu) to pick launches by index.

Each named layout (``skvq_attention``'s names, e.g. ``skvq-K2V1.5-g64-var-fp8``) is built once, called ``--warm``
times (compilation, caches), then ``--calls`` times; with ``ncu -k regex:_skvq_kernel --launch-skip W`` the
profiled launches are the timed calls of each layout in the order given. Prints the launch index each layout's
first timed call has. Env switches (``MMKV_*``) given as ``NAME=VALUE[;...]`` per layout after a colon, set for
that layout's launches only: ``skvq-K2V1.5-g64-var-fp8:MMKV_SKVQ_TERN_LOAD=bytes``.

    ncu --clock-control none -k regex:_skvq_kernel --launch-skip 3 --launch-count 3 --set full \\
        python -m eval.bench.skvq_profile --layouts skvq-K2V2-g64-var,skvq-K2V1.5-g64-var-fp8 --warm 1 --calls 1
"""

from __future__ import annotations

import argparse

import torch

import kernels

from .skvq_attention import SHAPES, skvq_segment
from .switch_env import parse_variants, switches


def _layout(name: str, b: int, h: int, n: int, d: int, g, gd):
    parts = name.split("-")  # skvq-K2V1.5-g64-var[-fp8]
    kb, vb = parts[1][1:].split("V")
    grp = int(parts[2][1:])
    return skvq_segment(b, h, n, d, int(kb), float(vb), grp, parts[3], parts[-1] == "fp8", "cuda", g, gd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="internvl2.5-8b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layouts", default="skvq-K2V2-g64-var,skvq-K2V1.5-g64-var-fp8")
    ap.add_argument("--warm", type=int, default=1)
    ap.add_argument("--calls", type=int, default=1)
    args = ap.parse_args(argv)
    hq, h, d = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    gd = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    runs = [(name, env, _layout(name, args.batch, h, args.tokens, d, g, gd))
            for name, env in parse_variants(args.layouts)]
    for _name, env, seg in runs:  # warm-up launches first, so the profiled ones are contiguous
        with switches(env):
            for _ in range(args.warm):
                kernels.decode_attention(q, [seg], out=out)
    torch.cuda.synchronize()
    idx = len(runs) * args.warm
    for name, env, seg in runs:
        print(f"launch {idx}: {name} {env or ''}", flush=True)
        with switches(env):
            for _ in range(args.calls):
                kernels.decode_attention(q, [seg], out=out)
        idx += args.calls
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
