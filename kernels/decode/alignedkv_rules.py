"""AlignedKV's Rule 2 passes on the 4-token phase reader of ``alignedkv_one`` (keys pass and values pass; the
statistics pass between them and the host side live in ``alignedkv.py``). Spec: ``reference.aligned_attention``.

Both read each plane as 4-token words into four fp16 token phases (``_read_block``), so a block's bytes arrive in
the same few wide loads as in the one-pass kernel. The logits scratch stays in true token order (phase r of a
block is stored at tokens 4j + r): the statistics and the reference see the same buffer as with the tile passes.

* keys pass: Rule 1 widths, logits to the scratch, per-split (m, l), and O_est's top token per block found without
  an argmax: the lowest true token whose logit equals the block's maximum (the maximum is needed for the softmax
  anyway; the same token ``tl.argmax`` over the token-ordered tile picks).
* values pass: the widths of a block are decided first; a block whose channels all read 8 bits (the common case
  under ``values=paper``) takes a branch with no nibble loads at all, the others the masked reader.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .alignedkv_one import _exponent, _key_level, _level, _pv, _qk, _read_block, _row_start
from .states import split_rows


@triton.jit
def _keys_phase(
    q_ptr, sq_b, sq_h, KH, KM, KL, KC, VH, lens_ptr,
    x_ptr, ml_ptr, oe_ptr, lev_ptr,
    H, NBC, T, TPS, NS, HQ, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, MIN_BITS: tl.constexpr,
    KFIX: tl.constexpr, ABS: tl.constexpr, STATS: tl.constexpr, ASM: tl.constexpr,
):
    """Logits (scratch, log2 units, token order), per-split softmax statistics and Rule 2's output estimate.
    ``KH/KM/KL``: the key planes as words (``_words``); ``VH``: the value high-byte plane as bytes (the gather)."""
    Q: tl.constexpr = BLK // 4
    sp, offs_g, offs_d, gmask, q, q16, eq, L, nb_lo, nb_hi, bh, row = _row_start(
        q_ptr, sq_b, sq_h, lens_ptr, H, NBC, T, TPS, HQ, G, GP, D, BLK)
    offs_j = tl.arange(0, Q)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    oest = tl.zeros([GP, D], tl.float32)
    for nb in range(nb_lo, nb_hi):
        base = (bh + nb) * D
        lvl = _key_level(eq, KC, base, offs_d, gmask, MIN_BITS, KFIX)
        if STATS:
            tl.store(lev_ptr + base + offs_d, lvl.to(tl.uint8))
        k0, k1, k2, k3 = _read_block(KH, KM, KL, base, lvl, offs_d, Q, KFIX, ASM)
        tok = nb * BLK + 4 * offs_j
        s0, s1, s2, s3 = _qk(q16, k0, k1, k2, k3, qk_scale, tok, L)
        xp = x_ptr + row[:, None] * T + tok[None, :]
        tl.store(xp, s0, mask=gmask[:, None])
        tl.store(xp + 1, s1, mask=gmask[:, None])
        tl.store(xp + 2, s2, mask=gmask[:, None])
        tl.store(xp + 3, s3, mask=gmask[:, None])
        mx = tl.maximum(tl.maximum(tl.max(s0, 1), tl.max(s1, 1)), tl.maximum(tl.max(s2, 1), tl.max(s3, 1)))
        m_new = tl.maximum(m_i, mx)
        alpha = tl.exp2(m_i - m_new)
        c = m_new[:, None]
        l_i = l_i * alpha + (tl.sum(tl.exp2(s0 - c), 1) + tl.sum(tl.exp2(s1 - c), 1)
                             + tl.sum(tl.exp2(s2 - c), 1) + tl.sum(tl.exp2(s3 - c), 1))
        # the block's top token per head: the lowest in-block offset holding the maximum (tl.argmax's choice)
        j4 = 4 * offs_j[None, :]
        top = mx[:, None]
        arg = tl.minimum(tl.minimum(tl.min(tl.where(s0 == top, j4, BLK), 1), tl.min(tl.where(s1 == top, j4 + 1, BLK), 1)),
                         tl.minimum(tl.min(tl.where(s2 == top, j4 + 2, BLK), 1),
                                    tl.min(tl.where(s3 == top, j4 + 3, BLK), 1)))
        vh = tl.load(VH + base * BLK + offs_d[None, :] * BLK + arg[:, None], mask=gmask[:, None], other=0)
        vh = vh.to(tl.int32)
        if ABS:  # the paper rule estimates sum p |v|: drop the sign bit
            vh = vh & 0x7F
        vhat = ((vh << 8) | 0x80).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        oest = oest * alpha[:, None] + tl.exp2(mx - m_new)[:, None] * vhat
        m_i = m_new
    out = row * NS + sp
    tl.store(ml_ptr + out * 2, m_i, mask=gmask)
    tl.store(ml_ptr + out * 2 + 1, l_i, mask=gmask)
    tl.store(oe_ptr + out[:, None] * D + offs_d[None, :], oest, mask=gmask[:, None])


@triton.jit
def _values_phase(
    VH, VM, VL, VC, lens_ptr, x_ptr, lse_ptr, est_ptr, po_ptr, pml_ptr, lev_ptr,
    H, NBC, T, TPS, HQ, S_total, s_off,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, MIN_BITS: tl.constexpr,
    PAPER: tl.constexpr, STATS: tl.constexpr, ASM: tl.constexpr, BRANCH8: tl.constexpr,
):
    """Rule 2 widths per (block, channel) from the logits scratch and O_est, then ``p @ V`` on the aligned V into
    the shared split-K partials (``m = lse2``). ``VH/VM/VL``: the value planes as words (``_words``)."""
    Q: tl.constexpr = BLK // 4
    sp, h, b, offs_g, offs_d, gmask, hq = split_rows(G, GP, D)
    row = (b * HQ + hq).to(tl.int64)
    lse2 = tl.load(lse_ptr + row, mask=gmask, other=0.0)
    eo = _exponent(tl.load(est_ptr + row[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=1.0))
    L = tl.minimum(tl.load(lens_ptr + b), T)
    nb_lo = sp * TPS
    nb_hi = tl.minimum(nb_lo + TPS, (L + BLK - 1) // BLK)
    bh = (b * H + h).to(tl.int64) * NBC
    offs_j = tl.arange(0, Q)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for nb in range(nb_lo, nb_hi):
        base = (bh + nb) * D
        tok = nb * BLK + 4 * offs_j
        xp = x_ptr + row[:, None] * T + tok[None, :]
        x0 = tl.load(xp, mask=gmask[:, None] & (tok < L)[None, :], other=float("-inf"))
        x1 = tl.load(xp + 1, mask=gmask[:, None] & (tok + 1 < L)[None, :], other=float("-inf"))
        x2 = tl.load(xp + 2, mask=gmask[:, None] & (tok + 2 < L)[None, :], other=float("-inf"))
        x3 = tl.load(xp + 3, mask=gmask[:, None] & (tok + 3 < L)[None, :], other=float("-inf"))
        mx = tl.maximum(tl.maximum(tl.max(x0, 1), tl.max(x1, 1)), tl.maximum(tl.max(x2, 1), tl.max(x3, 1)))
        logp = tl.where(gmask, mx - lse2, -1.0e9)
        ev = tl.maximum(tl.load(VC + base + offs_d).to(tl.int32), 1) - 15
        if PAPER:  # the authors' thresholds (reference.value_levels_paper)
            gap = (eo - 1 - ev[None, :]).to(tl.float32) - logp[:, None]
            need = tl.where(gap < 1, 16, tl.where(gap < 2, 12, 8))
        else:  # conservative (reference.value_levels)
            add = tl.floor(logp).to(tl.int32)[:, None] + ev[None, :] + 1
            need = _level(eo - add)
        lvl = tl.maximum(tl.max(tl.where(gmask[:, None], need, 0), 0), MIN_BITS)
        if STATS:
            tl.store(lev_ptr + base + offs_d, lvl.to(tl.uint8))
        if BRANCH8:
            if tl.max(lvl, 0) == 8:  # every channel at 8 bits: the high bytes only, no nibble instructions
                v0, v1, v2, v3 = _read_block(VH, VM, VL, base, lvl, offs_d, Q, 8, ASM)
            else:
                v0, v1, v2, v3 = _read_block(VH, VM, VL, base, lvl, offs_d, Q, 0, ASM)
        else:
            v0, v1, v2, v3 = _read_block(VH, VM, VL, base, lvl, offs_d, Q, 0, ASM)
        c = lse2[:, None]
        p0 = tl.exp2(x0 - c)
        p1 = tl.exp2(x1 - c)
        p2 = tl.exp2(x2 - c)
        p3 = tl.exp2(x3 - c)
        l_i += tl.sum(p0, 1) + tl.sum(p1, 1) + tl.sum(p2, 1) + tl.sum(p3, 1)
        acc = _pv(acc, p0, v0, Q)
        acc = _pv(acc, p1, v1, Q)
        acc = _pv(acc, p2, v2, Q)
        acc = _pv(acc, p3, v3, Q)
    out = row * S_total + s_off + sp
    tl.store(po_ptr + out[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(pml_ptr + out * 2, tl.where(lse2 > -1.0e30, lse2, -1.0e30), mask=gmask)
    tl.store(pml_ptr + out * 2 + 1, l_i, mask=gmask)
