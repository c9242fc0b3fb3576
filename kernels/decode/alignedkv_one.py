"""AlignedKV's one-pass decode kernel (value widths fixed before the softmax: ``force_bits``, ``values=full``) and
the Rule 1 width helpers it shares with the Rule 2 passes of ``alignedkv.py`` (the host side and the layout
registration live there). Layout: ``kernels/layouts.py``; spec: ``reference.aligned_attention``."""

from __future__ import annotations

import triton
import triton.language as tl

from .states import split_rows


@triton.jit
def _exponent(x):
    """floor(log2|x|) of fp32 ``x`` from its exponent field (0 gives -127), exactly as the reference."""
    return ((tl.abs(x).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _row_start(q_ptr, sq_b, sq_h, lens_ptr, H, NBC, T, TPS, HQ,
               G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr):
    """What every AlignedKV kernel starts from: its split, query-head offsets and mask, the G query heads (fp32,
    fp16 and their exponents), the row's length, its key blocks ``[nb_lo, nb_hi)``, the (row, KV head)'s first block
    and the query heads' output rows."""
    sp, h, b, offs_g, offs_d, gmask, hq = split_rows(G, GP, D)
    q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + offs_d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32)
    L = tl.minimum(tl.load(lens_ptr + b), T)
    nb_lo = sp * TPS
    nb_hi = tl.minimum(nb_lo + TPS, (L + BLK - 1) // BLK)
    bh = (b * H + h).to(tl.int64) * NBC
    row = (b * HQ + hq).to(tl.int64)
    return sp, offs_g, offs_d, gmask, q, q.to(tl.float16), _exponent(q), L, nb_lo, nb_hi, bh, row


@triton.jit
def _level(gap):
    """Bits for an addend ``gap`` binades below the reference precision (``reference.level_of_gap``)."""
    return tl.where(gap < 4, 16, tl.where(gap < 8, 12, 8))


# Four tokens per lane element: the high-byte plane is read as int32 words (tokens 4j..4j+3 of a channel), each
# nibble plane as int16 words (the same four tokens), so all three share one index and one [D, BLK/4] tile and the
# bytes of a token never cross lanes (no join/reshape, no layout conversion before the MMA operand). The tile comes
# back as four fp16 "phases" [D, BLK/4]: phase r holds tokens 4j + r. Token order inside a block does not matter to
# q.K or p.V, so the kernels keep this order end to end (logits scratch included) and only the masks, the top-token
# choice and the levels use true token numbers.
#
# Compiled: one inline-asm block per element, 8 instructions for 4 tokens: two shift+lop3 pairs build the low bytes
# (mid nibble << 4 | low nibble) of the even and odd tokens, two prmt interleave them with the high bytes into
# fp16x2 words, which are the two tokens' halves. Interpreted: the same with Triton integer operations.
_ASM_PHASES = tl.constexpr("{ .reg .b32 x, y, t, e, o; "
               "shl.b32 t, $5, 4; and.b32 t, t, 0xF0F0; and.b32 x, $6, 0x0F0F; or.b32 x, x, t; "
               "shr.u32 t, $6, 4; and.b32 t, t, 0x0F0F; and.b32 y, $5, 0xF0F0; or.b32 y, y, t; "
               "prmt.b32 e, x, $4, 0x6140; prmt.b32 o, y, $4, 0x7150; "
               "mov.b32 {$0, $1}, e; mov.b32 {$2, $3}, o; }")


@triton.jit
def _phases(h, m, low, ASM: tl.constexpr):
    """High-byte words ``h`` and nibble words ``m``, ``low`` (int32; only the low 16 bits count) of the same four tokens
    -> fp16 tokens (4j, 4j+1, 4j+2, 4j+3). Nibble byte i holds token 2i in its low nibble, 2i+1 in its high one."""
    if ASM:
        w0, w2, w1, w3 = tl.inline_asm_elementwise(_ASM_PHASES, "=h,=h,=h,=h,r,r,r", [h, m, low],
                                                   dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True,
                                                   pack=1)
        w0 = w0.to(tl.float16, bitcast=True)
        w1 = w1.to(tl.float16, bitcast=True)
        w2 = w2.to(tl.float16, bitcast=True)
        w3 = w3.to(tl.float16, bitcast=True)
    else:
        m = m & 0xFFFF  # int16 words were sign-extended (the asm ignores the high half)
        low = low & 0xFFFF
        x = ((m << 4) & 0xF0F0) | (low & 0x0F0F)  # low bytes of tokens 4j (byte 0) and 4j+2 (byte 1)
        y = (m & 0xF0F0) | ((low >> 4) & 0x0F0F)  # tokens 4j+1 and 4j+3
        w0 = (((h & 0xFF) << 8) | (x & 0xFF)).to(tl.uint16).to(tl.float16, bitcast=True)
        w1 = ((h & 0xFF00) | (y & 0xFF)).to(tl.uint16).to(tl.float16, bitcast=True)
        w2 = (((h >> 8) & 0xFF00) | ((x >> 8) & 0xFF)).to(tl.uint16).to(tl.float16, bitcast=True)
        w3 = (((h >> 16) & 0xFF00) | ((y >> 8) & 0xFF)).to(tl.uint16).to(tl.float16, bitcast=True)
    return w0, w1, w2, w3


@triton.jit
def _read_block(HP, MP, LP, base, lvl, offs_d, Q: tl.constexpr, FIX: tl.constexpr, ASM: tl.constexpr):
    """One (block, all channels) tile as four fp16 phases ``[D, Q]`` (``Q = block / 4``), reading the nibble planes
    only where ``lvl [D]`` asks (12: mid, 16: mid + low). The bits not read are filled with 100... by the loads'
    ``other``: a skipped mid word reads as nibbles 8 (0x8888) and the low one as 0 (8 bits: low byte 0x80); at 12
    bits only the low word is skipped and reads as 0x8888 (low nibble 8). ``FIX`` > 0: that width everywhere, the
    masks known at compile time."""
    offs_j = tl.arange(0, Q)
    idx = base * Q + offs_d[:, None] * Q + offs_j[None, :]
    h = tl.load(HP + idx)
    fill = -30584  # 0x8888 as int16
    if FIX == 16:
        m = tl.load(MP + idx).to(tl.int32)
        low = tl.load(LP + idx).to(tl.int32)
    elif FIX == 12:
        m = tl.load(MP + idx).to(tl.int32)
        low = tl.full(idx.shape, 0x8888, tl.int32)
    elif FIX == 8:
        m = tl.full(idx.shape, 0x8888, tl.int32)
        low = tl.zeros(idx.shape, tl.int32)
    else:
        lv = lvl[:, None]
        m = tl.load(MP + idx, mask=lv >= 12, other=fill).to(tl.int32)
        low = tl.load(LP + idx, mask=lv >= 16, other=tl.where(lv == 12, fill, 0)).to(tl.int32)
    return _phases(h, m, low, ASM)


@triton.jit
def _read_tile(hi_ptr, mid_ptr, low_ptr, base, lvl, offs_d, D: tl.constexpr, BLK: tl.constexpr):
    """One (block, all channels) tile as fp16 ``[D, BLK]`` in token order from the byte planes, reading the nibble
    planes only where ``lvl [D]`` asks (12: mid, 16: mid + low) and filling the rest with 100... The Rule 2 passes
    use it: the 4-token phase reader of ``alignedkv_one`` needs more registers than they can spare."""
    H2: tl.constexpr = BLK // 2
    offs_t = tl.arange(0, BLK)
    offs_h = tl.arange(0, H2)
    hi = tl.load(hi_ptr + base * BLK + offs_d[:, None] * BLK + offs_t[None, :]).to(tl.int32)
    nib = base * H2 + offs_d[:, None] * H2 + offs_h[None, :]
    mid = tl.load(mid_ptr + nib, mask=(lvl >= 12)[:, None], other=0).to(tl.int32)
    low = tl.load(low_ptr + nib, mask=(lvl >= 16)[:, None], other=0).to(tl.int32)
    mid = tl.reshape(tl.join(mid & 15, mid >> 4), (D, BLK))  # byte i: token 2i low nibble, 2i+1 high nibble
    low = tl.reshape(tl.join(low & 15, low >> 4), (D, BLK))
    lv = lvl[:, None]
    low_byte = tl.where(lv == 8, 0x80, (mid << 4) | tl.where(lv == 12, 8, low))
    return ((hi << 8) | low_byte).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _vhat(vh, ABS: tl.constexpr):
    """V high bytes -> the 8-bit read as fp32 (``ABS``: the paper rule estimates sum p |v|: drop the sign bit)."""
    vh = vh.to(tl.int32)
    if ABS:
        vh = vh & 0x7F
    return ((vh << 8) | 0x80).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _qk(q16, k0, k1, k2, k3, qk_scale, tok, L):
    """The block's logits per phase ``[GP, Q]`` (log2 units), -inf past ``L``; ``tok`` = true token of phase 0."""
    s0 = tl.where((tok < L)[None, :], tl.dot(q16, k0) * qk_scale, float("-inf"))
    s1 = tl.where((tok + 1 < L)[None, :], tl.dot(q16, k1) * qk_scale, float("-inf"))
    s2 = tl.where((tok + 2 < L)[None, :], tl.dot(q16, k2) * qk_scale, float("-inf"))
    s3 = tl.where((tok + 3 < L)[None, :], tl.dot(q16, k3) * qk_scale, float("-inf"))
    return s0, s1, s2, s3


@triton.jit
def _pv(acc, p, v, Q: tl.constexpr):
    """acc [GP, D] += p [GP, Q] @ v [D, Q]^T: tensor cores where Q reaches their k of 16 (block >= 64)."""
    if Q >= 16:
        acc += tl.dot(p.to(tl.float16), tl.trans(v))
    else:
        acc += tl.sum(p.to(tl.float16).to(tl.float32)[:, None, :] * v.to(tl.float32)[None, :, :], 2)
    return acc


@triton.jit
def _key_level(eq, KC, base, offs_d, gmask, MIN_BITS: tl.constexpr, FIX: tl.constexpr):
    """Rule 1 for one block: the widest width any of the G heads needs per channel, floored (or ``FIX``)."""
    if FIX > 0:
        lvl = tl.full(offs_d.shape, FIX, tl.int32)
    else:
        lvl = _key_level_of(eq, tl.load(KC + base + offs_d), gmask, MIN_BITS)
    return lvl


@triton.jit
def _first_colmax(KC, bh, nb_lo, nb_hi, offs_d, D: tl.constexpr, FIX: tl.constexpr):
    """K_colmax of a split's first block (a valid block even for an empty split), the start of
    ``_key_level_ahead``'s chain; with ``FIX`` > 0 a placeholder that is never read."""
    if FIX == 0:
        cm = tl.load(KC + (bh + tl.maximum(tl.minimum(nb_lo, nb_hi - 1), 0)) * D + offs_d)
    else:
        cm = tl.zeros(offs_d.shape, tl.uint8)
    return cm


@triton.jit
def _key_level_ahead(eq, KC, cm, bh, nb, nb_hi, offs_d, gmask, D: tl.constexpr, MIN_BITS: tl.constexpr,
                     FIX: tl.constexpr):
    """Rule 1 for block ``nb`` from its K_colmax ``cm``, loaded one block earlier so that the block's plane loads
    need not wait for it, and the next block's K_colmax (``FIX`` > 0: that width, nothing loaded)."""
    if FIX > 0:
        lvl = tl.full(offs_d.shape, FIX, tl.int32)
        nxt = cm
    else:
        nxt = tl.load(KC + (bh + tl.minimum(nb + 1, nb_hi - 1)) * D + offs_d)
        lvl = _key_level_of(eq, cm, gmask, MIN_BITS)
    return lvl, nxt


@triton.jit
def _key_level_of(eq, colmax, gmask, MIN_BITS: tl.constexpr):
    """Rule 1 from the block's K_colmax bytes ``[D]`` (already loaded)."""
    ek = tl.maximum(colmax.to(tl.int32), 1) - 15
    add = eq + ek[None, :] + 1  # exponent bound of each addend q_d * k_td
    gap = tl.max(add, 1)[:, None] - add
    return tl.maximum(tl.max(tl.where(gmask[:, None], _level(gap), 0), 0), MIN_BITS)


@triton.jit
def _value_level(xmax, lse2, eo, cm, gmask, MIN_BITS: tl.constexpr, PAPER: tl.constexpr):
    """Rule 2 for one block: the widest value width any of the G heads needs per channel, floored. ``xmax [GP]``:
    the block's largest logit per head (log2 units), ``lse2 [GP]``, ``eo [GP, D]``: E(O_est), ``cm [D]``: V_colmax."""
    logp = tl.where(gmask, xmax - lse2, -1.0e9)
    ev = tl.maximum(cm.to(tl.int32), 1) - 15
    if PAPER:  # the authors' thresholds: log2 max p vs T_d = E(sum p|v|) - 1 - e_d (reference.value_levels_paper)
        gap = (eo - 1 - ev[None, :]).to(tl.float32) - logp[:, None]
        need = tl.where(gap < 1, 16, tl.where(gap < 2, 12, 8))
    else:  # conservative: addend p_t v_td below 2**(floor(log2 max p) + e_d + 1), aligned to E(O_est_d)
        add = tl.floor(logp).to(tl.int32)[:, None] + ev[None, :] + 1
        need = _level(eo - add)
    return tl.maximum(tl.max(tl.where(gmask[:, None], need, 0), 0), MIN_BITS)


@triton.jit
def _softmax4(s0, s1, s2, s3, m_i, l_i):
    """One block's online-softmax step over its four logit phases (log2 units): (the block's maximum, the new
    running maximum, the old state's rescale, the four phases' weights, the new running sum)."""
    mx = tl.maximum(tl.maximum(tl.max(s0, 1), tl.max(s1, 1)), tl.maximum(tl.max(s2, 1), tl.max(s3, 1)))
    m_new = tl.maximum(m_i, mx)
    alpha = tl.exp2(m_i - m_new)
    p0 = tl.exp2(s0 - m_new[:, None])
    p1 = tl.exp2(s1 - m_new[:, None])
    p2 = tl.exp2(s2 - m_new[:, None])
    p3 = tl.exp2(s3 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p0, 1) + tl.sum(p1, 1) + tl.sum(p2, 1) + tl.sum(p3, 1)
    return mx, m_new, alpha, p0, p1, p2, p3, l_i


@triton.jit
def _one_pass(
    q_ptr, sq_b, sq_h, KH, KM, KL, KC, VH, VM, VL, lens_ptr, po_ptr, pml_ptr, levk_ptr, levv_ptr,
    H, NBC, T, TPS, HQ, S_total, s_off, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, MIN_BITS: tl.constexpr,
    KFIX: tl.constexpr, VFIX: tl.constexpr, STATS: tl.constexpr, ASM: tl.constexpr,
):
    """Values at a width known before the softmax (``values=full`` or ``force_bits``): no output estimate, so keys
    and values go in one pass with an online softmax (no logits scratch, no statistics launch), straight into the
    shared split-K partials."""
    Q: tl.constexpr = BLK // 4
    sp, offs_g, offs_d, gmask, q, q16, eq, L, nb_lo, nb_hi, bh, row = _row_start(
        q_ptr, sq_b, sq_h, lens_ptr, H, NBC, T, TPS, HQ, G, GP, D, BLK)
    offs_j = tl.arange(0, Q)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    vl = tl.full([D], VFIX, tl.int32)
    for nb in range(nb_lo, nb_hi):
        base = (bh + nb) * D
        lvl = _key_level(eq, KC, base, offs_d, gmask, MIN_BITS, KFIX)
        if STATS:
            tl.store(levk_ptr + base + offs_d, lvl.to(tl.uint8))
            tl.store(levv_ptr + base + offs_d, vl.to(tl.uint8))
        k0, k1, k2, k3 = _read_block(KH, KM, KL, base, lvl, offs_d, Q, KFIX, ASM)
        v0, v1, v2, v3 = _read_block(VH, VM, VL, base, vl, offs_d, Q, VFIX, ASM)
        s0, s1, s2, s3 = _qk(q16, k0, k1, k2, k3, qk_scale, nb * BLK + 4 * offs_j, L)
        _mx, m_new, alpha, p0, p1, p2, p3, l_i = _softmax4(s0, s1, s2, s3, m_i, l_i)
        acc = acc * alpha[:, None]
        acc = _pv(acc, p0, v0, Q)
        acc = _pv(acc, p1, v1, Q)
        acc = _pv(acc, p2, v2, Q)
        acc = _pv(acc, p3, v3, Q)
        m_i = m_new
    out = row * S_total + s_off + sp
    tl.store(po_ptr + out[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(pml_ptr + out * 2, m_i, mask=gmask)
    tl.store(pml_ptr + out * 2 + 1, l_i, mask=gmask)
