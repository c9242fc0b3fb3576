"""How precisely must ``q*s`` reach the tensor cores? A CPU study for the next CalibQuant kernel design.

The Gluon channel kernels round the post-scaled query ``q*s`` to fp16 for ``mma.sync``. An int8 tensor-core design
(docs/KERNELS.md, "What limits it now") would instead hold ``q*s`` per head as 16-bit fixed point, split into two
int8 halves (two MMAs, exact int32 sums), or as a single int8. This compares the three against exact float64
attention over a 1-bit channel-wise visual span (random codes, scales and queries; ``--sharpness`` multiplies q
so that the softmax is more peaked). It measures the query rounding only: codes, scales and accumulation are exact.

    python -m eval.studies.query_precision --out results/query_precision.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from eval.jsonout import save_json

ROUNDINGS = ("fp16", "int16 (two int8 halves)", "int8")


def _rounded(qs: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "fp16":
        return qs.half().double()
    top = qs.abs().amax(-1, keepdim=True)
    levels = 32767 if kind.startswith("int16") else 127  # per-head scale: max |q*s| maps to the largest code
    return torch.round(qs / top * levels) * top / levels


def _attend(qs, kc, qz, v):
    return torch.softmax(qs @ kc.T + qz, -1) @ v


def study(n: int = 8192, D: int = 128, G: int = 4, sharpness: float = 1.0, trials: int = 20, seed: int = 0) -> dict:
    """Median and max relative error of the attention output, per rounding of ``q*s``."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    errs: dict = {k: [] for k in ROUNDINGS}
    for _ in range(trials):
        q = torch.randn(G, D, generator=g, dtype=f64) * sharpness
        ks, kz = torch.rand(D, generator=g, dtype=f64) * 0.5 + 0.05, torch.randn(D, generator=g, dtype=f64)
        vs, vz = torch.rand(D, generator=g, dtype=f64) * 0.5 + 0.05, torch.randn(D, generator=g, dtype=f64)
        kc = torch.randint(0, 2, (n, D), generator=g).to(f64)
        vc = torch.randint(0, 2, (n, D), generator=g).to(f64)
        scale = D ** -0.5
        qs, qz = q * ks * scale, (q * kz * scale).sum(-1, keepdim=True)
        v = vc * vs + vz

        ref = _attend(qs, kc, qz, v)
        for kind in ROUNDINGS:
            out = _attend(_rounded(qs, kind), kc, qz, v)
            errs[kind].append(((out - ref).norm() / ref.norm()).item())
    return {kind: {"median": sorted(e)[len(e) // 2], "max": max(e)} for kind, e in errs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--sharpness", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    print("| q scale | " + " | ".join(f"{k}: median / max rel. error" for k in ROUNDINGS) + " |")
    print("|---:|" + "---:|" * len(ROUNDINGS))
    for sharp in args.sharpness:
        res = study(n=args.n, sharpness=sharp, trials=args.trials)
        rows.append({"sharpness": sharp, **res})
        print(f"| {sharp:g} | " + " | ".join(f"{res[k]['median']:.1e} / {res[k]['max']:.1e}" for k in ROUNDINGS) + " |")
    save_json(args.out, {"n": args.n, "D": 128, "G": 4, "trials": args.trials, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
