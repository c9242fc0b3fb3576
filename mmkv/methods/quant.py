"""Min/max uniform quantization shared by the methods (CalibQuant App. A.2, Eq. 3-4; KIVI Sec. 3)."""

from __future__ import annotations

import torch

from .base import SCALE_DTYPE


def minmax_codes(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """Codes of ``x`` for the range [lo, hi] (broadcastable), round-to-nearest, plus fp16 scale and zero.

    The stored (fp16) scale and zero are the ones the codes are computed against, so dequantization
    ``code * scale + zero`` reproduces exactly what any kernel will see.
    """
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).to(SCALE_DTYPE)
    zero = lo.to(SCALE_DTYPE)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((x.float() - zero.float()) / safe).clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def masked_minmax(x: torch.Tensor, valid: torch.Tensor, dim: int, keepdim: bool = True):
    """Min and max of ``x`` along ``dim`` over ``valid`` entries only (padding must not widen a range)."""
    big = torch.finfo(torch.float32).max
    xf = x.float()
    lo = torch.where(valid, xf, big).amin(dim, keepdim=keepdim)
    hi = torch.where(valid, xf, -big).amax(dim, keepdim=keepdim)
    empty = lo > hi
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    return lo, hi


def token_valid(lens: torch.Tensor, t: int, device) -> torch.Tensor:
    """``[B, 1, T, 1]`` mask of valid tokens per row."""
    return (torch.arange(t, device=device)[None, :] < lens.to(device)[:, None])[:, None, :, None]


def pad_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad the token axis (dim 2) of ``[B, H, T, D]`` with copies of nothing (zeros) up to a multiple."""
    t = x.shape[2]
    extra = (-t) % multiple
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:2], extra, x.shape[3])], dim=2)


def channel_quantize(x: torch.Tensor, lens: torch.Tensor, bits: int, block: int, clip: float = 1.0,
                     global_axis: bool = False):
    """Channel-wise quantization in token blocks: min/max per (row, head, block, channel) over valid tokens.

    ``x: [B, H, T, D]`` with ``T`` a multiple of ``block``. Returns unpacked codes ``[B, H, T, D]`` and scale/zero
    ``[B, H, T // block, D]``. ``clip`` scales both ends of each range toward zero, ``[lo * clip, hi * clip]``, as
    CalibQuant's released ``quant`` does (1.0 = off): a channel whose values all have one sign is shifted toward
    zero, not narrowed about its centre, and values beyond the scaled end are clamped to the end code.
    ``global_axis`` uses one range per (row, head, block) shared by all channels (the App. B.3 ablation), stored
    as a stride-0 view over D so the layout stays the same.
    """
    b, h, t, d = x.shape
    nb = t // block
    valid = token_valid(lens, t, x.device).expand(b, h, t, d)
    xb = x.reshape(b, h, nb, block, d)
    vb = valid.reshape(b, h, nb, block, d)
    lo, hi = masked_minmax(xb, vb, dim=3)
    if global_axis:
        lo = lo.amin(-1, keepdim=True)
        hi = hi.amax(-1, keepdim=True)
    if clip != 1.0:
        lo, hi = lo * clip, hi * clip
    codes, scale, zero = minmax_codes(xb, lo, hi, bits)
    scale = scale.squeeze(3)
    zero = zero.squeeze(3)
    if global_axis:
        scale = scale.expand(b, h, nb, d)
        zero = zero.expand(b, h, nb, d)
    return codes.reshape(b, h, t, d), scale, zero


def token_group_quantize(x: torch.Tensor, bits: int, group: int):
    """Per-token quantization in groups of ``group`` channels (KIVI values). Returns codes ``[B, H, T, D]`` and
    scale/zero ``[B, H, T, D // group]``."""
    b, h, t, d = x.shape
    xg = x.reshape(b, h, t, d // group, group).float()
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    codes, scale, zero = minmax_codes(xg, lo, hi, bits)
    return codes.reshape(b, h, t, d), scale.squeeze(-1), zero.squeeze(-1)
