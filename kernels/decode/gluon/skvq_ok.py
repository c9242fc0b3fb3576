"""What the Gluon SKVQ kernel (``skvq.py``) can read and how it is launched, without Gluon: the segment checks
(``skvq_gluon_ok``), the register cap, the ternary lane-load rule, the MMA column count and the programs a
multiprocessor holds per launch variant (which ``decode/skvq.py`` fills whole waves with)."""

from __future__ import annotations

import torch

from ...layouts import TERNARY as TERN_BITS
from ...switches import interpreted, switch
from ..capability import capability
from ..skvq_rules import skvq_prefetch, skvq_prefetch_span, skvq_unmasked, skvq_warps
from .operands import HAVE_GLUON
from .ternary import tern_rows_ok

_RESIDENT: dict = {}  # (device index, launch key) -> programs one multiprocessor holds, once compiled there


def skvq_regs(vbits: float, unmasked: bool = True, D: int = 128, cols: int = 8) -> int:
    """Register cap of the kernel (``MMKV_SKVQ_REGS``; 0 = none). Unset: 128 for ternary values, whose uncapped
    build takes 132 and so fits 3 programs per multiprocessor instead of 4 (ncu, H100, B16 n32768), and for the
    variants with the unmasked copy of the loop (``unmasked``) at head_dim 128 and 8 MMA columns (``columns``),
    which take 148 (K2V2 g2, G=4) uncapped and no stack under the cap (sm_90 SASS, ``eval.bench.sass.skvq_report``).
    16 columns (G 5-8 at 2 groups, G 4 at 4) took 221-244 registers before the copy, 2 programs per SM, and take
    238-242 with it, still 2; a cap of 128 spilled 50+ words in their loop. At head_dim 64 the copy adds none or
    stays under 128 (K2V1 with 4 groups keeps its 168, which a cap of 128 spills: 112 bytes)."""
    v = switch("MMKV_SKVQ_REGS")
    if v:
        return int(v)
    return 128 if vbits == TERN_BITS or (unmasked and D >= 128 and cols <= 8) else 0


def resident(dev_index: int, key) -> int:
    """Programs of a launch variant one multiprocessor holds at once (registers, warps, shared memory: counted as the
    text kernel's, ``text_slots.programs_per_sm``); 4 (128 registers, 4 warps) until the variant ran on that
    device."""
    return _RESIDENT.get((dev_index, key), 4)


def _record_resident(kernel, dev_index: int, key, W: int) -> None:
    from .text_slots import programs_per_sm

    n = programs_per_sm(kernel, dev_index, W)
    if n:
        _RESIDENT[(dev_index, key)] = n


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _heads_padded(G: int, ng: int) -> int:
    return max(_pow2(G), 8 // min(8, _pow2(ng)))


def columns(G: int, ng: int) -> int:
    """MMA columns of the kernel: one per (group, head) pair, groups padded to a power of two and heads further,
    to at least 8 columns (one MMA tile)."""
    return _heads_padded(G, ng) * _pow2(ng)


def tern_lanes(D: int, T: int) -> bool:
    """Ternary values read by per-lane addresses (``t_operand_lanes``): head_dim 128, a capacity that is a multiple
    of 16 tokens, ``MMKV_SKVQ_TERN_LOAD`` not ``bytes``."""
    return D == 128 and T % 16 == 0 and switch("MMKV_SKVQ_TERN_LOAD") != "bytes"


def _word(nbytes: int) -> torch.dtype:
    return {4: torch.int32, 2: torch.int16, 1: torch.int8}[nbytes]


def _rows_ok(t: torch.Tensor | None, row: int, word: int) -> bool:
    """Token rows of ``row`` bytes, contiguous, every row and the base aligned to ``word`` bytes."""
    return (t is not None and t.dim() == 4 and t.shape[3] == row and t.stride(3) == 1 and t.stride(2) == row
            and t.stride(1) % word == 0 and t.stride(0) % word == 0 and t.data_ptr() % word == 0)


def skvq_gluon_ok(seg, G: int, D: int) -> bool:
    """Can ``_skvq_kernel`` read this ``SkvqSeg``? (Shapes and strides; the caller checks the device.)"""
    if not HAVE_GLUON or switch("MMKV_SKVQ_GLUON") == "0" or interpreted():
        return False
    if seg.k_bits not in (1, 2) or seg.v_bits not in (1.0, 2.0, TERN_BITS) or D not in (64, 128) or not 1 <= G <= 8:
        return False
    ng = seg.k_scale.shape[3]
    if seg.v_scale.shape[3] != ng or columns(G, ng) > 16:
        return False
    kb = D * seg.k_bits // 32
    vb = D * int(seg.v_bits) // 64
    return (_rows_ok(seg.k_codes, D * seg.k_bits // 8, min(4, kb))
            and (tern_rows_ok(seg.v_codes, D) if seg.v_bits == TERN_BITS else _rows_ok(seg.v_codes, D * int(seg.v_bits) // 8, vb))
            and all(t.stride(3) == 1 and t.stride(2) == ng for t in (seg.k_scale, seg.k_zero, seg.v_scale, seg.v_zero))
            and seg.k_scale.stride() == seg.k_zero.stride() and seg.v_scale.stride() == seg.v_zero.stride())


def seg_warps(seg, D: int) -> int:
    """``skvq_rules.skvq_warps`` for a segment (its rows, KV heads and capacity)."""
    B, H, T = seg.k_codes.shape[:3]
    return skvq_warps(B, H, T, D)


def seg_prefetch(seg, D: int) -> int:
    """``skvq_rules.skvq_prefetch`` for a segment, 0 off sm_90+ (bulk L2 prefetch is a Hopper instruction)."""
    dev = seg.k_codes.device
    if dev.type != "cuda" or capability(dev)[0] < 9:
        return 0
    B, H, T = seg.k_codes.shape[:3]
    return skvq_prefetch(B, H, T, D)


def seg_prefetch_pair(seg, D: int) -> tuple[int, int]:
    """(``seg_prefetch``, iterations one of its requests covers: ``skvq_rules.skvq_prefetch_span``, 1 without a
    prefetch)."""
    pfd = seg_prefetch(seg, D)
    return pfd, skvq_prefetch_span() if pfd else 1


def launch_key(seg, G: int, D: int) -> tuple:
    """The launch variant ``launch_skvq`` keys ``resident`` by, for a segment of ``G`` query heads per KV head."""
    fp8 = seg.k_scale.dtype == torch.float8_e4m3fn
    return (G, D, seg.k_scale.shape[3], seg.k_bits, seg.v_bits, seg.k_group, seg.v_group, seg.k_perm is not None,
            seg.v_perm is not None, fp8, skvq_regs(seg.v_bits, skvq_unmasked(), D, columns(G, seg.k_scale.shape[3])),
            seg_warps(seg, D)) + seg_prefetch_pair(seg, D)
