"""L2 prefetch distance of the Gluon text kernel (``MMKV_TEXT_PREFETCH``): graph-replay medians of one decode
attention call per layout at a few shapes, for each distance, in one process (same GPU, same inputs).

    python -m eval.studies.text_prefetch_sweep --pfd 0,1,2
"""

from __future__ import annotations

import argparse
import os

import torch

import kernels
from eval.bench.text_attention import LAYOUTS, VARIANTS, graph_us, kivi

SHAPES = (("internvl2.5-8b", 16, 32768), ("internvl2.5-8b", 1, 32768), ("internvl2.5-8b", 64, 4096),
          ("smollm2", 16, 32768))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pfd", default="0,1,2")
    args = ap.parse_args(argv)
    for name, B, n in SHAPES:
        HQ, H, D = LAYOUTS[name]
        for var, kb, vb in VARIANTS:
            cells = []
            for pfd in args.pfd.split(","):
                os.environ["MMKV_TEXT_PREFETCH"] = pfd
                t, _ = graph_us(lambda B=B, HQ=HQ, H=H, n=n, D=D, kb=kb, vb=vb: (
                    torch.randn(B, HQ, D, device="cuda", dtype=torch.float16), kivi(B, H, n, D, kb, v_bits=vb)),
                    lambda q, s: kernels.decode_attention(q, [s]))
                cells.append(f"pfd {pfd}: {t:7.1f}")
            print(f"{name:15s} B={B:3d} n={n:6d} {var:6s} " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
