"""AlignedKV decode attention over fp16 bit planes (Triton; spec: ``reference.aligned_attention``).

An ``AlignedSeg`` (layout in ``kernels/layouts.py``) holds exact fp16 K/V as a high-byte plane and two mantissa
nibble planes, channel-major inside blocks of ``block`` tokens. A decode step reads, per (block, channel), only
the planes the precision-alignment criterion asks for (AlignedKV, "Quantization of K-Cache / V-Cache"):

1. **keys pass** (grid ``(splits, H, B)``): per block, Rule 1 from q and ``K_colmax`` gives each channel 8, 12
   or 16 bits; the program loads the high-byte tile, then the mid/low nibble rows of only those channels (masked
   loads: a skipped channel of a 64-token block is one whole 32-byte sector per nibble plane), fills the missing
   bits with 100..., computes the G heads' logits on tensor cores and writes them (fp32, log2 units) to a
   scratch buffer, with per-split softmax statistics and the partial output estimate of Rule 2: the top-scoring
   token of each block (approximate top-k), its V read at 8 bits.
2. **statistics pass** (grid ``(Hq, B)``): merges the splits into ``lse2`` and ``O_est`` per query head.
3. **values pass** (grid ``(splits, H, B)``): per block, Rule 2 from ``log2 max p``, ``V_colmax`` and
   ``O_est`` gives each channel its width (``values=paper``: the authors' binade thresholds against
   ``E(sum p|v|) - 1 - e_d``, the O_est gathers dropping V's sign bit; ``values=conservative``: ``10 - gap``
   mantissa bits for an addend ``gap`` binades below ``E(O_est)``); the V planes are read likewise and ``p @ V`` is accumulated with the
   exact normalized ``p``. It writes the shared split-K partials (``m = lse2``), so the segment merges with every
   other segment of the layer in ``decode_attention``'s merge.

Value widths fixed before the softmax (``force_bits``, ``values=full``): **one pass** (``_one_pass``) reads K
(Rule 1 or fixed) and V with an online softmax straight into the split-K partials: no scratch, no statistics
launch. It reads each plane as 4-token words (``_read_block``: int32 high bytes, int16 nibbles, one index for
all three) into four fp16 token phases, assembled by an inline-asm ``prmt`` block when compiled. The Rule 2
passes keep the byte-plane tile reader (``_read_tile``): with the phase reader their registers rose to 254 and
they ran slower (docs/BENCHMARKS.md, AlignedKV).

GQA: the G query heads of a KV head share every byte loaded, so a (block, channel) reads the widest width any
of the G heads needs (reading less for some heads would save no memory traffic). ``aligned_decode`` runs the
passes alone and also returns the widths chosen (what the bits-read accounting and the tests use).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._launch import Launcher
from ..layouts import ALIGNED_RULES, AlignedSeg
from ..switches import interpreted, switch
from .alignedkv_one import (
    _exponent,
    _first_colmax,
    _key_level,
    _key_level_ahead,
    _one_pass,
    _read_tile,
    _row_start,
    _value_level,
    _vhat,
)
from .alignedkv_vhi import _fix_pass, _keys_vhi4_pass, _keys_vhi_pass, _levels_pass
from .registry import LOG2E, Layout, register_layout
from .states import merge_partials, online_step, split_rows

LN2 = 0.6931471805599453


@triton.jit
def _keys_pass(
    q_ptr, sq_b, sq_h, KH, KM, KL, KC, VH, lens_ptr,
    x_ptr, ml_ptr, oe_ptr, lev_ptr,
    H, NBC, T, TPS, NS, HQ, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, MIN_BITS: tl.constexpr,
    KFIX: tl.constexpr, ABS: tl.constexpr, STATS: tl.constexpr, PF: tl.constexpr,
):
    """Logits (scratch, log2 units), per-split softmax statistics and Rule 2's output estimate.

    ``PF``: no load waits on another load of the same block. The next block's K_colmax is loaded one iteration
    ahead (its widths are known when the block starts, so the plane loads issue at once), and O_est's gather of the
    top token's V byte, which waits for the block's logits, is issued at the start of the next iteration and
    added there (``(oest + w v) * alpha`` is ``oest * alpha + (w alpha) v``)."""
    sp, offs_g, offs_d, gmask, q, q16, eq, L, nb_lo, nb_hi, bh, row = _row_start(
        q_ptr, sq_b, sq_h, lens_ptr, H, NBC, T, TPS, HQ, G, GP, D, BLK)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    oest = tl.zeros([GP, D], tl.float32)
    w_p = tl.zeros([GP], tl.float32)  # PF: the pending block's top-token weight (0: none), its token, its block
    a_p = tl.zeros([GP], tl.int32)
    b_p = (bh + nb_lo) * D
    if PF:
        cm_n = _first_colmax(KC, bh, nb_lo, nb_hi, offs_d, D, KFIX)
    for nb in range(nb_lo, nb_hi):
        base = (bh + nb) * D
        if PF:
            vh = tl.load(VH + b_p * BLK + offs_d[None, :] * BLK + a_p[:, None], mask=(gmask & (w_p > 0))[:, None],
                         other=0)
            lvl, cm_n = _key_level_ahead(eq, KC, cm_n, bh, nb, nb_hi, offs_d, gmask, D, MIN_BITS, KFIX)
        else:
            lvl = _key_level(eq, KC, base, offs_d, gmask, MIN_BITS, KFIX)
        if STATS:
            tl.store(lev_ptr + base + offs_d, lvl.to(tl.uint8))
        k = _read_tile(KH, KM, KL, base, lvl, offs_d, D, BLK)
        s = tl.dot(q16, k) * qk_scale
        offs_t = nb * BLK + tl.arange(0, BLK)
        s = tl.where((offs_t < L)[None, :], s, float("-inf"))
        tl.store(x_ptr + row[:, None] * T + offs_t[None, :], s, mask=gmask[:, None])
        m_new, l_i, _, alpha = online_step(m_i, l_i, s)
        # Rule 2's O_est: the block's top token per head, its V high byte (8-bit read)
        arg = tl.argmax(s, 1)
        if PF:
            oest = (oest + w_p[:, None] * _vhat(vh, ABS)) * alpha[:, None]
            w_p = tl.exp2(tl.max(s, 1) - m_new)
            a_p = arg
            b_p = base
        else:
            vh = tl.load(VH + base * BLK + offs_d[None, :] * BLK + arg[:, None], mask=gmask[:, None], other=0)
            # tl.max(s, 1) is online_step's reduce again; the compiler merges the two
            oest = oest * alpha[:, None] + tl.exp2(tl.max(s, 1) - m_new)[:, None] * _vhat(vh, ABS)
        m_i = m_new
    if PF:
        vh = tl.load(VH + b_p * BLK + offs_d[None, :] * BLK + a_p[:, None], mask=(gmask & (w_p > 0))[:, None],
                     other=0)
        oest += w_p[:, None] * _vhat(vh, ABS)
    out = row * NS + sp
    tl.store(ml_ptr + out * 2, m_i, mask=gmask)
    tl.store(ml_ptr + out * 2 + 1, l_i, mask=gmask)
    tl.store(oe_ptr + out[:, None] * D + offs_d[None, :], oest, mask=gmask[:, None])


@triton.jit
def _stats_pass(ml_ptr, oe_ptr, lse_ptr, est_ptr, NS, D: tl.constexpr, BS: tl.constexpr):
    """Splits of one (row, query head) -> lse2 (log2 units) and the normalized O_est."""
    hq = tl.program_id(0)
    b = tl.program_id(1)
    row = (b * tl.num_programs(0) + hq).to(tl.int64)
    offs_d = tl.arange(0, D)
    m_run, l_run, acc = merge_partials(ml_ptr, oe_ptr, row, NS, offs_d, D, BS, True)
    ok = l_run > 0
    tl.store(lse_ptr + row, tl.where(ok, m_run + tl.log2(tl.where(ok, l_run, 1.0)), float("-inf")))
    tl.store(est_ptr + row * D + offs_d, tl.where(ok, acc / tl.where(ok, l_run, 1.0), 0.0))


@triton.jit
def _values_pass(
    VH, VM, VL, VC, lens_ptr, x_ptr, lse_ptr, est_ptr, po_ptr, pml_ptr, lev_ptr,
    H, NBC, T, TPS, HQ, S_total, s_off,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, MIN_BITS: tl.constexpr,
    PAPER: tl.constexpr, STATS: tl.constexpr, PF: tl.constexpr,
):
    """``PF``: the next block's logits and V_colmax are loaded one iteration ahead, so a block's widths are known
    when it starts and its plane loads do not wait behind them."""
    sp, h, b, offs_g, offs_d, gmask, hq = split_rows(G, GP, D)
    row = (b * HQ + hq).to(tl.int64)
    lse2 = tl.load(lse_ptr + row, mask=gmask, other=0.0)
    eo = _exponent(tl.load(est_ptr + row[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=1.0))
    L = tl.minimum(tl.load(lens_ptr + b), T)
    nb_lo = sp * TPS
    nb_hi = tl.minimum(nb_lo + TPS, (L + BLK - 1) // BLK)
    bh = (b * H + h).to(tl.int64) * NBC
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    if PF:
        offs_n = nb_lo * BLK + tl.arange(0, BLK)
        x_n = tl.load(x_ptr + row[:, None] * T + offs_n[None, :], mask=gmask[:, None] & (offs_n < L)[None, :],
                      other=float("-inf"))
        cm_n = tl.load(VC + (bh + tl.maximum(tl.minimum(nb_lo, nb_hi - 1), 0)) * D + offs_d)  # a valid block
    for nb in range(nb_lo, nb_hi):
        base = (bh + nb) * D
        offs_t = nb * BLK + tl.arange(0, BLK)
        if PF:
            x = x_n
            cm = cm_n
            offs_n = offs_t + BLK
            x_n = tl.load(x_ptr + row[:, None] * T + offs_n[None, :], mask=gmask[:, None] & (offs_n < L)[None, :],
                          other=float("-inf"))
            cm_n = tl.load(VC + (bh + tl.minimum(nb + 1, nb_hi - 1)) * D + offs_d)
        else:
            x = tl.load(x_ptr + row[:, None] * T + offs_t[None, :], mask=gmask[:, None] & (offs_t < L)[None, :],
                        other=float("-inf"))
            cm = tl.load(VC + base + offs_d)
        lvl = _value_level(tl.max(x, 1), lse2, eo, cm, gmask, MIN_BITS, PAPER)
        if STATS:
            tl.store(lev_ptr + base + offs_d, lvl.to(tl.uint8))
        v = _read_tile(VH, VM, VL, base, lvl, offs_d, D, BLK)
        p = tl.exp2(x - lse2[:, None])
        l_i += tl.sum(p, 1)
        acc += tl.dot(p.to(tl.float16), tl.trans(v))
    out = row * S_total + s_off + sp
    tl.store(po_ptr + out[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(pml_ptr + out * 2, tl.where(lse2 > -1.0e30, lse2, -1.0e30), mask=gmask)
    tl.store(pml_ptr + out * 2 + 1, l_i, mask=gmask)


# ----------------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------------

_KEYS = Launcher(_keys_pass)
_STATS = Launcher(_stats_pass)
_VALUES = Launcher(_values_pass)
_ONE = Launcher(_one_pass)
_KEYS_VHI = Launcher(_keys_vhi_pass)
_FIX = Launcher(_fix_pass)
_KEYS_VHI4 = Launcher(_keys_vhi4_pass)
_LEVELS = Launcher(_levels_pass)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_segment(seg: AlignedSeg, D: int) -> None:
    if seg.block not in (16, 32, 64, 128, 256) or D & (D - 1) or D < 16:
        raise ValueError(f"alignedkv kernel: block must be a power of two in [16, 256] and head_dim a power of two "
                         f">= 16, got block={seg.block}, head_dim={D}")
    if seg.keys not in ALIGNED_RULES["keys"] or seg.values not in ALIGNED_RULES["values"]:
        raise ValueError(f"alignedkv kernel: keys must be one of {ALIGNED_RULES['keys']} and values one of "
                         f"{ALIGNED_RULES['values']}, got {seg.keys}, {seg.values}")
    if seg.min_bits not in (8, 12, 16) or seg.force_bits not in (0, 8, 12, 16):
        raise ValueError(f"alignedkv kernel: min_bits in (8, 12, 16), force_bits in (0, 8, 12, 16); got "
                         f"{seg.min_bits}, {seg.force_bits}")


def _words(seg: AlignedSeg, side: str):
    """(high-byte plane as int32 words, mid and low nibble planes as int16 words, colmax): four tokens per word,
    all three planes indexed alike (``_read_block``)."""
    hi, mid, low, cm = (getattr(seg, f"{side}_{n}").contiguous() for n in ("hi", "mid", "low", "colmax"))
    return hi.view(torch.int32), mid.view(torch.int16), low.view(torch.int16), cm


def run_passes(q, seg: AlignedSeg, lens, qk_scale: float, part_o, part_ml, s_off: int, nsplit: int, tps: int,
               levels: tuple | None = None) -> None:
    """The launches of one segment: partials of splits ``[s_off, s_off + nsplit)`` (``tps`` blocks each) into
    ``part_o [B, Hq, S, D]`` / ``part_ml [B, Hq, S, 2]``; ``levels`` = (K, V) uint8 ``[B, H, NB, D]`` buffers
    (zeroed by the caller) to receive the widths read, or None. Value widths from Rule 2: keys pass, statistics
    pass, values pass; value widths fixed (``values=full``, ``force_bits``): one pass."""
    B, HQ, D = q.shape
    check_segment(seg, D)
    H, NBC, BLK = seg.k_hi.shape[1], seg.k_hi.shape[2], seg.block
    T = NBC * BLK
    G = HQ // H
    GP = max(1, _pow2(G))
    S = part_o.shape[2]
    dev = q.device
    est = seg.values != "full" and not seg.force_bits
    kfix = seg.force_bits or (16 if seg.keys == "full" else 0)
    asm = not interpreted() and switch("MMKV_ALIGNED_ASM") != "0"
    stats = levels is not None
    grid = (nsplit, H, B)
    if not est:
        kw, vw = _words(seg, "k"), _words(seg, "v")
        lev_k, lev_v = levels if stats else (part_ml, part_ml)
        oc = dict(G=G, GP=GP, D=D, BLK=BLK, MIN_BITS=seg.min_bits, KFIX=kfix, VFIX=seg.force_bits or 16,
                  STATS=stats, ASM=asm)
        _ONE(grid, (q, q.stride(0), q.stride(1), *kw, *vw[:3], lens, part_o, part_ml, lev_k, lev_v,
                    H, NBC, T, tps, HQ, S, s_off, qk_scale), oc, tuple(oc.values()), num_warps=4)
        return
    k8 = [getattr(seg, f"k_{n}").contiguous() for n in ("hi", "mid", "low", "colmax")]
    v8 = [getattr(seg, f"v_{n}").contiguous() for n in ("hi", "mid", "low", "colmax")]
    x = torch.empty((B, HQ, T), dtype=torch.float32, device=dev)
    ml1 = torch.empty((B, HQ, nsplit, 2), dtype=torch.float32, device=dev)
    oe1 = torch.empty((B, HQ, nsplit, D), dtype=torch.float32, device=dev)
    lse2 = torch.empty((B, HQ), dtype=torch.float32, device=dev)
    oest = torch.empty((B, HQ, D), dtype=torch.float32, device=dev)
    lev_k, lev_v = levels if stats else (ml1, ml1)
    paper = seg.values == "paper"
    oest_mode = switch("MMKV_ALIGNED_OEST")
    if oest_mode in ("vhi", "vhi4"):
        a8 = torch.empty((B, HQ, nsplit, D), dtype=torch.float32, device=dev)
        xm = torch.empty((B, HQ, NBC), dtype=torch.float32, device=dev)
        phase = oest_mode == "vhi4" and BLK % 64 == 0  # phases of 16 tokens: tensor-core p @ V
        kc = dict(G=G, GP=GP, D=D, BLK=BLK, MIN_BITS=seg.min_bits, KFIX=kfix, ABS=paper, STATS=stats)
        tail = (lens, x, xm, ml1, oe1, a8, lev_k, H, NBC, T, tps, nsplit, HQ, qk_scale)
        if phase:
            kc["ASM"] = asm
            kw = _words(seg, "k")
            _KEYS_VHI4(grid, (q, q.stride(0), q.stride(1), *kw, v8[0].view(torch.int32), v8[0], *tail), kc,
                       tuple(kc.values()), num_warps=4)
        else:
            _KEYS_VHI(grid, (q, q.stride(0), q.stride(1), *k8, v8[0], *tail), kc, tuple(kc.values()), num_warps=4)
        _STATS((HQ, B), (ml1, oe1, lse2, oest, nsplit), dict(D=D, BS=16), (D, 16), num_warps=4)
        ch = 16
        nw = -(-NBC // ch)
        words = torch.empty((B, H, nw, D), dtype=torch.int32, device=dev)
        lc = dict(G=G, GP=GP, D=D, BLK=BLK, MIN_BITS=seg.min_bits, PAPER=paper, STATS=stats, CH=ch)
        _LEVELS((nw, H, B), (xm, lse2, oest, v8[3], lens, words, lev_v, H, NBC, nw, HQ), lc, tuple(lc.values()),
                num_warps=4)
        fc = dict(G=G, GP=GP, D=D, BLK=BLK, CH=ch, PHASE=phase)
        _FIX(grid, (*v8[:3], lens, x, words, lse2, ml1, a8, part_o, part_ml, H, NBC, nw, T, tps, nsplit, HQ, S, s_off),
             fc, tuple(fc.values()), num_warps=4)
        return
    pf = switch("MMKV_ALIGNED_PREFETCH") != "0"
    kc = dict(G=G, GP=GP, D=D, BLK=BLK, MIN_BITS=seg.min_bits, KFIX=kfix, ABS=paper, STATS=stats, PF=pf)
    _KEYS(grid, (q, q.stride(0), q.stride(1), *k8, v8[0], lens, x, ml1, oe1, lev_k,
                 H, NBC, T, tps, nsplit, HQ, qk_scale), kc, tuple(kc.values()), num_warps=4)
    sc = dict(D=D, BS=16)
    _STATS((HQ, B), (ml1, oe1, lse2, oest, nsplit), sc, tuple(sc.values()), num_warps=4)
    vc = dict(G=G, GP=GP, D=D, BLK=BLK, MIN_BITS=seg.min_bits, PAPER=paper, STATS=stats, PF=pf)
    _VALUES(grid, (*v8, lens, x, lse2, oest, part_o, part_ml, lev_v,
                   H, NBC, T, tps, HQ, S, s_off), vc, tuple(vc.values()), num_warps=4)


def _launch(ctx, it) -> None:
    run_passes(ctx.q, it["seg"], it["lens"], ctx.qk_scale, ctx.part_o, ctx.part_ml, it["s_off"], it["nsplit"],
               it["tps"])


def rule_programs_per_sm(B: int, H: int, T: int) -> float:
    """Programs per SM the Rule 2 passes split their work into. Their programs wait on memory (3-4 resident per SM:
    128 / ~165 registers) and a keys pass and a values pass of different residency share one split, so whole waves
    cannot fit both; many short programs shrink both tails once the work is large. H100, graph replays, us at 3 / 4
    / 6 / 8 / 12 / 24 per SM (docs/BENCHMARKS.md, AlignedKV): InternVL heads (8 KV heads, 128) B16 n32768 1610 /
    1496 / 1469 / 1354 / 1324 / 1266, B1 n32768 122 / 117 / 122 / 132 / 151 / 213; SmolLM2 heads (3 KV, 64) B16
    n32768 333 at 4, 290 at 12."""
    work = B * H * T
    return 4.0 if work < 1 << 20 else 12.0 if work < 4 << 20 else 24.0


def _wave_tiles(seg: AlignedSeg, it, B, H, G, D, nsm) -> int:
    """Tiles per split of the Rule 2 passes (the planner's byte rule at ``rule_programs_per_sm``); fixed value
    widths (one pass) keep the planner's default (0)."""
    if seg.values == "full" or seg.force_bits:
        return 0
    pps = rule_programs_per_sm(B, H, it["tiles"] * seg.block)
    return max(1, int(it["tiles"] * B * H // (pps * nsm)), -(-16384 // (seg.block * D * 4)))


register_layout(AlignedSeg, Layout(
    capacity=lambda s: s.k_hi.shape[2] * s.block,
    kv_heads=lambda s: s.k_hi.shape[1],
    tile=lambda s, d: s.block,
    tile_bytes=lambda s, tt, d: tt * d * 4,  # planes of K and V at 16 bits: what a block costs at most
    launch=_launch,
    wave_tiles=_wave_tiles,
))


def aligned_decode(q: torch.Tensor, seg: AlignedSeg, sm_scale: float | None = None, splits: int | None = None):
    """The kernel on one segment alone: ``q [B, Hq, D]`` -> ``(out [B, Hq, D] fp32, lse [B, Hq], k_levels,
    v_levels)`` like ``reference.aligned_attention`` (levels uint8 ``[B, H, NB, D]``, 0 where not read)."""
    B, HQ, D = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    H, NB = seg.k_hi.shape[1], seg.k_hi.shape[2]
    nsplit = splits or max(1, min(NB, 4))
    tps = -(-NB // nsplit)
    nsplit = -(-NB // tps)
    dev = q.device
    part_o = torch.full((B, HQ, nsplit, D), float("nan"), dtype=torch.float32, device=dev)
    part_ml = torch.full((B, HQ, nsplit, 2), float("nan"), dtype=torch.float32, device=dev)
    levels = (torch.zeros((B, H, NB, D), dtype=torch.uint8, device=dev),
              torch.zeros((B, H, NB, D), dtype=torch.uint8, device=dev))
    lens = seg.lens.to(device=dev, dtype=torch.int32)
    run_passes(q, seg, lens, float(sm_scale) * LOG2E, part_o, part_ml, 0, nsplit, tps, levels)
    m, l = part_ml[..., 0], part_ml[..., 1]
    w = torch.exp2(m - m.amax(-1, keepdim=True))
    den = (w * l).sum(-1)
    out = (w[..., None] * part_o).sum(-2) / den.clamp(min=1e-30)[..., None]
    out = torch.where(den[..., None] > 0, out, 0.0)
    lse = torch.where(den > 0, (m.amax(-1) + torch.log2(den.clamp(min=1e-30))) * LN2, float("-inf"))
    return out, lse, levels[0], levels[1]
