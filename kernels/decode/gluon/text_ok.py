"""What the Gluon text kernel (``text.py``) can read, and its SVEC rule: the checks ``plan.py`` makes before choosing
it."""

from __future__ import annotations

import torch

from ...switches import on_off


def tiles_ok(k_bits: int, v_bits: int, block: int, group: int, D: int) -> bool:
    """Does the post-scaled variant cover a ``KiviSeg`` of these parameters with its values in tile order? (Every
    16-channel tile inside one group: groups of 16 channels or a multiple, dividing D.)"""
    return (k_bits in (1, 2) and v_bits in (1, 2) and D in (64, 128) and block % 32 == 0 and group % 16 == 0
            and D % group == 0)


def text_ok(seg, G: int, D: int) -> bool:
    """Can ``_text_kernel`` read this ``KiviSeg``? Natural value order: pre-scaled values, groups a multiple of D/8;
    tile order: post-scaled values (``tiles_ok``)."""
    if seg.v_order == "tiles":
        grouping = tiles_ok(seg.k_bits, seg.v_bits, seg.block, seg.group, D)
    else:
        grouping = seg.group % (D // 8) == 0
    return (seg.k_bits in (1, 2) and seg.v_bits in (1, 2) and D in (64, 128) and G <= 8 and seg.block % 32 == 0
            and grouping and seg.k_codes is not None and seg.k_codes.stride(-1) == 1
            and seg.k_codes.stride(-2) == D and seg.v_codes.stride(-1) == 1
            and seg.v_codes.stride(-2) == D * seg.v_bits // 8
            and seg.v_scale.stride(-1) == 1 and seg.v_scale.stride(-2) == D // seg.group
            and seg.v_zero.stride() == seg.v_scale.stride()
            and seg.v_scale.dtype == torch.float16 and seg.v_zero.dtype == torch.float16)  # fed to fp16x2 fma


def svec_ok(seg, T: int, D: int) -> bool:
    """Can natural order's value scale/zero be read as whole chunks of a lane's tokens (``SVEC``)? Values in natural
    order, at most 4 groups, and a capacity a multiple of 16 tokens (a lane's chunk of 8 or 16 tokens loads whole,
    masked by its first token, so none may straddle the capacity)."""
    return seg.v_order != "tiles" and D // seg.group <= 4 and T % 16 == 0


def text_svec(seg, T: int, D: int) -> bool:
    """Natural-order value scale/zero read as one vector per lane and chunk of its tokens (``gluon/text.py``
    ``SVEC``) where ``svec_ok`` allows and ``MMKV_TEXT_SVEC=1``; off by default. Local sm_90 compile (Triton 3.9),
    SmolLM2 heads, 4 warps: KIVI-2 112 -> 93 registers, 29 -> 17 loads per warp iteration; KIVI-1 154 -> 128. On
    the H100 (graph replays, SmolLM2 heads n32768, us off / on, docs/BENCHMARKS.md) it is mixed: B16 at 4 warps
    KIVI-2 52.9 / 51.0, KIVI-1 57.0 / 49.1, K2/V1 48.6 / 51.5; at 2 warps 47.4 / 48.0, 53.8 / 48.9, 48.0 / 48.8;
    B64 197.0 / 203.0, 174.0 / 190.6, 193.9 / 196.7."""
    return on_off("MMKV_TEXT_SVEC") and svec_ok(seg, T, D)
