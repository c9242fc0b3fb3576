"""AlignedKV's Rule 2 path with the V high bytes read whole in the keys pass (``MMKV_ALIGNED_OEST=vhi``).

Why: O_est needs, per block and query head, the V high byte of the top-scoring token in every channel. In the
channel-major planes those D bytes are ``block`` bytes apart, so the gather of ``alignedkv._keys_pass`` touches one
32-byte sector per channel; with G heads picking different tokens it could pull most of the block's V high-byte plane
from DRAM (G = 4 random tokens of a 64-token block touch 94% of its sectors in expectation; ncu measured 1.55 GB
moved by that keys pass at B16 n32768, where K at 14 bits and the logits are ~1.0 GB), and the values pass then
reads the plane again. Every value width is at least 8 bits, so the high bytes are always needed: read them once,
whole, where the logits are made, and afterwards only the nibbles Rule 2 asks for.

1. **keys pass** (``_keys_vhi_pass``, grid ``(splits, H, B)``): K at Rule 1 widths (as ``_keys_pass``), the logits
   to scratch and per split ``(m, l)``; the block's V high-byte tile ``[D, block]`` is loaded with the K planes and
   used twice: ``acc8 += p @ V8`` (the 8-bit read of every value, online softmax) and O_est's top token per head
   (``tl.argmax``: the lowest token at the maximum, as ``torch.max`` in ``reference.output_estimate``), picked from
   the bytes just loaded (the gather hits L1/L2, not DRAM). It also stores each block's largest logit per head,
   all that the width decision reads of a block.
2. **statistics pass**: ``alignedkv._stats_pass``, unchanged: ``lse2`` and the normalized O_est.
3. **levels pass** (``_levels_pass``, grid ``(NB / 16, H, B)``): Rule 2 widths of 16 blocks at a time, the same
   decision as ``_values_pass`` (``reference.value_levels_paper`` / ``value_levels``), packed 2 bits per (block,
   channel) into one int32 word per channel.
4. **correction pass** (``_fix_pass``, grid ``(splits, H, B)``): per block, only channels that need 12 or 16 bits
   load anything (their high bytes, mid and low nibbles, and the block's logits), ``acc += p @ (V_w - V_8)`` (exact
   in fp16: same sign and binade, at most 8 significant bits); 16 blocks all at 8 bits cost one word load. The
   split's partial is ``acc8 * 2^(m - lse2) + acc`` with ``m = lse2``.

A block floor (``min_bits`` 12 / 16) makes every block wide: the high bytes are then read twice, and the gather
path (the default) reads less.

Measured slower than the gather path, so not the default (H100, Triton 3.6, graph replays, docs/BENCHMARKS.md,
AlignedKV, 2026-11-27): 32/8/128 heads B16 n32768 1421 us vs 1248 (``vhi4`` 1601), B1 127 vs 116, SmolLM2 heads
B16 298 vs 291; the same widths as the reference. Registers (Triton 3.6, sm_90): keys pass 168 (``vhi4`` 255),
levels 96, correction 128.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .alignedkv_one import (
    _exponent,
    _first_colmax,
    _key_level_ahead,
    _level,
    _phases,
    _pv,
    _qk,
    _read_block,
    _read_tile,
    _row_start,
    _softmax4,
    _vhat,
)
from .states import split_rows


@triton.jit
def _fp16_of(hi, low_byte):
    return ((hi << 8) | low_byte).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _keys_vhi_pass(
    q_ptr, sq_b, sq_h, KH, KM, KL, KC, VH, lens_ptr,
    x_ptr, xm_ptr, ml_ptr, oe_ptr, a8_ptr, lev_ptr,
    H, NBC, T, TPS, NS, HQ, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, MIN_BITS: tl.constexpr,
    KFIX: tl.constexpr, ABS: tl.constexpr, STATS: tl.constexpr,
):
    """Logits (scratch), block maxima, per-split ``(m, l)``, partial O_est and the 8-bit read ``acc8 = p @ V8``
    (relative to the split's ``m``). K_colmax is loaded one block ahead."""
    sp, offs_g, offs_d, gmask, q, q16, eq, L, nb_lo, nb_hi, bh, row = _row_start(
        q_ptr, sq_b, sq_h, lens_ptr, H, NBC, T, TPS, HQ, G, GP, D, BLK)
    offs_b = tl.arange(0, BLK)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    oest = tl.zeros([GP, D], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    cm_n = _first_colmax(KC, bh, nb_lo, nb_hi, offs_d, D, KFIX)
    for nb in range(nb_lo, nb_hi):
        base = (bh + nb) * D
        lvl, cm_n = _key_level_ahead(eq, KC, cm_n, bh, nb, nb_hi, offs_d, gmask, D, MIN_BITS, KFIX)
        if STATS:
            tl.store(lev_ptr + base + offs_d, lvl.to(tl.uint8))
        k = _read_tile(KH, KM, KL, base, lvl, offs_d, D, BLK)
        vrow = VH + base * BLK + offs_d * BLK  # [D]: each channel's high bytes of this block
        vh = tl.load(vrow[:, None] + offs_b[None, :])
        s = tl.dot(q16, k) * qk_scale
        offs_t = nb * BLK + offs_b
        s = tl.where((offs_t < L)[None, :], s, float("-inf"))
        tl.store(x_ptr + row[:, None] * T + offs_t[None, :], s, mask=gmask[:, None])
        mx = tl.max(s, 1)
        tl.store(xm_ptr + row * NBC + nb, mx, mask=gmask)
        m_new = tl.maximum(m_i, mx)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v8 = ((vh.to(tl.uint16) << 8) | 0x80).to(tl.float16, bitcast=True)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), tl.trans(v8))
        arg = tl.argmax(s, 1)  # ties: the lowest token, as torch.max
        top = tl.load(vrow[None, :] + arg[:, None], mask=gmask[:, None], other=0)  # bytes of the tile above
        oest = oest * alpha[:, None] + tl.exp2(mx - m_new)[:, None] * _vhat(top, ABS)
        m_i = m_new
    out = row * NS + sp
    tl.store(ml_ptr + out * 2, m_i, mask=gmask)
    tl.store(ml_ptr + out * 2 + 1, l_i, mask=gmask)
    tl.store(oe_ptr + out[:, None] * D + offs_d[None, :], oest, mask=gmask[:, None])
    tl.store(a8_ptr + out[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _keys_vhi4_pass(
    q_ptr, sq_b, sq_h, KH, KM, KL, KC, VH, VB, lens_ptr,
    x_ptr, xm_ptr, ml_ptr, oe_ptr, a8_ptr, lev_ptr,
    H, NBC, T, TPS, NS, HQ, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, MIN_BITS: tl.constexpr,
    KFIX: tl.constexpr, ABS: tl.constexpr, STATS: tl.constexpr, ASM: tl.constexpr,
):
    """``_keys_vhi_pass`` on the one-pass kernel's 4-token phase reader (``MMKV_ALIGNED_OEST=vhi4``): K and the V
    high bytes as words (``KH``/``VH`` int32, ``KM``/``KL`` int16; ``VB``: the V high bytes as bytes, for O_est's
    pick), four logit phases per block. The logits go to scratch in phase order inside each block (position
    ``r Q + j`` holds token ``4j + r``; ``_fix_pass`` with ``PHASE`` reads them so); O_est's top token is the
    lowest true token at the block maximum, as ``torch.max``."""
    Q: tl.constexpr = BLK // 4
    sp, offs_g, offs_d, gmask, q, q16, eq, L, nb_lo, nb_hi, bh, row = _row_start(
        q_ptr, sq_b, sq_h, lens_ptr, H, NBC, T, TPS, HQ, G, GP, D, BLK)
    offs_j = tl.arange(0, Q)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    oest = tl.zeros([GP, D], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    fill = tl.full([D, Q], 0x8888, tl.int32)  # the 8-bit read: nibbles 8 and 0 -> low byte 0x80
    zero = tl.zeros([D, Q], tl.int32)
    cm_n = _first_colmax(KC, bh, nb_lo, nb_hi, offs_d, D, KFIX)
    for nb in range(nb_lo, nb_hi):
        base = (bh + nb) * D
        lvl, cm_n = _key_level_ahead(eq, KC, cm_n, bh, nb, nb_hi, offs_d, gmask, D, MIN_BITS, KFIX)
        if STATS:
            tl.store(lev_ptr + base + offs_d, lvl.to(tl.uint8))
        k0, k1, k2, k3 = _read_block(KH, KM, KL, base, lvl, offs_d, Q, KFIX, ASM)
        v0, v1, v2, v3 = _phases(tl.load(VH + base * Q + offs_d[:, None] * Q + offs_j[None, :]), fill, zero, ASM)
        tok = 4 * offs_j
        s0, s1, s2, s3 = _qk(q16, k0, k1, k2, k3, qk_scale, nb * BLK + tok, L)
        xrow = x_ptr + row[:, None] * T + nb * BLK + offs_j[None, :]
        tl.store(xrow, s0, mask=gmask[:, None])
        tl.store(xrow + Q, s1, mask=gmask[:, None])
        tl.store(xrow + 2 * Q, s2, mask=gmask[:, None])
        tl.store(xrow + 3 * Q, s3, mask=gmask[:, None])
        mx, m_new, alpha, p0, p1, p2, p3, l_i = _softmax4(s0, s1, s2, s3, m_i, l_i)
        tl.store(xm_ptr + row * NBC + nb, mx, mask=gmask)
        acc = _pv(_pv(_pv(_pv(acc * alpha[:, None], p0, v0, Q), p1, v1, Q), p2, v2, Q), p3, v3, Q)
        top = mx[:, None]
        arg = tl.minimum(tl.minimum(tl.min(tl.where(s0 == top, tok[None, :], BLK), 1),
                                    tl.min(tl.where(s1 == top, tok[None, :] + 1, BLK), 1)),
                         tl.minimum(tl.min(tl.where(s2 == top, tok[None, :] + 2, BLK), 1),
                                    tl.min(tl.where(s3 == top, tok[None, :] + 3, BLK), 1)))
        vt = tl.load(VB + base * BLK + offs_d[None, :] * BLK + arg[:, None], mask=gmask[:, None], other=0)
        oest = oest * alpha[:, None] + tl.exp2(mx - m_new)[:, None] * _vhat(vt, ABS)
        m_i = m_new
    out = row * NS + sp
    tl.store(ml_ptr + out * 2, m_i, mask=gmask)
    tl.store(ml_ptr + out * 2 + 1, l_i, mask=gmask)
    tl.store(oe_ptr + out[:, None] * D + offs_d[None, :], oest, mask=gmask[:, None])
    tl.store(a8_ptr + out[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _read_extra(hi_ptr, mid_ptr, low_ptr, base, lvl, offs_d, D: tl.constexpr, BLK: tl.constexpr):
    """``V_w - V_8`` as fp16 ``[D, BLK]`` in token order: what the nibbles add to the 8-bit read at width ``lvl [D]``
    (0 for channels at 8 bits, which load nothing). Exact: both share sign, exponent and mantissa bits 9..8, so the
    difference is (low byte - 0x80) units of the last place, at most 8 significant bits."""
    H2: tl.constexpr = BLK // 2
    offs_t = tl.arange(0, BLK)
    offs_h = tl.arange(0, H2)
    more = (lvl > 8)[:, None]
    hi = tl.load(hi_ptr + base * BLK + offs_d[:, None] * BLK + offs_t[None, :], mask=more, other=0).to(tl.int32)
    nib = base * H2 + offs_d[:, None] * H2 + offs_h[None, :]
    mid = tl.load(mid_ptr + nib, mask=more, other=0).to(tl.int32)
    low = tl.load(low_ptr + nib, mask=(lvl >= 16)[:, None], other=0).to(tl.int32)
    mid = tl.reshape(tl.join(mid & 15, mid >> 4), (D, BLK))  # byte i: token 2i low nibble, 2i+1 high nibble
    low = tl.reshape(tl.join(low & 15, low >> 4), (D, BLK))
    low_byte = (mid << 4) | tl.where(lvl[:, None] == 12, 8, low)
    return tl.where(more, _fp16_of(hi, low_byte) - _fp16_of(hi, 0x80), 0.0).to(tl.float16)


@triton.jit
def _levels_pass(
    xm_ptr, lse_ptr, est_ptr, VC, lens_ptr, w_ptr, lev_ptr, H, NBC, NW, HQ,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, MIN_BITS: tl.constexpr,
    PAPER: tl.constexpr, STATS: tl.constexpr, CH: tl.constexpr,
):
    """Rule 2 value widths of CH blocks of one (row, KV head) (grid ``(NW, H, B)``, ``NW = ceil(NB / CH)``): the
    widest any of the G heads needs, floored (``_value_level`` for CH blocks at once), packed 2 bits per (block,
    channel): ``(width - 8) / 4`` of block ``c CH + i`` in bits ``2i, 2i + 1`` of channel d's int32 word. In its
    own launch, many programs wide, so that the correction pass reads one word per CH blocks and never waits on a
    block's statistics."""
    c, h, b, offs_g, offs_d, gmask, hq = split_rows(G, GP, D)
    row = (b * HQ + hq).to(tl.int64)
    offs_c = tl.arange(0, CH)
    nbs = c * CH + offs_c
    okb = nbs < (tl.minimum(tl.load(lens_ptr + b), NBC * BLK) + BLK - 1) // BLK  # blocks with a valid token
    bh = (b * H + h).to(tl.int64) * NBC
    lse2 = tl.load(lse_ptr + row, mask=gmask, other=0.0)
    eo = _exponent(tl.load(est_ptr + row[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=1.0))
    cm = tl.load(VC + (bh + nbs)[:, None] * D + offs_d[None, :], mask=okb[:, None], other=0)
    ev = tl.maximum(cm.to(tl.int32), 1) - 15
    xm = tl.load(xm_ptr + row[:, None] * NBC + nbs[None, :], mask=gmask[:, None] & okb[None, :], other=0.0)
    logps = tl.where(gmask[:, None] & okb[None, :], xm - lse2[:, None], -1.0e9)  # [GP, CH]
    lvl = tl.full(ev.shape, MIN_BITS, tl.int32)
    for g in tl.static_range(G):
        logp = tl.sum(tl.where(offs_g[:, None] == g, logps, 0.0), 0)
        eg = tl.sum(tl.where(offs_g[:, None] == g, eo, 0), 0)[None, :]
        if PAPER:  # reference.value_levels_paper
            gap = (eg - 1 - ev).to(tl.float32) - logp[:, None]
            need = tl.where(gap < 1, 16, tl.where(gap < 2, 12, 8))
        else:  # reference.value_levels
            need = _level(eg - (tl.floor(logp).to(tl.int32)[:, None] + ev + 1))
        lvl = tl.maximum(lvl, need)
    if STATS:
        tl.store(lev_ptr + (bh + nbs)[:, None] * D + offs_d[None, :], lvl.to(tl.uint8), mask=okb[:, None])
    code = tl.where(okb[:, None], (lvl - 8) >> 2, 0)
    tl.store(w_ptr + ((b * H + h) * NW + c) * D + offs_d, tl.sum(code << (2 * offs_c[:, None]), 0))


@triton.jit
def _fix_pass(
    VH, VM, VL, lens_ptr, x_ptr, w_ptr, lse_ptr, ml_ptr, a8_ptr, po_ptr, pml_ptr,
    H, NBC, NW, T, TPS, NS, HQ, S_total, s_off,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, CH: tl.constexpr, PHASE: tl.constexpr,
):
    """Per block, the nibbles' share of ``p @ V`` where a width exceeds 8, widths from ``_levels_pass``'s words
    (loaded one chunk ahead); a chunk whose blocks are all at 8 bits is skipped whole (their 8-bit read is in
    acc8). Writes the split's partial (``m = lse2``)."""
    sp, h, b, offs_g, offs_d, gmask, hq = split_rows(G, GP, D)
    row = (b * HQ + hq).to(tl.int64)
    lse2 = tl.load(lse_ptr + row, mask=gmask, other=0.0)
    L = tl.minimum(tl.load(lens_ptr + b), T)
    nb_lo = sp * TPS
    nb_hi = tl.minimum(nb_lo + TPS, (L + BLK - 1) // BLK)
    bh = (b * H + h).to(tl.int64) * NBC
    wrow = w_ptr + (b * H + h) * NW * D + offs_d
    acc = tl.zeros([GP, D], tl.float32)
    offs_b = tl.arange(0, BLK)
    if PHASE:  # token 4j + r's logit sits at r Q + j (_keys_vhi4_pass)
        pos = (offs_b % 4) * (BLK // 4) + offs_b // 4
    else:
        pos = offs_b
    c_lo = nb_lo // CH
    c_hi = (nb_hi + CH - 1) // CH
    word_n = tl.load(wrow + tl.minimum(c_lo, NW - 1) * D)
    for c in range(c_lo, c_hi):
        word = word_n
        word_n = tl.load(wrow + tl.minimum(c + 1, NW - 1) * D)
        lo = tl.maximum(c * CH, nb_lo)
        wide = tl.max(tl.where(word != 0, 1, 0), 0) > 0  # (a word may be negative: block CH - 1 at 16 bits)
        hi = tl.where(wide, tl.minimum(c * CH + CH, nb_hi), lo)  # all at 8 bits: no iteration
        for nb in range(lo, hi):
            lvl = 8 + 4 * ((word >> (2 * (nb - c * CH))) & 3)
            offs_t = nb * BLK + offs_b
            tok = (offs_t < L) & (tl.max(lvl, 0) + tl.zeros([BLK], tl.int32) > 8)
            x = tl.load(x_ptr + row[:, None] * T + (nb * BLK + pos)[None, :], mask=gmask[:, None] & tok[None, :],
                        other=float("-inf"))
            p = tl.exp2(x - lse2[:, None])
            acc += tl.dot(p.to(tl.float16), tl.trans(_read_extra(VH, VM, VL, (bh + nb) * D, lvl, offs_d, D, BLK)))
    part = row * NS + sp
    m1 = tl.load(ml_ptr + part * 2, mask=gmask, other=-1.0e30)
    l1 = tl.load(ml_ptr + part * 2 + 1, mask=gmask, other=0.0)
    a8 = tl.load(a8_ptr + part[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)
    sc = tl.where(l1 > 0, tl.exp2(m1 - lse2), 0.0)  # a split without tokens: l = 0 (and lse2 may be -inf)
    out = row * S_total + s_off + sp
    tl.store(po_ptr + out[:, None] * D + offs_d[None, :], a8 * sc[:, None] + acc, mask=gmask[:, None])
    tl.store(pml_ptr + out * 2, tl.where(lse2 > -1.0e30, lse2, -1.0e30), mask=gmask)
    tl.store(pml_ptr + out * 2 + 1, l1 * sc, mask=gmask)
