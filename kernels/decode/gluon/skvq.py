"""Gluon kernel for SKVQ segments (``SkvqSeg``: 1- or 2-bit keys, 1-, 1.5- or 2-bit values, head_dim 64 or 128),
NVIDIA sm_80+.

The Triton kernel (``kernels/decode/skvq.py``) dequantizes every element with its token's group scale before the
MMA. Here both sides are post-scaled, so codes enter the tensor cores as exact small integers and the per-token
group scales touch only ``[tokens, heads]`` MMA results:

* MMA columns are (group, head) pairs, ``NC = GP * NGP`` of them (groups padded to a power of two, heads to at
  least 8 / NGP): groups ride in the MMA's N dimension instead of one MMA chain and accumulator each, so g64 at
  head_dim 128 with 4 query heads per KV head costs what g128 does (8 columns either way).
* keys: ``logit_t = sum_g s_tg (q_g . c_t) + z_tg sum_{d in g} q_d``, ``q_g`` = q restricted to group g's channels.
  The A operand is the codes ``[16 tokens, D]``, the B operand column (g, head) is ``q_g`` of that head (built once
  per program, from q gathered through ``k_perm`` and masked by ``k_gid``); each column is scaled by its token's
  group scale and zero term, then the columns of a head are summed over groups (in-warp shuffles).
* values: ``out_d = sum_t (p_t s_tg(d)) c_td + sum_t p_t z_tg(d)``. The A operand is the codes ``V^T [D, 16
  tokens]``, the B operand column (g, head) is ``p * s_g`` (moved from the accumulator layout by ``movmatrix``);
  one accumulator ``[D, NC]``; the zero term ``sum_t p_t z_tg`` is one value per column. At the end each channel
  keeps the column of its own group (``v_gid``) and is stored through ``v_perm``.
* channel relabelling: q is contracted with the codes, so the kernel may give the codes any channel order as long
  as q gets the same one. Each lane loads its own contiguous bytes of a token (K: D/4 channels of tokens g and
  g + 8; V: D/8 channels of 4 tokens) and the MMA fragment position a code lands in *defines* its logical channel
  (``_k_phys``/``_v_phys``); q's B operand is gathered in that order once per program, the output is scattered
  from it once. No shared memory per element, no storage change.
* conversion: ``prmt`` puts one byte of two tokens (V) or two bytes of one token (K) into the two halves of a
  register, one ``lop3`` ORs a bit plane into the mantissa of ``2**(10 - bits*i)`` (whose last place is then worth
  1 at that plane) and one ``sub.f16x2`` leaves the two codes exactly: two instructions per two codes and plane.
* FP8 (E4M3) scale/zero bytes are widened exactly as in ``skvq.py``'s ``_widen``.

Each warp keeps its own online softmax over its ``NS * 16`` tokens per iteration; the warps merge once, at the end;
the program writes the split-K partial ``(acc, m, l)`` that ``dispatch.py`` merges (``registry.Layout``).

Ternary values (``v_bits`` 1.5, ``TERN``) replace the V operand and the final channel map with ``ternary.py``'s; at
head_dim 128 with a capacity that is a multiple of 16 (``TLANE``) their bytes come from two addresses per lane at
fixed offsets (``t_operand_lanes``). Splits fill whole waves of resident programs (``decode/skvq.py:_wave_tiles``).
Requirements (``skvq_gluon_ok``): k_bits 1 or 2, v_bits 1, 1.5 or 2 (3-bit planes take the Triton kernel), D 64
or 128, G <= 8, at most 16 columns (G <= 8 with 2 groups, G <= 4 with 4, G <= 2 with 8).
"""

from __future__ import annotations

import math

from ..._launch import Launcher
from ...layouts import TERNARY as TERN_BITS
from ..skvq_rules import skvq_unmasked
from .operands import HAVE_GLUON
from .skvq_layouts import NS_DEFAULT, gluon_tile, skvq_consts  # noqa: F401  (gluon_tile: callers import it here)
from .skvq_ok import _RESIDENT, _record_resident, _word, columns, seg_prefetch_pair, skvq_regs, tern_lanes

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from .operands import _gdc, _prmt
    from .postscale import _groups_summed, _p_cols, _widen
    from .skvq_prefetch import _skvq_prefetch
    from .ternary import t_digits, t_index, t_lanes, t_operand, t_operand_lanes, t_phys

    @gluon.constexpr_function
    def _sel2(b0, b1):  # prmt: byte b0 of the first word -> bytes 0, 1; byte b1 of the second -> bytes 2, 3
        return f"prmt.b32 $0, $1, $2, {b0 | (b0 << 4) | ((4 + b1) << 8) | ((4 + b1) << 12):#x};"

    @gluon.constexpr_function
    def _cv(bits, i):
        m = ((1 << bits) - 1) << (bits * i)
        magic = (10 - bits * i + 15) << 10  # fp16 2**(10 - bits*i): its last place is 2**-(bits*i)
        m2 = m | (m << 16)
        g2 = magic | (magic << 16)
        return f"{{ .reg .b32 t, g; mov.b32 g, {g2:#x}; lop3.b32 t, $1, {m2:#x}, g, 0xea; sub.rn.f16x2 $0, t, g; }}"

    @gluon.constexpr_function
    def _log2(n):
        return int(math.log2(n))

    @gluon.jit
    def _cvt(P2, BITS: gl.constexpr, I: gl.constexpr):
        """Register pairs ``P2`` (int32 [..., 2], both the same word: one byte in bytes 0 and 2) -> fp16 [..., 2], the
        codes of plane ``I`` of both bytes, exact."""
        return gl.inline_asm_elementwise(_cv(BITS, I), "=r,r,r", [P2], dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _stack(ys):
        """A tuple of 1, 2, 4 or 8 equal tensors -> one tensor with log2(len) new trailing axes, low bit first."""
        if len(ys) == 1:
            r = ys[0]
        elif len(ys) == 2:
            r = gl.join(ys[0], ys[1])
        elif len(ys) == 4:
            r = gl.join(gl.join(ys[0], ys[1]), gl.join(ys[2], ys[3]))
        else:
            r = gl.join(gl.join(gl.join(ys[0], ys[1]), gl.join(ys[2], ys[3])),
                        gl.join(gl.join(ys[4], ys[5]), gl.join(ys[6], ys[7])))
        return r

    @gluon.jit
    def _planes(P, BITS: gl.constexpr):
        """Every plane of a prmt-ed register (``_cvt``), stacked: [..., 2 (pair), plane bits]."""
        PER: gl.constexpr = 8 // BITS
        P2 = gl.join(P, P)
        if PER == 4:
            r = _stack((_cvt(P2, BITS, 0), _cvt(P2, BITS, 1), _cvt(P2, BITS, 2), _cvt(P2, BITS, 3)))
        else:
            r = _stack((_cvt(P2, BITS, 0), _cvt(P2, BITS, 1), _cvt(P2, BITS, 2), _cvt(P2, BITS, 3),
                        _cvt(P2, BITS, 4), _cvt(P2, BITS, 5), _cvt(P2, BITS, 6), _cvt(P2, BITS, 7)))
        return r

    @gluon.jit
    def _k_operand(xk, BITS: gl.constexpr, D: gl.constexpr, NWL: gl.constexpr, BW: gl.constexpr,
                   DA: gl.constexpr):
        """K code words [W, 16 tokens, 4 NWL] (lane (g, t): tokens g, g + 8, words t NWL + u) -> A operand [W, 16, D]
        in the logical channel order ``_k_phys`` inverts: k = 16 kt + 8 i0 + 2 t + e."""
        W: gl.constexpr = xk.shape[0]
        NI: gl.constexpr = _log2(8 // BITS)
        x = xk.to(gl.int32)
        if BW == 4:
            r = _stack((_planes(_prmt(x, x, _sel2(0, 1)), BITS), _planes(_prmt(x, x, _sel2(2, 3)), BITS)))
        else:
            r = _planes(_prmt(x, x, _sel2(0, 1)), BITS)
        # [W, row, t, u, e, i bits, bp] -> [W, row, u, bp, i bits (high first), t, e]
        if NI == 2:
            r = gl.permute(gl.reshape(r, [W, 16, 4, NWL, 2, 2, 2, BW // 2]), [0, 1, 3, 7, 6, 5, 2, 4])
        else:
            r = gl.permute(gl.reshape(r, [W, 16, 4, NWL, 2, 2, 2, 2, BW // 2]), [0, 1, 3, 8, 7, 6, 5, 2, 4])
        return gl.convert_layout(gl.reshape(r, [W, 16, D]), DA)

    @gluon.jit
    def _v_operand(xv, BITS: gl.constexpr, D: gl.constexpr, VB: gl.constexpr, DA: gl.constexpr):
        """V code words [W, 16 tokens, 8] (lane (g, t): word g of tokens 2t, 2t+1, 2t+8, 2t+9) -> A operand
        ``V^T`` [W, D, 16] with logical channel m = 8 (b PER + i) + g (``_v_phys``) and k = the token."""
        W: gl.constexpr = xv.shape[0]
        NI: gl.constexpr = _log2(8 // BITS)
        NB: gl.constexpr = _log2(VB)
        x = gl.permute(gl.reshape(xv.to(gl.int32), [W, 2, 4, 2, 8]), [0, 1, 2, 4, 3])  # [W, hh, t, g, a]
        x0, x1 = gl.split(x)
        if VB == 4:
            r = _stack((_planes(_prmt(x0, x1, _sel2(0, 0)), BITS), _planes(_prmt(x0, x1, _sel2(1, 1)), BITS),
                        _planes(_prmt(x0, x1, _sel2(2, 2)), BITS), _planes(_prmt(x0, x1, _sel2(3, 3)), BITS)))
        elif VB == 2:
            r = _stack((_planes(_prmt(x0, x1, _sel2(0, 0)), BITS), _planes(_prmt(x0, x1, _sel2(1, 1)), BITS)))
        else:
            r = _planes(_prmt(x0, x1, _sel2(0, 0)), BITS)
        # [W, hh, t, g, a, i bits, b bits] -> [W, b bits, i bits (high first), g, hh, t, a]
        if NI + NB == 3:
            r = gl.permute(gl.reshape(r, [W, 2, 4, 8, 2, 2, 2, 2]), [0, 7, 6, 5, 3, 1, 2, 4])
        else:
            r = gl.permute(gl.reshape(r, [W, 2, 4, 8, 2, 2, 2, 2, 2]), [0, 8, 7, 6, 5, 3, 1, 2, 4])
        return gl.convert_layout(gl.reshape(r, [W, D, 16]), DA)

    @gluon.jit
    def _k_phys(k, BITS: gl.constexpr, NWL: gl.constexpr, BW: gl.constexpr):
        """Stored channel of logical K channel ``k`` (``_k_operand``'s order)."""
        PER: gl.constexpr = 8 // BITS
        HP: gl.constexpr = PER // 2
        BPW: gl.constexpr = BW // 2
        e = k % 2
        t = (k // 2) % 4
        i = 2 * ((k // 16) % HP) + (k // 8) % 2
        bp = (k // (16 * HP)) % BPW
        u = k // (16 * HP * BPW)
        return ((t * NWL + u) * BW + 2 * bp + e) * PER + i

    @gluon.jit
    def _v_phys(m, D: gl.constexpr):
        """Stored channel of logical V channel ``m`` (``_v_operand``'s order): lane row m % 8 holds D/8 in a row."""
        return (D // 8) * (m % 8) + m // 8

    @gluon.jit
    def _s_load(ptr, off, sm, cgok, PHASE: gl.constexpr, ALL_GROUPS: gl.constexpr):
        """A (token, group) scale or zero: masked by the token and the column's group (``sm``) in the masked body,
        by the group alone in the unmasked one, unmasked there where every column's group is real."""
        if PHASE == 1:
            return gl.load(ptr + off, mask=sm, other=0)
        if ALL_GROUPS:
            return gl.load(ptr + off)
        return gl.load(ptr + off, mask=cgok, other=0)

    @gluon.jit
    def _skvq_kernel(
        q_ptr, sq_b, sq_h,
        kc_ptr, kc_b, kc_h, ks_ptr, kz_ptr, ks_b, ks_h,
        vc_ptr, vc_b, vc_h, vs_ptr, vz_ptr, vs_b, vs_h,
        pk_ptr, gk_ptr, pv_ptr, gv_ptr, lens_ptr, T, TPS,
        out_ptr, ml_ptr, HQ, S_total, s_off, qk_scale,
        G: gl.constexpr, D: gl.constexpr, NG: gl.constexpr, KBITS: gl.constexpr, VBITS: gl.constexpr,
        FIXED_K: gl.constexpr, FIXED_V: gl.constexpr, KPERM: gl.constexpr, VPERM: gl.constexpr,
        FP8: gl.constexpr, W: gl.constexpr, NS: gl.constexpr, GP: gl.constexpr, NGP: gl.constexpr,
        KXL: gl.constexpr, VXL: gl.constexpr, QBL: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr,
        DB: gl.constexpr, TERN: gl.constexpr, VTL: gl.constexpr, TLANE: gl.constexpr, PL: gl.constexpr,
        PDL: gl.constexpr, DEP: gl.constexpr, UNMASKED: gl.constexpr, PFD: gl.constexpr, PFN: gl.constexpr,
    ):
        KBPT: gl.constexpr = D * KBITS // 32  # key bytes per lane and token
        BW: gl.constexpr = 4 if KBPT >= 4 else KBPT  # key word bytes
        NWL: gl.constexpr = KBPT // BW  # key words per lane and token
        KW: gl.constexpr = 4 * NWL  # key words per token
        VB: gl.constexpr = D * VBITS // 64  # value word bytes (one word per lane row and token)
        TW: gl.constexpr = NS * 16  # tokens of one warp per iteration
        TT: gl.constexpr = W * TW
        NC: gl.constexpr = GP * NGP  # MMA columns: (group, head) pairs, group-major
        sp = gl.program_id(0)
        if PDL == 2:  # the merge launch may place its programs now (they wait for this kernel to end)
            sp = _gdc(sp, "launch_dependents")
        h = gl.program_id(1)
        b = gl.program_id(2)
        L = gl.minimum(gl.load(lens_ptr + b), T)
        t_lo = sp * TPS * TT
        t_hi = gl.minimum(t_lo + TPS * TT, L)
        n_it = (gl.maximum(t_hi - t_lo, 0) + TT - 1) // TT

        # ---- B operand of the keys: column (g, head) is q of that head on group g's channels, in the keys' logical
        # channel order; and q.1 per column (the zero term) ----------------------------------------------------------
        qw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, QBL))), 1), 2)
        qk = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, QBL))), 0), 2)
        qn = gl.expand_dims(gl.expand_dims(gl.arange(0, NC, layout=gl.SliceLayout(0, gl.SliceLayout(1, QBL))), 0), 1)
        kph = _k_phys(qk, KBITS, NWL, BW)
        if KPERM:
            qcol = gl.load(pk_ptr + h * D + kph).to(gl.int32)
        else:
            qcol = kph
        if FIXED_K > 0:
            kgrp = kph // FIXED_K
        else:
            kgrp = gl.load(gk_ptr + h * D + kph).to(gl.int32)
        head = qn % GP
        qv = gl.load(q_ptr + b * sq_b + (h * G + head) * sq_h + qcol + qw * 0,
                     mask=(head < G) & (kgrp == qn // GP) & (qw >= 0), other=0.0).to(gl.float32) * qk_scale
        q16 = qv.to(gl.float16)
        HL: gl.constexpr = gl.SliceLayout(1, MMA)  # [W, NC] per column
        qb = gl.convert_layout(q16, DB)
        qsum = gl.expand_dims(gl.convert_layout(gl.sum(q16.to(gl.float32), axis=1), HL), 1)

        # ---- per-token index tensors -------------------------------------------------------------------------------
        kbase = kc_ptr + b * kc_b + h * kc_h
        vbase = vc_ptr + b * vc_b + h * vc_h
        ksb = ks_ptr + b * ks_b + h * ks_h
        kzb = kz_ptr + b * ks_b + h * ks_h
        vsb = vs_ptr + b * vs_b + h * vs_h
        vzb = vz_ptr + b * vs_b + h * vs_h
        xw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, KXL))), 1), 2)
        xr = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, KXL))), 0), 2)
        xc = gl.expand_dims(gl.expand_dims(gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(1, KXL))), 0), 1)
        ktok = xw * TW + xr  # token of a K word, from the warp's first token of the step
        vw_ = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, VXL))), 1), 2)
        vr = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, VXL))), 0), 2)
        vc = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, VXL))), 0), 1)
        vtok = vw_ * TW + vr
        if TERN:  # ternary rows: bytes per token row, each lane row's 4 byte offsets and special multipliers
            if TLANE:
                lw, ls, lm, lt = t_lanes(PL, W, TW)
            else:
                vtok, toff, tmul = t_index(VTL, W, TW, D)
        aw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA))), 1), 2)
        ar = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA))), 0), 2)
        an = gl.expand_dims(gl.expand_dims(gl.arange(0, NC, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA))), 0), 1)
        rtok = aw * TW + ar  # [W, 16, 1] token of a logit row
        cg = an // GP  # [1, 1, NC] group of a column
        cgok = cg < NG

        zk = gl.zeros([W, 16, NC], gl.float32, layout=MMA)
        acc = gl.zeros([W, D, NC], gl.float32, layout=MMA)
        zacc = gl.zeros([W, 16, NC], gl.float32, layout=MMA)
        l_acc = gl.zeros([W, 16, NC], gl.float32, layout=MMA)
        m_i = gl.full([W, NC], -1.0e30, gl.float32, layout=HL)

        # the iterations whose every token is valid (t0 + TT <= L) run first through a copy of the body whose loads
        # and logits take no mask (phase 0: no predicate, no zero fill, no select), the rest (phase 1) masked, as in
        # the text kernel (``UNMASKED``)
        n_full = gl.minimum(n_it, gl.maximum(L - t_lo, 0) // TT)
        if not UNMASKED:
            n_full = gl.minimum(n_full, 0)
        # PFD > 0: every PFN-th iteration asks L2 for the bytes of iterations it + PFD .. it + PFD + PFN - 1
        # (skvq_prefetch.py): the request's address arithmetic, ~100 instructions, once for PFN iterations
        VW: gl.constexpr = (D + 4) // 5 if TERN else 8
        VROW: gl.constexpr = (D + 4) // 5 if TERN else 8 * VB
        ES: gl.constexpr = 1 if FP8 else 2
        if PFD > 0:
            for i in gl.static_range(1, PFD):
                _skvq_prefetch(kbase, vbase, ksb, kzb, vsb, vzb, t_lo + i * TT, t_hi, W, TT, KW, D * KBITS // 8,
                               VW, VROW, NG, ES)
        for phase in gl.static_range(0 if UNMASKED else 1, 2):
            for it in range(n_full * phase, n_full + (n_it - n_full) * phase):
                t0 = t_lo + it * TT
                if PFD > 0:
                    if it % PFN == 0:
                        _skvq_prefetch(kbase, vbase, ksb, kzb, vsb, vzb, t0 + PFD * TT, t_hi, W, TT * PFN, KW,
                                       D * KBITS // 8, VW, VROW, NG, ES)
                xs = ()
                vsc = ()
                tmax = gl.full([W, NC], -1.0e30, gl.float32, layout=HL)
                for s in gl.static_range(NS):
                    ts = t0 + s * 16
                    tk = ts + ktok
                    if phase == 0:
                        xk = gl.load(kbase + tk * KW + xc, eviction_policy="evict_first")
                    else:
                        xk = gl.load(kbase + tk * KW + xc, mask=(tk < T) & (xc >= 0), other=0,
                                     eviction_policy="evict_first")
                    ka = _k_operand(xk, KBITS, D, NWL, BW, DA)
                    tr = ts + rtok
                    live = tr < L
                    sm = live & cgok
                    soff = tr * NG + cg
                    ksc = _widen(_s_load(ksb, soff, sm, cgok, phase, NG == NGP), FP8)
                    kzc = _widen(_s_load(kzb, soff, sm, cgok, phase, NG == NGP), FP8)
                    x = _groups_summed(mma_v2(ka, qb, zk) * ksc + kzc * qsum, NGP, GP)
                    if phase == 1:
                        x = gl.where(live, x, float("-inf"))
                    tmax = gl.maximum(tmax, gl.max(x, axis=1))
                    xs = xs + (x,)
                    vsc = vsc + ((_widen(_s_load(vsb, soff, sm, cgok, phase, NG == NGP), FP8),
                                  _widen(_s_load(vzb, soff, sm, cgok, phase, NG == NGP), FP8)),)
                m_new = gl.maximum(m_i, tmax)
                alpha = gl.expand_dims(gl.exp2(m_i - m_new), 1)
                m_i = m_new
                l_acc = l_acc * alpha
                acc = acc * alpha
                zacc = zacc * alpha
                for s in gl.static_range(NS):
                    ts = t0 + s * 16
                    tv = ts + vtok
                    if TERN and TLANE:  # T % 16 == 0: a warp's step is wholly inside the rows or wholly past them
                        if phase == 0:
                            rb = vbase + ts * 26
                        else:  # a warp past them re-reads tokens from 0 (finite codes, p = 0 there), not past T
                            rb = vbase + (ts - (ts + lt) * (ts + lt >= T).to(gl.int32)) * 26
                        va = t_operand_lanes((rb + lw).to(gl.int64), (rb + ls).to(gl.int64), lm, DA)
                    elif TERN:
                        if phase == 0:
                            xv = gl.load(vbase + tv * ((D + 4) // 5) + toff, eviction_policy="evict_first")
                        else:
                            xv = gl.load(vbase + tv * ((D + 4) // 5) + toff, mask=(tv < T) & (toff >= 0),
                                         other=0, eviction_policy="evict_first")
                        va = t_operand(xv, tmul, D, DA)
                    else:
                        if phase == 0:
                            xv = gl.load(vbase + tv * 8 + vc, eviction_policy="evict_first")
                        else:
                            xv = gl.load(vbase + tv * 8 + vc, mask=(tv < T) & (vc >= 0), other=0,
                                         eviction_policy="evict_first")
                        va = _v_operand(xv, VBITS, D, VB, DA)
                    p = gl.exp2(xs[s] - gl.expand_dims(m_new, 1))
                    l_acc = l_acc + p
                    acc = mma_v2(va, _p_cols((p * vsc[s][0]).to(gl.float16), NC, DB), acc)
                    zacc = zacc + p * vsc[s][1]

        if PDL == 1:  # the merge launch may place its programs once every program is past its loop
            sp = _gdc(sp, "launch_dependents")
        # ---- merge the warps, keep each channel's own group, write the partial ---------------------------------
        l_w = gl.sum(l_acc, axis=1)  # [W, NC]
        m_all = gl.max(m_i, axis=0)  # [NC]
        f = gl.exp2(m_i - gl.expand_dims(m_all, 0))  # [W, NC]
        l_h = gl.sum(l_w * f, axis=0)
        OL: gl.constexpr = gl.SliceLayout(0, MMA)
        o = gl.sum(acc * gl.expand_dims(f, 1), axis=0)  # [D (logical m), NC]
        if TERN:
            o = t_digits(o, D)
        zs = gl.sum(gl.sum(zacc, axis=1) * f, axis=0)  # [NC]
        o = o + gl.expand_dims(gl.convert_layout(zs, gl.SliceLayout(0, OL)), 0)
        om = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, OL)), 1)
        on = gl.expand_dims(gl.arange(0, NC, layout=gl.SliceLayout(0, OL)), 0)
        if TERN:
            vph = t_phys(om, D)
        else:
            vph = _v_phys(om, D)
        if FIXED_V > 0:
            vgrp = vph // FIXED_V
        else:
            vgrp = gl.load(gv_ptr + h * D + vph).to(gl.int32)
        if VPERM:
            ocol = gl.load(pv_ptr + h * D + vph).to(gl.int32)
        else:
            ocol = vph
        if DEP:  # launched beside the fp16 window's kernel: this kernel's end must imply that one's (for the merge)
            sp = _gdc(sp, "wait")
        oh = on % GP
        row = (b * HQ + h * G + oh) * S_total + s_off + sp
        gl.store(out_ptr + row * D + ocol, o, mask=(oh < G) & (on // GP == vgrp))
        HS: gl.constexpr = l_h.type.layout
        hn = gl.arange(0, NC, layout=HS)  # columns 0..G-1: group 0 of each head (every group holds the same m, l)
        rowh = (b * HQ + h * G + hn) * S_total + s_off + sp
        alive = l_h > 0
        gl.store(ml_ptr + rowh * 2, gl.where(alive, gl.convert_layout(m_all, HS), -1.0e30), mask=hn < G)
        gl.store(ml_ptr + rowh * 2 + 1, l_h, mask=hn < G)


_LAUNCHER: list = []


def launch_skvq(ctx, it, seg, ks, kz, vs, vz, fp8: bool) -> None:
    """Launch over ``it``'s splits with ``it["tt"] // 32`` warps (the plan's tile, ``gluon_tile``; the caller checked
    ``skvq_gluon_ok``);
    ``ks``...``vz`` are the scale/zero tensors as the kernel reads them (FP8 as raw bytes)."""
    if not _LAUNCHER:
        _LAUNCHER.append(Launcher(_skvq_kernel))
    q, D = ctx.q, ctx.D
    kbits, vbits = seg.k_bits, seg.v_bits
    kw = seg.k_codes.view(_word(min(4, D * kbits // 32)))
    vw = seg.v_codes if vbits == TERN_BITS else seg.v_codes.view(_word(D * int(vbits) // 64))
    dev = q.device
    pk = seg.k_perm.to(dev).contiguous() if seg.k_perm is not None else kw
    pv = seg.v_perm.to(dev).contiguous() if seg.v_perm is not None else kw
    gk = seg.k_gid.to(dev).contiguous()
    gv = seg.v_gid.to(dev).contiguous()
    ng = ks.shape[3]
    tlane = vbits == TERN_BITS and tern_lanes(D, it["T"])
    pdl = it.get("pdl", 0)  # the caller launches the merge as a programmatic dependent where it is set
    dep = bool(it.get("dep"))  # launched beside the fp16 window's kernel (window_rules.window_overlap)
    unmasked = skvq_unmasked()
    W = it["tt"] // (NS_DEFAULT * 16)
    pfd, pfn = seg_prefetch_pair(seg, D)
    consts = skvq_consts(ctx.G, D, ng, kbits, vbits, seg.k_group, seg.v_group, seg.k_perm is not None,
                         seg.v_perm is not None, fp8, W=W, tlane=tlane, pdl=pdl, dep=dep, unmasked=unmasked, pfd=pfd,
                         pfn=pfn)
    args = (q, q.stride(0), q.stride(1),
            kw, kw.stride(0), kw.stride(1), ks, kz, ks.stride(0), ks.stride(1),
            vw, vw.stride(0), vw.stride(1), vs, vz, vs.stride(0), vs.stride(1),
            pk, gk, pv, gv, it["lens"], it["T"], it["tps"],
            ctx.part_o, ctx.part_ml, ctx.HQ, ctx.S, it["s_off"], ctx.qk_scale)
    regs = skvq_regs(vbits, unmasked, D, columns(ctx.G, ng))
    rkey = (ctx.G, D, ng, kbits, vbits, seg.k_group, seg.v_group, seg.k_perm is not None, seg.v_perm is not None,
            fp8, regs, W, pfd, pfn)  # skvq_ok.launch_key: variants that differ only in tlane, pdl, dep or the unmasked copy
    # (under the same register cap) hold as many programs
    kernel = _LAUNCHER[0]((it["nsplit"], ctx.H, ctx.B), args, consts, rkey + (tlane, pdl, dep, unmasked),
                          num_warps=W, num_stages=1, **({"maxnreg": regs} if regs else {}),
                          **({"launch_pdl": True} if dep else {}))
    if (dev.index, rkey) not in _RESIDENT and kernel is not None:
        _record_resident(kernel, dev.index, rkey, W)
