"""How often CalibQuant's fixed tau would invert or flatten a query's visual logits, and what the slope floor
(kernels/reference.py, CALIB_MIN_RATIO = 1/4) changes (issue 32, item 4).

For each (layer, query head, query): the span's K/V quantized channel-wise (1 bit by default, the whole span one
block), the quantized logit range w, the paper's slope r = (w + tau1 - tau2) / w: *inverted* where r <= 0,
*flattened* where 0 < r < 1/4 (both floored now). Softmax MSE over the span against exact logits and the relative
error of the attention output, for no calibration, the paper's map and the floored map.

* ``smollm2-135m``: a 1024-token WikiText-2 span routed as visual, the 64 following tokens as queries
  (``calibquant_fidelity``'s setup; real weights).
* ``demo-llava`` / ``demo-internvl``: an image's 576 / 256 visual tokens, the last prompt token's query (the
  lens's capture). Their vision towers are random, so these ranges are the random tower's, not a trained one's.

    python -m eval.studies.calib_floor --model demo-llava --out results/calib_floor_demo-llava.json
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import kernels.reference as R
from kernels.layouts import ChannelSeg, DenseSeg
from mmkv.methods import CalibQuant

from ..jsonout import save_json

IMAGE = Path(__file__).resolve().parents[2] / "assets" / "images" / "coffee.png"


def span_stats(q, k, v, bits: int, tau1: float, tau2: float) -> dict:
    """``q [1, Hq, M, D]`` against the span ``k, v [1, H, N, D]`` -> counts and errors (sums, for averaging)."""
    lens = torch.tensor([k.shape[2]])
    seg = CalibQuant(bits=bits, tau1=tau1, tau2=tau2, calib_max_bits=8, clip="off").quantize(k, v, lens)
    plain = ChannelSeg(**{**seg.__dict__, "calib": None})
    exact = DenseSeg(k, v, lens)
    scale = 1.0 / math.sqrt(q.shape[-1])
    x_exact, _, _ = R.segment_logits(q, exact, scale)
    p_exact = torch.softmax(x_exact, -1)
    o_exact, _ = R.attention_over_segments(q, [exact], scale)
    xq, _, _ = R.segment_logits(q, plain, scale)
    w = xq.amax(-1) - xq.amin(-1)
    r = (w + tau1 - tau2) / w
    out = {"queries": r.numel(), "inverted": int((r <= 0).sum()),
           "flattened": int(((r > 0) & (r < R.CALIB_MIN_RATIO)).sum())}
    floor = R.CALIB_MIN_RATIO
    for name, s, f in (("quant", plain, floor), ("paper", seg, float("-inf")), ("floor", seg, floor)):
        R.CALIB_MIN_RATIO = f
        try:
            x, _, _ = R.segment_logits(q, s, scale)
            o, _ = R.attention_over_segments(q, [s], scale)
        finally:
            R.CALIB_MIN_RATIO = floor
        out[f"mse_{name}"] = torch.mean((torch.softmax(x, -1) - p_exact) ** 2).item()
        out[f"out_err_{name}"] = ((o - o_exact).norm() / o_exact.norm()).item()
    return out


def text_rows(bits, tau1, tau2) -> list[dict]:
    import mmkv

    from .calibquant_fidelity import capture_queries
    from .common import wikitext_test

    model, tok, _ = mmkv.load_model("smollm2-135m", dtype=torch.float32)
    prefix, span, n = 32, 1024, 64
    ids = tok(wikitext_test().read_text(encoding="utf-8")[: 40 * (prefix + span + n)], return_tensors="pt").input_ids
    cache, queries = capture_queries(model, ids[:, : prefix + span + n])
    return [span_stats(queries[i][:, :, prefix + span :].float(), layer.keys[:, :, prefix : prefix + span].float(),
                       layer.values[:, :, prefix : prefix + span].float(), bits, tau1, tau2)
            for i, layer in enumerate(cache.layers)]


def vlm_rows(name: str, bits, tau1, tau2) -> list[dict]:
    import mmkv
    from mmkv.ui.lens_tab import capture_prompt

    lm = mmkv.load_model(name)
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(IMAGE)},
                                         {"type": "text", "text": "What do you see?"}]}]
    data = capture_prompt(lm, msgs)
    vis = data["visual"]
    rows = []
    for L in data["layers"]:
        k, v = L["k"][:, vis].float()[None], L["v"][:, vis].float()[None]
        rows.append(span_stats(L["q"].float()[None, :, None], k, v, bits, tau1, tau2))
    return rows


def summary(rows: list[dict]) -> dict:
    n = sum(r["queries"] for r in rows)
    out = {"queries": n, "inverted": sum(r["inverted"] for r in rows), "flattened": sum(r["flattened"] for r in rows)}
    for key in rows[0]:
        if key.startswith(("mse_", "out_err_")):
            out[key] = sum(r[key] for r in rows) / len(rows)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--tau1", type=float, default=0.0)
    ap.add_argument("--tau2", type=float, default=3.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    rows = (text_rows(a.bits, a.tau1, a.tau2) if a.model == "smollm2-135m"
            else vlm_rows(a.model, a.bits, a.tau1, a.tau2))
    res = {"model": a.model, "bits": a.bits, "tau1": a.tau1, "tau2": a.tau2, "mean": summary(rows), "layers": rows}
    s = res["mean"]
    print(f"{a.model} {a.bits}-bit tau=({a.tau1:g}, {a.tau2:g}): {s['queries']} (layer, head, query) triples, "
          f"inverted {s['inverted']} ({s['inverted'] / s['queries']:.1%}), flattened {s['flattened']} "
          f"({s['flattened'] / s['queries']:.1%})")
    print("softmax MSE  quant {mse_quant:.3e}  paper {mse_paper:.3e}  floor {mse_floor:.3e}".format(**s))
    print("out rel.err  quant {out_err_quant:.3f}  paper {out_err_paper:.3f}  floor {out_err_floor:.3f}".format(**s))
    save_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
