"""The Triton decode kernel for the built-in layouts (dense, channel-wise ``ChannelSeg``, KIVI/XQuant ``KiviSeg``):
one segment, one split of its token axis, all query heads of one KV head (launched by ``dispatch.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from .states import online_step, split_rows


@triton.jit
def _unpack_tokens(x, BITS: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """uint8 [R, D] packed along tokens -> int32 codes [R * PER, D], token j * PER + i (natural order)."""
    PER: tl.constexpr = 8 // BITS
    sh = (tl.arange(0, PER) * BITS)[None, :, None]
    c = (x.to(tl.int32)[:, None, :] >> sh) & ((1 << BITS) - 1)
    return tl.reshape(c, (R * PER, D))


@triton.jit
def _unpack_channels(x, BITS: tl.constexpr, TT: tl.constexpr, D: tl.constexpr):
    """uint8 [TT, D // PER] packed along channels -> int32 codes [TT, D], channel j * PER + i."""
    PER: tl.constexpr = 8 // BITS
    sh = (tl.arange(0, PER) * BITS)[None, None, :]
    c = (x.to(tl.int32)[:, :, None] >> sh) & ((1 << BITS) - 1)
    return tl.reshape(c, (TT, D))


@triton.jit
def _fold_block(q, ks_base, kz_base, s_nb, blk, offs_d, qk_scale, ratio, shift, SDK: tl.constexpr):
    """Post-scaling constants of one K scale block: (q*s*scale*ratio as fp16 [GP, D], q.z*scale*ratio+shift [GP])."""
    ks = tl.load(ks_base + blk * s_nb + offs_d * SDK).to(tl.float32)
    kz = tl.load(kz_base + blk * s_nb + offs_d * SDK).to(tl.float32)
    qs = (q * ks[None, :] * qk_scale * ratio[:, None]).to(tl.float16)
    qz = tl.sum(q * kz[None, :], 1) * qk_scale * ratio + shift
    return qs, qz


@triton.jit
def _segment_kernel(
    q_ptr, sq_b, sq_h,
    P0, P1, P2, P3, P4, P5, lens_ptr,
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9,
    T, BLK, TPS,
    cal_ptr, n_cal, tau1, tau2,
    po_ptr, pml_ptr, HQ, S_total, s_off,
    qk_scale,
    KIND: tl.constexpr, MODE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BITS: tl.constexpr, VBITS: tl.constexpr, GROUP: tl.constexpr, TT: tl.constexpr,
    SDK: tl.constexpr, SDV: tl.constexpr, SINGLE: tl.constexpr, CALIB: tl.constexpr, IEEE: tl.constexpr,
    KBLK: tl.constexpr, TRIG: tl.constexpr,
):
    """One segment, one split of its token axis, all G query heads of KV head ``h``.

    Pointer / stride meaning by KIND (row strides of the innermost two dims are compact):
      dense:   P0=k, P1=v; s0..s2 = k (b, h, t) strides, s3..s5 = v (b, h, t) strides.
      channel: P0=k_codes, P1=v_codes (same strides s0, s1 for b, h; row stride D), P2/P3 = k scale/zero
               (b, h, block strides s2, s3, s4; D stride SDK), P4/P5 = v scale/zero (s5, s6, s7; SDV).
      kivi:    P0=k_codes (s0, s1), P2/P3 = k scale/zero (s2, s3, s4; SDK), P1 = v codes [B, H, T, D/PV]
               (s5, s6), P4/P5 = v scale/zero [B, H, T, D/GROUP] (s7, s8).
    MODE 0 writes the softmax partial; MODE 1 (channel keys only) writes (min, max) of the uncalibrated logits.
    ``TRIG`` (sm_90): the next kernel, a fused channel kernel launched as its dependent, may start at once.
    """
    sp, h, b, offs_g, offs_d, gmask, hq = split_rows(G, GP, D, TRIG)
    q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + offs_d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32)
    L = tl.minimum(tl.load(lens_ptr + b), T)
    t_lo = sp * TPS * TT
    t_hi = tl.minimum(t_lo + TPS * TT, L)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    lo_i = tl.full([GP], float("inf"), tl.float32)
    hi_i = tl.full([GP], float("-inf"), tl.float32)

    if KIND == 1:
        kdt = P0.dtype.element_ty
        if IEEE:  # fp32 cache, or bf16 under the interpreter (its bf16 tl.dot is wrong): exact fp32 dots
            kdt = tl.float32
        qk = q.to(kdt)
        for t0 in range(t_lo, t_hi, TT):
            offs_t = t0 + tl.arange(0, TT)
            tm = offs_t < t_hi
            k = tl.load(P0 + b * s0 + h * s1 + offs_t[:, None] * s2 + offs_d[None, :], mask=tm[:, None], other=0.0)
            k = k.to(kdt)
            if IEEE:
                s = tl.dot(qk, tl.trans(k), input_precision="ieee") * qk_scale
            else:
                s = tl.dot(qk, tl.trans(k)) * qk_scale
            m_i, l_i, p, alpha = online_step(m_i, l_i, tl.where(tm[None, :], s, float("-inf")))
            v = tl.load(P1 + b * s3 + h * s4 + offs_t[:, None] * s5 + offs_d[None, :], mask=tm[:, None], other=0.0)
            v = v.to(kdt)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    elif KIND == 3:
        # KIVI / XQuant: the tile is dequantized in registers (K: one scale row per KBLK tokens, broadcast over
        # the block; V: one scale per GROUP channels of each token, broadcast over the group), then two fp16 dots.
        # Loading each scale once per block/group instead of once per element keeps the kernel off the LSU.
        PER: tl.constexpr = 8 // BITS
        R: tl.constexpr = TT // PER
        TR = (T + PER - 1) // PER
        NBT: tl.constexpr = TT // KBLK if TT >= KBLK else 1
        BT: tl.constexpr = KBLK if TT >= KBLK else TT
        PV: tl.constexpr = 8 // VBITS
        DV: tl.constexpr = D // PV
        NG: tl.constexpr = D // GROUP
        qh = (q * qk_scale).to(tl.float16)
        offs_r = tl.arange(0, R)
        offs_nb = tl.arange(0, NBT)
        offs_g2 = tl.arange(0, NG)
        ks_base = P2 + b * s2 + h * s3
        kz_base = P3 + b * s2 + h * s3
        for t0 in range(t_lo, t_hi, TT):
            offs_t = t0 + tl.arange(0, TT)
            tm = offs_t < t_hi
            rows = t0 // PER + offs_r
            x = tl.load(P0 + b * s0 + h * s1 + rows[:, None] * D + offs_d[None, :], mask=(rows < TR)[:, None], other=0)
            # fp16 arithmetic on purpose: packed half FMAs and half the registers of fp32 tiles; the dequantized
            # value is rounded to fp16 for the tensor cores either way
            c = tl.reshape(_unpack_tokens(x, BITS, R, D).to(tl.float16), (NBT, BT, D))
            kb = t0 // KBLK + offs_nb
            koff = kb[:, None] * s4 + offs_d[None, :] * SDK
            kbm = (kb < (T + KBLK - 1) // KBLK)[:, None]  # a tile may reach past the last block of the capacity
            ksc = tl.load(ks_base + koff, mask=kbm, other=0.0).to(tl.float16)
            kzc = tl.load(kz_base + koff, mask=kbm, other=0.0).to(tl.float16)
            k16 = tl.reshape(tl.fma(c, ksc[:, None, :], kzc[:, None, :]), (TT, D))  # one rounding, as fp32 would
            s = tl.dot(qh, tl.trans(k16))
            m_i, l_i, p, alpha = online_step(m_i, l_i, tl.where(tm[None, :], s, float("-inf")))
            xv = tl.load(P1 + b * s5 + h * s6 + offs_t[:, None] * DV + tl.arange(0, DV)[None, :],
                         mask=tm[:, None], other=0)
            cv = tl.reshape(_unpack_channels(xv, VBITS, TT, D).to(tl.float16), (TT, NG, GROUP))
            voff = offs_t[:, None] * NG + offs_g2[None, :]
            vsc = tl.load(P4 + b * s7 + h * s8 + voff, mask=tm[:, None], other=0.0).to(tl.float16)
            vzc = tl.load(P5 + b * s7 + h * s8 + voff, mask=tm[:, None], other=0.0).to(tl.float16)
            vdq = tl.reshape(tl.fma(cv, vsc[:, :, None], vzc[:, :, None]), (TT, D))
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vdq)
    else:
        PER: tl.constexpr = 8 // BITS
        R: tl.constexpr = TT // PER
        TR = (T + PER - 1) // PER
        ratio = tl.full([GP], 1.0, tl.float32)
        shift = tl.zeros([GP], tl.float32)
        if CALIB:
            gmin = tl.full([GP], float("inf"), tl.float32)
            gmax = tl.full([GP], float("-inf"), tl.float32)
            for c_ in range(n_cal):
                cb = cal_ptr + ((b * HQ + hq) * n_cal + c_) * 2
                gmin = tl.minimum(gmin, tl.load(cb, mask=gmask, other=float("inf")))
                gmax = tl.maximum(gmax, tl.load(cb + 1, mask=gmask, other=float("-inf")))
            width = gmax - gmin
            ok = width > 0
            width = tl.where(ok, width, 1.0)
            # slope floored at reference.CALIB_MIN_RATIO (0.25): calibration never inverts or flattens the order
            ratio = tl.maximum(tl.where(ok, (width + tau1 - tau2) / width, 1.0), 0.25)
            shift = tl.where(ok, (1.0 - ratio) * tl.where(ok, gmin, 0.0) - tau1, 0.0)
        ks_base = P2 + b * s2 + h * s3
        kz_base = P3 + b * s2 + h * s3
        qs, qz = _fold_block(q, ks_base, kz_base, s4, 0, offs_d, qk_scale, ratio, shift, SDK)
        offs_r = tl.arange(0, R)
        for t0 in range(t_lo, t_hi, TT):
            offs_t = t0 + tl.arange(0, TT)
            tm = offs_t < t_hi
            rows = t0 // PER + offs_r
            x = tl.load(P0 + b * s0 + h * s1 + rows[:, None] * D + offs_d[None, :], mask=(rows < TR)[:, None], other=0)
            c16 = _unpack_tokens(x, BITS, R, D).to(tl.float16)
            blk0 = t0 // BLK
            t_b = (blk0 + 1) * BLK  # first token of the next scale block
            if not SINGLE:
                qs, qz = _fold_block(q, ks_base, kz_base, s4, blk0, offs_d, qk_scale, ratio, shift, SDK)
            s = tl.dot(qs, tl.trans(c16)) + qz[:, None]
            if not SINGLE:
                if t_b < t0 + TT:  # the tile straddles two blocks (TT <= BLK: never more)
                    qs1, qz1 = _fold_block(q, ks_base, kz_base, s4, blk0 + 1, offs_d, qk_scale, ratio, shift, SDK)
                    s_nx = tl.dot(qs1, tl.trans(c16)) + qz1[:, None]
                    s = tl.where((offs_t >= t_b)[None, :], s_nx, s)
            if MODE == 1:
                lo_i = tl.minimum(lo_i, tl.min(tl.where(tm[None, :], s, float("inf")), 1))
                hi_i = tl.maximum(hi_i, tl.max(tl.where(tm[None, :], s, float("-inf")), 1))
            else:
                m_i, l_i, p, alpha = online_step(m_i, l_i, tl.where(tm[None, :], s, float("-inf")))
                p16 = p.to(tl.float16)
                xv = tl.load(P1 + b * s0 + h * s1 + rows[:, None] * D + offs_d[None, :],
                             mask=(rows < TR)[:, None], other=0)
                cv = _unpack_tokens(xv, BITS, R, D).to(tl.float16)
                vs_base = P4 + b * s5 + h * s6
                vz_base = P5 + b * s5 + h * s6
                if SINGLE:
                    p_a = p16
                else:
                    p_a = tl.where((offs_t < t_b)[None, :], p16, 0.0).to(tl.float16)
                vs = tl.load(vs_base + blk0 * s7 + offs_d * SDV).to(tl.float32)
                vz = tl.load(vz_base + blk0 * s7 + offs_d * SDV).to(tl.float32)
                pv = tl.dot(p_a, cv) * vs[None, :] + tl.sum(p_a.to(tl.float32), 1)[:, None] * vz[None, :]
                if not SINGLE:
                    if t_b < t_hi:
                        p_b = tl.where((offs_t >= t_b)[None, :], p16, 0.0).to(tl.float16)
                        vs1 = tl.load(vs_base + (blk0 + 1) * s7 + offs_d * SDV).to(tl.float32)
                        vz1 = tl.load(vz_base + (blk0 + 1) * s7 + offs_d * SDV).to(tl.float32)
                        pv += tl.dot(p_b, cv) * vs1[None, :] + tl.sum(p_b.to(tl.float32), 1)[:, None] * vz1[None, :]
                acc = acc * alpha[:, None] + pv

    row = (b * HQ + hq) * S_total + s_off + sp
    if MODE == 1:
        tl.store(pml_ptr + row * 2, lo_i, mask=gmask)
        tl.store(pml_ptr + row * 2 + 1, hi_i, mask=gmask)
    else:
        tl.store(po_ptr + row[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
        tl.store(pml_ptr + row * 2, m_i, mask=gmask)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=gmask)
