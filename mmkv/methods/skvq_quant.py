"""SKVQ's clipped dynamic group quantization (arXiv:2405.06219 Sec. 3.1, Eq. 2), shared by the runtime
method and the offline calibration so that both quantize identically.

Everything works on the last axis in *stored* channel order (after the per-head reorder): ``gid [H, D]`` gives
each stored channel its group, groups are contiguous runs, ``ng`` groups per head. Per token and group,
Eq. 2 with the clipping ratio alpha of that group::

    lo = alpha * min(X),  hi = alpha * max(X),  scale = (hi - lo) / (levels),  zero = lo
    code = clamp(round((x - zero) / scale), 0, levels),  x_hat = code * scale + zero

``levels`` is ``2**bits - 1``, or 2 for the ternary "1.5-bit" values. The paper's Eq. 2 writes ``floor``; round
to nearest is the usual reading (its Sec. 3.1 opening uses round). Scale and zero are rounded to their storage
dtype first (fp16, or FP8 E4M3 with ``fp8=True``, Table 3) and the codes are computed against the stored values,
so ``code * scale + zero`` is exactly what the kernel computes. Alpha lives only inside scale and zero.
"""

from __future__ import annotations

import torch

from kernels.layouts import TERNARY, pack_planes, pack_ternary

from .base import SCALE_DTYPE

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def levels_of(bits: float) -> int:
    return 2 if bits == TERNARY else (1 << int(bits)) - 1


def group_range(x: torch.Tensor, gid: torch.Tensor, ng: int, group: int):
    """Min and max per (token, group) of ``x [B, H, T, D]`` (stored order) -> ``lo, hi [B, H, T, ng]`` fp32.

    ``group > 0``: every group has ``group`` consecutive channels (a reshape); else ``gid [H, D]`` (scatter).
    """
    b, h, t, d = x.shape
    xf = x.float()
    if group:
        xg = xf.reshape(b, h, t, ng, group)
        return xg.amin(-1), xg.amax(-1)
    idx = gid.long().to(x.device)[None, :, None, :].expand(b, h, t, d)
    lo = xf.new_full((b, h, t, ng), float("inf")).scatter_reduce(3, idx, xf, "amin")
    hi = xf.new_full((b, h, t, ng), float("-inf")).scatter_reduce(3, idx, xf, "amax")
    return lo, hi


def store(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Round scale/zero to their storage dtype (E4M3 saturates at +-448 instead of becoming NaN)."""
    if fp8:
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(SCALE_DTYPE)


def scale_zero(lo: torch.Tensor, hi: torch.Tensor, bits: float, alpha: torch.Tensor | None, fp8: bool):
    """Eq. 2: clipped range -> stored ``(scale, zero)``; ``alpha [H, ng]`` (None: no clipping)."""
    if alpha is not None:
        a = alpha.to(lo.device, torch.float32)[None, :, None, :]
        lo, hi = lo * a, hi * a
    return store((hi - lo) / levels_of(bits), fp8), store(lo, fp8)


def codes_for(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, gid: torch.Tensor, bits: float):
    """Round-to-nearest codes of ``x [B, H, T, D]`` against stored per-group scale/zero ``[B, H, T, ng]``."""
    b, h, t, d = x.shape
    idx = gid.long().to(x.device)[None, :, None, :].expand(b, h, t, d)
    s = scale.float().gather(3, idx)
    z = zero.float().gather(3, idx)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round((x.float() - z) / safe).clamp_(0, levels_of(bits)).to(torch.uint8), s, z


def to_stored(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Natural channel order -> stored order (``stored[j] = natural[perm[h, j]]``)."""
    if perm is None:
        return x
    idx = perm.long().to(x.device)[None, :, None, :].expand(x.shape)
    return x.gather(3, idx)


def quantize_side(x, bits: float, perm, gid, ng: int, group: int, alpha, fp8: bool):
    """One of K or V, natural order ``[B, H, T, D]`` -> ``(codes plane, high plane or None, scale, zero)``."""
    xs = to_stored(x, perm)
    lo, hi = group_range(xs, gid, ng, group)
    scale, zero = scale_zero(lo, hi, bits, alpha, fp8)
    codes, _, _ = codes_for(xs, scale, zero, gid, bits)
    if bits == TERNARY:
        return pack_ternary(codes), None, scale, zero
    planes = pack_planes(codes, int(bits), dim=3)
    return planes[0], (planes[1] if len(planes) > 1 else None), scale, zero


def dequant_range(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: float, fp8: bool = False):
    """Quantize-dequantize ``x`` against (already clipped) ranges ``lo, hi`` that broadcast against it: the
    arithmetic of :func:`quantize_side` (stored scale/zero, round to nearest, clamp) without packing."""
    scale = store((hi - lo) / levels_of(bits), fp8).float()
    zero = store(lo, fp8).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    c = torch.round((x.float() - zero) / safe).clamp_(0, levels_of(bits))
    return c * scale + zero


def fake_quant(xs: torch.Tensor, bits: float, gid, ng: int, group: int, alpha, fp8: bool = False) -> torch.Tensor:
    """Quantize-dequantize in stored order (what the cache will hold), ``xs [B, H, T, D]``.

    ``alpha`` may carry leading candidate axes: ``[..., H, ng]`` gives ``[..., B, H, T, D]``."""
    lo, hi = group_range(xs, gid, ng, group)
    if alpha is not None:
        a = alpha.to(lo.device, torch.float32)[..., None, :, None, :]
        lo, hi = lo * a, hi * a
    d = xs.shape[-1]
    idx = gid.long().to(xs.device)[None, :, None, :].expand(*lo.shape[:-1], d)
    return dequant_range(xs, lo.gather(-1, idx), hi.gather(-1, idx), bits, fp8)
