"""AQUA-KV's backbone quantizers alone, on synthetic data: relative L2 error ``||x^ - x|| / ||x||`` per bit-width.

Rows of ``--channels`` N(0, 1) values (``--rows`` of them, seed 0), and the same rows with every 97th channel
scaled by 20 (outlier channels, as keys have). ``uniform`` and ``hadamard`` use groups of 64; ``higgs`` its
Hadamard groups of ``min(1024, largest power of two dividing the row)``. Bits per value as stored are given.

    python -m eval.studies.aquakv_quantizers --channels 1024 --out results/aquakv_quantizers.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mmkv.methods.aquakv_quant import QUANTIZERS, Quantizer

from ..jsonout import save_json


def rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((y.double() - x.double()).norm() / x.double().norm()).item()


def run(rows: int, channels: int, bits_list=(2, 3, 4)) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, channels, generator=g)
    xo = x.clone()
    xo[:, ::97] *= 20
    out = []
    for bits in bits_list:
        for kind in QUANTIZERS:
            q = Quantizer(bits, 64, kind)
            out.append({"bits": bits, "quantizer": kind, "bits_per_value": q.bits_per_element(channels),
                        "gaussian": rel_l2(x, q.round_trip(x)), "outliers": rel_l2(xo, q.round_trip(xo))})
    return out


def format_table(rows: list[dict], channels: int) -> str:
    lines = [f"Relative L2 error, rows of {channels} channels",
             "| bits | quantizer | stored bits per value | Gaussian | with outlier channels |", "|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['bits']} | {r['quantizer']} | {r['bits_per_value']:.3f} | {r['gaussian']:.3f} | "
                     f"{r['outliers']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=1024)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = run(args.rows, args.channels)
    print(format_table(rows, args.channels))
    save_json(args.out, {"rows": args.rows, "channels": args.channels, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
