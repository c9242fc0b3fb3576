"""``mmkv-calibrate calibquant --model NAME``: fit CalibQuant's tau1/tau2 for one model, per model and per layer.

CalibQuant fixes tau for InternVL2.5-8B; on another model a fixed tau can compress a query's logits far more than
quantization stretched them. This fits (tau1, tau2) on the paper's grid {0, 1, 2, 3}^2 by the softmax MSE against
exact attention: per calibration window, a span of ``--span`` tokens after ``--prefix`` sink-like tokens is
quantized channel-wise at ``--bits`` as if it were visual, and the window's later tokens are the queries (the
setup of ``eval/studies/calibquant_fidelity.py``). The data is text (WikiText-2 ``valid.txt``): for a VLM these
are its language model's K/V statistics, not its vision tower's. The spec names the result with
``calibquant:tau_fit=model`` (one pair) or ``tau_fit=layer`` (a pair per layer). The span is quantized with
``--clip`` (default ``authors``, CalibQuant's default: the taus are fitted to the quantizer the spec will run); the
artifact's meta records it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch

from kernels.layouts import ChannelSeg, DenseSeg
from kernels.reference import calibrate_logits, segment_logits

from ..methods import artifacts

GRID = (0.0, 1.0, 2.0, 3.0)
PAIRS = list(itertools.product(GRID, GRID))


def window_mse(q, k, v, bits: int, clip: str = "authors") -> torch.Tensor:
    """Softmax MSE against exact of every grid pair, ``[len(PAIRS)]``: ``q [1, Hq, M, D]``, span ``k, v [1, H, N, D]``."""
    from ..methods.calibquant import CalibQuant

    lens = torch.tensor([k.shape[2]])
    seg = CalibQuant(bits=bits, calibrate=False, clip=clip).quantize(k, v, lens)
    scale = 1.0 / math.sqrt(q.shape[-1])
    p_exact = torch.softmax(segment_logits(q, DenseSeg(k, v, lens), scale)[0], -1)
    xq, valid, _ = segment_logits(q, ChannelSeg(**{**seg.__dict__, "calib": None}), scale)
    return torch.stack([torch.mean((torch.softmax(calibrate_logits(xq, valid, t1, t2), -1) - p_exact) ** 2)
                        for t1, t2 in PAIRS])


def fit(qs, ks, vs, seq_len: int, bits: int, prefix: int, span: int, q_stride: int, clip: str = "authors") -> dict:
    """Per-layer collected ``q [N, Hq, D]``, ``k, v [N, H, D]`` (windows of ``seq_len``) -> the fitted taus and the
    mean softmax MSE of every grid pair per layer ``mse [L, len(PAIRS)]``."""
    if prefix + span >= seq_len:
        raise ValueError(f"--prefix {prefix} + --span {span} leaves no query in a window of {seq_len}")
    rows = []
    for q, k, v in zip(qs, ks, vs, strict=True):
        per = []
        for w in range(q.shape[0] // seq_len):
            o = w * seq_len
            kk = k[o + prefix : o + prefix + span].float().transpose(0, 1)[None]
            vv = v[o + prefix : o + prefix + span].float().transpose(0, 1)[None]
            qq = q[o + prefix + span : o + seq_len : q_stride].float().transpose(0, 1)[None]
            per.append(window_mse(qq, kk, vv, bits, clip))
        rows.append(torch.stack(per).mean(0))
    mse = torch.stack(rows)
    best_model = int(mse.mean(0).argmin())
    layer_tau = torch.tensor([PAIRS[int(i)] for i in mse.argmin(1)])
    return {"mse": mse, "model_tau": PAIRS[best_model], "layer_tau": layer_tau,
            "mse_default": float(mse[:, PAIRS.index((0.0, 3.0))].mean()), "mse_model": float(mse[:, best_model].mean()),
            "mse_layer": float(mse.min(1).values.mean())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmkv-calibrate calibquant", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bits", type=int, default=1, help="bit-width the taus are fitted for (default 1)")
    ap.add_argument("--clip", default="authors", choices=["authors", "off"],
                    help="CalibQuant's range clipping while fitting (default authors, as the default spec)")
    ap.add_argument("--data", help="calibration text (default: WikiText-2 valid.txt)")
    ap.add_argument("--tokens", type=int, default=4096, help="calibration tokens (windows of --seq-len)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=32, help="tokens before the span (the model's sinks)")
    ap.add_argument("--span", type=int, default=384, help="tokens quantized as if visual")
    ap.add_argument("--q-stride", type=int, default=4, help="every n-th later token is a query")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="output folder (default: the folder calibquant reads)")
    args = ap.parse_args(argv)
    from ..models import load_model
    from .collect import collect_qkv

    t0 = time.perf_counter()
    lm = load_model(args.model, device=args.device)
    ad = lm.adapter
    col = collect_qkv(lm, args.data, seq_len=args.seq_len, max_tokens=args.tokens, dtype=torch.float32)
    res = fit(col.q, col.k, col.v, args.seq_len, args.bits, args.prefix, args.span, args.q_stride, args.clip)
    meta = {**col.meta, "bits": args.bits, "clip": args.clip, "tau1": res["model_tau"][0], "tau2": res["model_tau"][1],
            "softmax_mse": {"default_0_3": res["mse_default"], "model": res["mse_model"], "layer": res["mse_layer"]},
            "params": {"grid": list(GRID), "prefix": args.prefix, "span": args.span, "q_stride": args.q_stride},
            "seconds": round(time.perf_counter() - t0, 1)}
    tensors = {"layer_tau": res["layer_tau"].float(), "mse": res["mse"].float(),
               "pairs": torch.tensor(PAIRS, dtype=torch.float32)}
    folder = artifacts.Artifact("calibquant", ad.name, artifacts.shape_of(ad), tensors, meta).save(
        args.out or artifacts.default_dir(ad.name, "calibquant"))
    print(f"calibquant: {ad.name} {args.bits}-bit: tau1={meta['tau1']:g} tau2={meta['tau2']:g} per model; softmax "
          f"MSE {res['mse_default']:.4e} at (0, 3), {res['mse_model']:.4e} per model, {res['mse_layer']:.4e} per "
          f"layer; written to {folder} ({meta['seconds']} s)")
    return 0
