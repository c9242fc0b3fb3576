"""Register cap of the Gluon text kernel (``MMKV_TEXT_REGS``, with q read back from shared memory each iteration)
and its L2 prefetch distance (``MMKV_TEXT_PREFETCH``): graph-replay medians of one decode attention call per layout,
every configuration timed on the same input sets in one process (same GPU), with its error against the plan's own
output on the first set.

    python -m eval.studies.text_regs_sweep --d128 plan:,0:128,1:128,0:168 --d64 plan:,0:128,0:96

A configuration is ``PREFETCH:REGS`` (empty: the plan's choice); ``plan:`` is the kernel the plan picks.
``--profile`` instead splits one call into its kernels' device times (torch profiler; InternVL heads, B1 and B16 at
n = 32768), uncapped vs capped.
"""

from __future__ import annotations

import argparse
import os

import torch

import kernels
from eval.bench.text_attention import L2, LAYOUTS, VARIANTS, kivi
from kernels.testing import Rotator, median_us, n_sets, seg_bytes

SHAPES = (("internvl2.5-8b", 16, 32768), ("internvl2.5-8b", 64, 32768), ("internvl2.5-8b", 1, 32768),
          ("internvl2.5-8b", 64, 4096), ("smollm2", 16, 32768), ("smollm2", 64, 32768))


def _set(cfg: str) -> None:
    pfd, regs = cfg.split(":")
    for name, v in (("MMKV_TEXT_PREFETCH", pfd), ("MMKV_TEXT_REGS", regs)):
        if v in ("", "plan"):
            os.environ.pop(name, None)
        else:
            os.environ[name] = v


def profile_split() -> None:
    """Per-kernel device time of one decode attention call (text kernel, merge), uncapped vs capped."""
    from torch.profiler import ProfilerActivity, profile

    HQ, H, D = LAYOUTS["internvl2.5-8b"]
    for B, n, kb, vb in ((1, 32768, 2, 2), (16, 32768, 2, 2), (16, 32768, 1, 1)):
        for cfg in ("plan:0", "0:128" if kb == 2 else "0:168"):
            _set(cfg)
            q = torch.randn(B, HQ, D, device="cuda", dtype=torch.float16)
            s = kivi(B, H, n, D, kb, v_bits=vb)
            for _ in range(5):
                kernels.decode_attention(q, [s])
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(20):
                    kernels.decode_attention(q, [s])
                torch.cuda.synchronize()
            ev = [(e.key, e.device_time_total / e.count, e.count) for e in p.key_averages() if e.device_time_total > 0]
            print(f"B{B} n{n} k{kb}v{vb} {cfg}: " + "; ".join(f"{k[:40]} {t:.1f}us x{c}" for k, t, c in ev), flush=True)
    _set("plan:")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d128", default="plan:,0:128,1:128,0:168")
    ap.add_argument("--d64", default="plan:,0:128,0:96")
    ap.add_argument("--shapes", default="", help="indices into SHAPES, comma-separated (default: all)")
    ap.add_argument("--profile", action="store_true", help="per-kernel device times instead of the sweep")
    args = ap.parse_args(argv)
    if args.profile:
        profile_split()
        return 0
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    for name, B, n in shapes:
        HQ, H, D = LAYOUTS[name]
        cfgs = (args.d128 if D == 128 else args.d64).split(",")
        for var, kb, vb in VARIANTS:
            def make(B=B, HQ=HQ, H=H, n=n, D=D, kb=kb, vb=vb):
                return torch.randn(B, HQ, D, device="cuda", dtype=torch.float16), kivi(B, H, n, D, kb, v_bits=vb)
            first = make()
            size = first[0].numel() * 2 + seg_bytes(first[1], with_lens=True)
            sets = [first] + [make() for _ in range(n_sets(size, least=1, most=5, l2_bytes=L2) - 1)]
            cells = []
            ref = None
            for cfg in cfgs:
                _set(cfg)
                out = kernels.decode_attention(*first[:1], [first[1]]).float()
                ref = out if ref is None else ref
                err = ((out - ref).norm() / ref.norm()).item()
                t = median_us(Rotator(sets, lambda q, s: kernels.decode_attention(q, [s])), graphs=True, rep=100)
                cells.append(f"{cfg:>7s} {t:7.1f}" + (f" e{err:.0e}" if err > 1e-3 else ""))
            _set("plan:")
            del sets, first
            print(f"{name:15s} B={B:3d} n={n:6d} {var:6s} " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
