"""Attention lens math (pure functions on tensors): how quantizing the visual span moves the pre-softmax logits
(CalibQuant Fig. 1) and the attention output, built on the reference kernels in ``kernels/reference.py``.

Shapes: ``q [Hq, D]`` the last prompt token's query (after RoPE); ``k, v [Hk, T, D]`` the prompt's keys (after
RoPE) and values; ``visual`` a bool mask ``[T]`` of the visual tokens. Quantization is CalibQuant's channel-wise
min/max over the whole visual span: ``s = (max - min) / (2^b - 1)``, ``code = round((x - min) / s)``.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from kernels.layouts import ChannelSeg, DenseSeg, pack, per_byte
from kernels.reference import attention_over_segments, segment_logits


def quantize_channelwise(x: torch.Tensor, bits: int):
    """``x [B, H, T, D]`` -> (packed codes ``[B, H, Tp // per, D]``, scale ``[B, H, 1, D]``, zero, Tp) with one
    scale/zero per channel over all T tokens; T is padded with zero codes up to a multiple of ``8 // bits``."""
    x = x.float()
    lo, hi = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - lo) / safe).clamp_(0, 2**bits - 1).to(torch.uint8)
    per = per_byte(bits)
    t = x.shape[2]
    tp = math.ceil(t / per) * per
    if tp != t:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:2], tp - t, codes.shape[3])], dim=2)
    return pack(codes, bits, dim=2), scale, lo, tp


def channel_segment(k: torch.Tensor, v: torch.Tensor, bits: int, calib=None) -> ChannelSeg:
    """fp K/V ``[B, H, T, D]`` of the visual span -> a CalibQuant ``ChannelSeg`` (one block = the whole span)."""
    kc, ks, kz, tp = quantize_channelwise(k, bits)
    vc, vs, vz, _ = quantize_channelwise(v, bits)
    lens = torch.full((k.shape[0],), k.shape[2], dtype=torch.int32)
    return ChannelSeg(kc, ks, kz, vc, vs, vz, bits=bits, block=tp, lens=lens, calib=calib)


def dense_segment(k: torch.Tensor, v: torch.Tensor) -> DenseSeg:
    return DenseSeg(k.float(), v.float(), torch.full((k.shape[0],), k.shape[2], dtype=torch.int32))


def _split(k, v, visual):
    vis = visual.to(torch.bool)
    return (k[:, vis][None], v[:, vis][None]), (k[:, ~vis][None], v[:, ~vis][None])


def visual_logits(q, k, v, visual, head: int, bits: int, tau: tuple[float, float], sm_scale: float | None = None):
    """Pre-softmax logits of query head ``head`` over the visual tokens: {"exact", "quantized", "calibrated"} 1-D."""
    d = q.shape[-1]
    sm_scale = sm_scale or 1.0 / math.sqrt(d)
    (kv_, vv_), _ = _split(k, v, visual)
    hk = k.shape[0]
    g = q.shape[0] // hk
    kh = head // g
    qh = q[head].float()[None, None, None, :]  # [1, 1, 1, D]
    kk, vv = kv_[:, kh : kh + 1], vv_[:, kh : kh + 1]
    out = {}
    for name, seg in (("exact", dense_segment(kk, vv)), ("quantized", channel_segment(kk, vv, bits)),
                      ("calibrated", channel_segment(kk, vv, bits, calib=tuple(tau)))):
        x, _, _ = segment_logits(qh, seg, sm_scale)
        out[name] = x[0, 0, 0, : kk.shape[2]]
    return out


def attention_error(q, k, v, visual, bits: int, tau: tuple[float, float], sm_scale: float | None = None):
    """Relative L2 error of the attention output (all heads) when the visual span is quantized, without and with
    calibration: ``{"quantized": float, "calibrated": float}``."""
    (kv_, vv_), (kt, vt) = _split(k, v, visual)
    qq = q.float()[None, :, None, :]  # [1, Hq, 1, D]
    exact, _ = attention_over_segments(qq, [dense_segment(k[None], v[None])], sm_scale)
    rest = [dense_segment(kt, vt)] if kt.shape[2] else []
    errs = {}
    for name, calib in (("quantized", None), ("calibrated", tuple(tau))):
        out, _ = attention_over_segments(qq, rest + [channel_segment(kv_, vv_, bits, calib)], sm_scale)
        errs[name] = float((out - exact).norm() / exact.norm().clamp_min(1e-12))
    return errs


def logit_distribution(logits: dict[str, torch.Tensor], bins: int = 40) -> pd.DataFrame:
    """Histograms on one shared grid -> long frame (logit, share, series) for a LinePlot."""
    allv = torch.cat([x.flatten().float() for x in logits.values()])
    lo, hi = float(allv.min()), float(allv.max())
    if hi <= lo:
        hi = lo + 1e-3
    width = (hi - lo) / bins
    centers = [lo + (i + 0.5) * width for i in range(bins)]
    rows = []
    for name, x in logits.items():
        h = torch.histc(x.flatten().float(), bins=bins, min=lo, max=hi)
        h = h / h.sum().clamp_min(1)
        rows += [(c, float(s), name) for c, s in zip(centers, h.tolist(), strict=True)]
    return pd.DataFrame(rows, columns=["logit", "share", "series"])


def logit_summary(logits: dict[str, torch.Tensor]) -> pd.DataFrame:
    """min / max / range / std per series: calibration should pull the quantized range back toward exact."""
    rows = []
    for name, x in logits.items():
        x = x.float()
        rows.append((name, float(x.min()), float(x.max()), float(x.max() - x.min()), float(x.std())))
    return pd.DataFrame(rows, columns=["series", "min", "max", "range", "std"])


def layer_errors(layers: list[dict], visual, bits: int, tau) -> pd.DataFrame:
    """``layers``: [{"q", "k", "v", "scale"}] per layer -> long frame (layer, error, kind) for a LinePlot."""
    rows = []
    for i, L in enumerate(layers):
        e = attention_error(L["q"], L["k"], L["v"], visual, bits, tau, L.get("scale"))
        rows += [(i, e["quantized"], "quantized"), (i, e["calibrated"], "quantized + calibrated")]
    return pd.DataFrame(rows, columns=["layer", "relative error", "kind"])
