"""Gluon kernel for KIVI/XQuant segments (``KiviSeg``: 1- or 2-bit keys and values, head_dim 64 or 128), NVIDIA
sm_80+.

One launch per segment: grid ``(splits, H, B)``; a program walks its byte rows of K codes, ``W`` warps of 8 byte
rows per iteration (32 tokens with 2-bit keys, 64 with 1-bit: one key scale block, or two where blocks are 32
tokens, each with its own ``q*s`` operand and MMA, and each logit row taking its block's), and writes the same
partial ``(acc, m, l)`` as the Triton segment kernel (``dispatch.py`` merges it). Each warp keeps its own online
softmax; the warps merge once, at the end.

* K side (channel-wise, scale and zero per block of ``KBLK`` tokens; KIVI arXiv:2402.02750 Sec. 3): post-scaled.
  ``logit_t = sum_d (q_d s_bd) c_td + sum_d q_d z_bd``: per iteration each warp folds its block's scale into q
  (``q*s`` as the B operand [D, 8 heads], loaded as 16-byte vectors of D/4 consecutive channels per lane and
  relabelled into the fragment), and the zero term is one more MMA of a constant all-ones A operand with ``q*z``.
  The codes enter the tensor cores as exact fp16 subnormals exactly as in the channel kernel (``_k_operand``).
* V side (token-wise, scale and zero per token and group of channels): dequantized in registers, straight into
  the A fragment ``V^T [channel, token]``: lane row ``gl`` loads its word (the D/8 channels ``(D/8) gl + c``, inside
  one group: D*bits/64 bytes) of each of its tokens (8, or 16 with 1-bit keys), ``prmt`` pairs the same byte of
  two tokens, and per plane ``i`` one ``lop3`` ORs the plane's bits (at bit ``bits*i`` of the byte) into the
  mantissa of ``2**(10 - bits*i)``, whose last-place unit ``2**-(bits*i)`` cancels that position: the value is
  ``2**(10-bits*i) + c`` exactly; one ``sub`` leaves ``c`` and one ``fma`` gives ``c*s + z`` for two tokens. No
  shared memory, no layout conversion on the way to the MMA (``assert_trivial``). Logical channel
  ``m = 16 (c // 2) + 8 (c % 2) + gl`` of the accumulator is physical channel ``(D/8) gl + c``.
* V side, values in tile order (``KiviSeg.v_order == "tiles"``, ``POST``): post-scaled. The same words are loaded,
  but slot ``(D/8) gl + c`` holds natural channel ``m`` itself (``layouts.tile_channels``), so each 16-row MMA tile
  is 16 consecutive channels of one group, and ``out_d = sum_t (p_t s_tg) c_td + sum_t p_t z_tg``: per plane one
  ``and`` leaves two tokens' codes as fp16 subnormals ``c * 2**(bits*i - 24)``, every group's tiles take their own
  B operand ``p^T * s_g`` (scales of all groups loaded as one vector per token), the zeros are one MMA per step of
  an A operand with group g's zeros in row g, and the epilogue scales channel m by ``2**(24 - bits*plane(m))`` and
  adds its group's zero row.

* ``PFD > 0`` (sm_90): every ``PFN``-th iteration asks L2 for the bytes of iterations ``it + PFD`` to
  ``it + PFD + PFN - 1`` (``text_prefetch.py``).
* ``ST > 0``: the key code words arrive through a ``cp.async`` ring of ``ST`` shared-memory stages, ``ST - 1``
  iterations ahead, each lane reading back its own copies (``text_ring.py``).
* ``PDL`` (sm_90): the programs let the merge launch start past their loop (1) or at their start (2); ``DEP``: it
  runs beside the kernel before it and waits for it before writing; ``CL``/``FIN``: the splits of a (row, KV head)
  are one cluster that merges the row's partials into the output (``_finish``).
* ``QSM``: q (scaled, fp16) is stored to shared memory once and read back each iteration (four 16-byte loads per
  lane) instead of living in 16 registers through the loop; with a register cap at launch (``plan.text_regs``: 168
  for 1-bit keys at head_dim 128) that variant fits 3 programs of 4 warps per SM without spilling.

Requirements (``text_ok``): k_bits and v_bits 1 or 2, D 64 or 128, G <= 8, KBLK a multiple of 32, group a multiple
of D/8 (natural order) or of 16 dividing D (tile order), codes rows contiguous, fp16 value scale/zero (K scale/zero
any float dtype).
"""

from __future__ import annotations

import torch

from ..._launch import Launcher
from ..text_rules import text_bcol, text_kpair
from .operands import HAVE_GLUON
from .text_layouts import text_layouts
from .text_slots import record_resident, text_slot_key

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from .operands import _block_barrier, _gdc, _k_operand, _p_operand, _prmt, _quad, _rows_cols
    from .reduce import _cluster, _finish
    from .text_loads import _text_load
    from .text_post import _b_tokens, _groups, _post_scales, _steps, _ungroups, _unstack, _z_operand
    from .text_prefetch import _prefetch
    from .text_ring import _k_issue, _k_take, _k_words, _ks_ring, _ks_take
    from .text_svec import _svec_index
    from .text_vtile import _v_tile

    @gluon.constexpr_function
    def _k_plane_scale(bits, j, hh):  # K logit rows 8*hh + g at step j hold plane 2j + hh: undo its 2**(bits*i - 24)
        return float(2.0 ** (24 - bits * (2 * j + hh)))

    @gluon.jit
    def _hmul2(a, b):
        """fp16 ``a * b`` two elements per instruction (consecutive registers of the same layout)."""
        return gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _b_relabel(x, DB: gl.constexpr, KPAIR: gl.constexpr):
        """[W, D (physical channel p), 8] in ``LP`` -> B operand [W, D (logical k = 16 kt + 8 x + 2 tl + e), 8]: the
        logical order of the K codes' fragment. ``KPAIR`` (``_pair_bytes`` swapped the middle bytes of every word): p =
        (D/4) tl + 4 kt + 2 x + e, so each register of the fragment holds two adjacent channels, as loaded: no ``prmt``.
        Without: p = (D/4) tl + 4 kt + 2 e + x (the channel kernel's ``phi``), a register holds channels p and p + 2,
        two ``prmt`` per register pair of q*s and of q*z."""
        W: gl.constexpr = x.shape[0]
        D: gl.constexpr = x.shape[1]
        t = gl.reshape(x, [W, 4, D // 16, 2, 2, 8])
        if KPAIR:
            t = gl.permute(t, [0, 2, 3, 1, 4, 5])
        else:
            t = gl.permute(t, [0, 2, 4, 1, 3, 5])
        return gl.convert_layout(gl.reshape(t, [W, D, 8]), DB, assert_trivial=True)

    @gluon.jit
    def _pair_bytes(x):
        """K code words with bytes (b0, b1, b2, b3) -> (b0, b2, b1, b3): channels 4c, 4c+1 then land in the two fp16
        halves of one A-fragment register (``_plane``: bytes 0 and 2), 4c+2, 4c+3 in the next (bytes 1 and 3)."""
        return _prmt(x, x, "prmt.b32 $0, $1, $2, 0x3120;")

    @gluon.jit
    def _cols_merged(o, l_h, m_all):
        """``BCOL``: column c of the partial (``o`` [D, 8], ``l_h``, ``m_all`` [8]) holds head c % 4 over the tokens of
        key block c // 4 of every warp iteration; one online-softmax merge of c and c + 4 gives head c's partial
        [D, 4], [4], [4]."""
        D: gl.constexpr = o.shape[0]
        m2 = gl.reshape(m_all, [2, 4])
        mm = gl.max(m2, axis=0)
        f2 = gl.exp2(m2 - gl.expand_dims(mm, 0))
        l4 = gl.sum(gl.reshape(l_h, [2, 4]) * f2, axis=0)
        o3 = gl.reshape(o, [D, 2, 4])
        o4 = gl.sum(o3 * gl.expand_dims(gl.convert_layout(f2, gl.SliceLayout(0, o3.type.layout)), 0), axis=1)
        return o4, l4, mm

    @gluon.jit
    def _text_kernel(
        q_ptr, sq_b, sq_h,
        kc_ptr, sc_b, sc_h,
        ks_ptr, kz_ptr, sk_b, sk_h, sk_n,
        vc_ptr, svc_b, svc_h,
        vs_ptr, vz_ptr, sv_b, sv_h,
        lens_ptr, T, rows_cap,
        out_ptr, ml_ptr, HQ, S_total, s_off, it_per_prog, qk_scale,
        fo_ptr, so_b, so_h, lse_ptr,
        G: gl.constexpr, D: gl.constexpr, BITS: gl.constexpr, W: gl.constexpr, KBLK: gl.constexpr,
        GROUP: gl.constexpr, SDK: gl.constexpr, VBITS: gl.constexpr, POST: gl.constexpr, PFD: gl.constexpr,
        PFN: gl.constexpr, KPAIR: gl.constexpr, BCOL: gl.constexpr,
        QSM: gl.constexpr, SVEC: gl.constexpr, ST: gl.constexpr, KSR: gl.constexpr, RING: gl.constexpr,
        FL: gl.constexpr, PDL: gl.constexpr, CL: gl.constexpr, FIN: gl.constexpr, UNMASKED: gl.constexpr,
        DEP: gl.constexpr, XL: gl.constexpr, VL: gl.constexpr, LP: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr,
        DB: gl.constexpr, PL: gl.constexpr, VS: gl.constexpr,
    ):
        PER: gl.constexpr = 8 // BITS
        NJ: gl.constexpr = PER // 2
        RW: gl.constexpr = 8
        ROWS: gl.constexpr = W * RW
        TW: gl.constexpr = RW * PER  # tokens of one warp's rows: 32 (2-bit keys) or 64 (1-bit)
        NBLK: gl.constexpr = TW // KBLK if TW > KBLK else 1  # key blocks in them
        NG: gl.constexpr = D // GROUP
        VWD: gl.constexpr = 8  # V code words per token: 4-byte (2-bit) or 2-byte (1-bit) words, one per lane row
        sp = gl.program_id(0)
        if PDL == 2:  # the merge launch may place its programs now (they wait for this kernel to end)
            sp = _gdc(sp, "launch_dependents")
        h = gl.program_id(1)
        b = gl.program_id(2)
        L = gl.minimum(gl.load(lens_ptr + b), T)
        rows_l = (L + PER - 1) // PER
        row0 = sp * it_per_prog * ROWS
        n_it = gl.minimum(it_per_prog, (gl.maximum(rows_l - row0, 0) + ROWS - 1) // ROWS)

        kbase = kc_ptr + b * sc_b + h * sc_h
        vbase = vc_ptr + b * svc_b + h * svc_h
        xrow, xcol = _rows_cols(XL, W, RW, D // 4)
        # V words: [W, TW tokens, 8 lane rows]; token t of warp w, word gl
        vw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, VL))), 1), 2)
        vt = gl.expand_dims(gl.expand_dims(gl.arange(0, TW, layout=gl.SliceLayout(0, gl.SliceLayout(2, VL))), 0), 2)
        vg = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, VL))), 0), 1)
        vtok = vw * TW + vt  # token of the program's iteration tile
        vgrp = (vg * (D // 8)) // GROUP  # the lane row's D/8 channels lie in one group
        if POST:  # [W, TW, 8, NG]: token, (broadcast) lane row, group
            sw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, VS))))
            st = gl.arange(0, TW, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, VS))))
            sr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, VS))))
            sg = gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, VS))))
            stok = (gl.expand_dims(gl.expand_dims(gl.expand_dims(sw, 1), 2), 3) * TW
                    + gl.expand_dims(gl.expand_dims(gl.expand_dims(st, 0), 2), 3)
                    + gl.expand_dims(gl.expand_dims(gl.expand_dims(sr, 0), 1), 3) * 0)
            sng = gl.expand_dims(gl.expand_dims(gl.expand_dims(sg, 0), 1), 2)

        # q (times qk_scale, log2 units) in LP: lane (gl, tl) holds D/4 consecutive physical channels of head gl
        pw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LP))), 1), 2)
        pc = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, LP))), 0), 2)
        pn = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LP))), 0), 1)
        # BCOL: columns 4-7 repeat heads 0-3 and read the second key block of a warp's 64 tokens (``_cols_merged``)
        qh = pn % 4 if BCOL else pn
        qv = gl.load(q_ptr + b * sq_b + (h * G + qh) * sq_h + pc + pw * 0, mask=(qh < G) & (pc >= 0) & (pw >= 0),
                     other=0.0).to(gl.float32) * qk_scale
        q16 = qv.to(gl.float16)  # q*s and q*z per key block as fp16x2 products: half the instructions of fp32 ones
        if QSM:
            # q is read back from shared memory each iteration instead of living in 16 registers through the loop
            smq = gl.allocate_shared_memory(gl.float16, [W, D, 8], gl.SwizzledSharedLayout(8, 1, 8, [1, 2, 0]), q16)
            _block_barrier()
        ones = gl.full([W, 16, D], 1.0, gl.float16, layout=DA)
        zk = gl.zeros([W, 16, 8], gl.float32, layout=MMA)

        acc = gl.zeros([W, D, 8], gl.float32, layout=MMA)
        l_acc = gl.zeros([W, 16, 8], gl.float32, layout=MMA)
        z_acc = gl.zeros([W, 16, 8], gl.float32, layout=MMA)  # POST: sum_t p_t z_tg in row g
        m_i = gl.full([W, 8], -1.0e30, gl.float32, layout=gl.SliceLayout(1, MMA))
        # token of logit row v = 8 hh + g at step j: 4 g + 2 j + hh (plus the warp's first token)
        aw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA))), 1), 2)
        av = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA))), 0), 2)
        tok_row = aw * TW + (av % 8) * PER + av // 8
        ac = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA))), 0), 1)

        kptr = (ks_ptr + b * sk_b + h * sk_h, kz_ptr + b * sk_b + h * sk_h)
        vptr = (vbase, vs_ptr + b * sv_b + h * sv_h, vz_ptr + b * sv_b + h * sv_h, vgrp)
        fx = 0
        if SVEC:  # natural order: each lane's value constants as [W, 4 (tl), 8 (gl), tpl * NG] (_vec_consts)
            fx = _svec_index(W, TW, NG, D, GROUP, FL)
        # loading the next iteration's codes one ahead measured slower (202 instead of 158 registers: fewer programs);
        # PFD > 0 requests the bytes of iteration it + PFD into L2 instead (text_prefetch.py)
        # nothing past this program's own rows is requested
        rows_end = gl.minimum(gl.minimum(rows_cap, rows_l), row0 + n_it * ROWS)
        L_end = gl.minimum(L, (row0 + n_it * ROWS) * PER)
        if PFD > 0:
            for i in gl.static_range(1, PFD):
                if i < n_it:
                    _prefetch(kbase, vbase, kptr[0], kptr[1], vptr[1], vptr[2], sk_n, row0 + i * ROWS, rows_end,
                              L_end, W, D, PER, VBITS, NG, KBLK, SDK, 1)
        ksr = 0
        if ST > 0:  # the key codes' ring (text_ring.py): the first ST - 1 iterations' copies in flight
            smk = gl.allocate_shared_memory(gl.int32, [ST, W, RW, D // 4], RING)
            if KSR:
                ksr = _ks_ring(ST, NBLK, W, D, kptr[0], kptr[1], sk_n, T)
            for i in gl.static_range(ST - 1):
                _k_issue(smk, kbase, xrow, xcol, rows_cap, row0, i, n_it, ksr, D, ST, PER, KBLK, NBLK, KSR)
        # the iterations whose every token is valid (byte rows up to row0 + (it + 1) ROWS within L // PER) run first,
        # through a copy of the body whose loads and logits take no mask (phase 0: no predicate, no zero fill, no
        # select; about 10% fewer instructions an iteration in sm_90 SASS); the rest (phase 1), and every iteration of the ring's variant,
        # through the masked body
        FAST: gl.constexpr = UNMASKED and ST == 0
        n_full = gl.minimum(n_it, gl.maximum(L // PER - row0, 0) // ROWS)
        if not FAST:
            n_full = gl.minimum(n_full, 0)
        for phase in gl.static_range(0 if FAST else 1, 2):
            for it in range(n_full * phase, n_full + (n_it - n_full) * phase):
                r0 = row0 + it * ROWS
                t0 = r0 * PER
                if ST > 0:
                    xk = _k_take(smk, kbase, xrow, xcol, rows_cap, row0, it, n_it, ksr, XL, D, ST, PER, KBLK, NBLK, KSR)
                else:
                    xk = _k_words(kbase, xrow, xcol, rows_cap, r0, D, phase == 0)
                xv, sv, zv = _text_load(vptr, vtok, vg, r0, T, D, PER, VWD, NG, POST, SVEC, fx, phase == 0)
                if PFD > 0:
                    # one request every PFN iterations covers the PFN iterations from it + PFD: the six ranges'
                    # address arithmetic (89 instructions at head_dim 128) is paid once for PFN iterations
                    if it % PFN == 0:
                        if it + PFD < n_it:
                            _prefetch(kbase, vbase, kptr[0], kptr[1], vptr[1], vptr[2], sk_n, r0 + PFD * ROWS,
                                      rows_end, L_end, W, D, PER, VBITS, NG, KBLK, SDK, PFN)
                if POST:
                    sv, zv = _post_scales(vptr, stok, sng, vtok, vg, t0, T, NG, phase == 0)
                # q*s and q.z of each key block in this warp's tokens (two blocks of 32 for 1-bit keys and KBLK = 32)
                qs = ()
                c0 = ()
                if QSM:
                    q16 = smq.load(LP)
                for u in gl.static_range(1 if BCOL else NBLK):
                    if KSR:
                        ks, kz = _ks_take(ksr, it, u, LP, ST, NBLK)
                    else:
                        tb = t0 + pw * TW + (pn // 4 if BCOL else u) * KBLK
                        koff = (tb // KBLK) * sk_n + pc * SDK + pn * 0
                        if phase == 0:
                            ks = gl.load(kptr[0] + koff).to(gl.float16)
                            kz = gl.load(kptr[1] + koff).to(gl.float16)
                        else:
                            kmask = (tb < T) & (pc >= 0) & (pn >= 0)
                            ks = gl.load(kptr[0] + koff, mask=kmask, other=0.0).to(gl.float16)
                            kz = gl.load(kptr[1] + koff, mask=kmask, other=0.0).to(gl.float16)
                    qs = qs + (_b_relabel(_hmul2(q16, ks), DB, KPAIR),)
                    c0 = c0 + (mma_v2(ones, _b_relabel(_hmul2(q16, kz), DB, KPAIR), zk),)

                if KPAIR:
                    xk = _pair_bytes(xk)
                xk4 = _quad(xk)
                xk8 = _quad(xk >> 8)
                xs = ()
                tmax = gl.full([W, 8], -1.0e30, gl.float32, layout=gl.SliceLayout(1, MMA))
                for j in gl.static_range(NJ):
                    ka = _k_operand(xk4, xk8, BITS, j, DA)
                    ksc = gl.where(av < 8, _k_plane_scale(BITS, j, 0), _k_plane_scale(BITS, j, 1))
                    x = mma_v2(ka, qs[0], zk) * ksc + c0[0]
                    if BCOL:  # column block c // 4 takes byte rows 4 (c // 4) .. 4 (c // 4) + 3
                        x = gl.where((av % 8 < 4) == (ac < 4), x, float("-inf"))
                    elif NBLK == 2:  # byte rows 4-7 hold the second block's tokens
                        x = gl.where(av % 8 < 4, x, mma_v2(ka, qs[1], zk) * ksc + c0[1])
                    if phase == 1:
                        x = gl.where(t0 + tok_row + 2 * j < L, x, float("-inf"))
                    tmax = gl.maximum(tmax, gl.max(x, axis=1))
                    xs = xs + (x,)
                m_new = gl.maximum(m_i, tmax)
                alpha = gl.expand_dims(gl.exp2(m_i - m_new), 1)
                m_i = m_new
                acc = acc * alpha
                l_acc = l_acc * alpha
                if POST:
                    z_acc = z_acc * alpha
                # V words of this iteration: token (2 tl + a) PER + 2 j + hh of lane (gl, tl)
                xvj = _steps(xv, NJ)
                zvj = _steps(zv, NJ)
                if POST:
                    sgs = _unstack(sv, NG, VL)
                else:
                    svj = _steps(sv, NJ)
                for j in gl.static_range(NJ):
                    p = gl.exp2(xs[j] - gl.expand_dims(m_new, 1))
                    l_acc = l_acc + p
                    x0, x1 = gl.split(xvj[j])
                    if POST:
                        # out_d = sum_t (p_t s_tg) c_td + sum_t p_t z_tg: the scale goes into p^T once per
                        # (token, group) and the raw codes into the MMA, one 16-channel tile of one group per B operand
                        pb = _p_operand(p.to(gl.float16), DB)
                        z_acc = mma_v2(_z_operand(zvj[j], DA), pb, z_acc)
                        a_g = _groups(_v_tile(x0, x1, x0, x0, VBITS, D, DA, PL, True), NG, DA)
                        c_g = _groups(acc, NG, MMA)
                        upd = ()
                        for g in gl.static_range(NG):
                            sb = _b_tokens(_steps(sgs[g], NJ)[j], DB)
                            upd = upd + (mma_v2(a_g[g], _hmul2(pb, sb), c_g[g]),)
                        acc = _ungroups(upd, NG, MMA)
                    else:
                        # the pairs are re-joined, so that (token a=0, a=1) are the two halves of one register
                        # exactly as in join(P, P) (inline asm packs consecutive registers, not a tensor axis)
                        s0, s1 = gl.split(svj[j])
                        z0, z1 = gl.split(zvj[j])
                        a_v = _v_tile(x0, x1, gl.join(s0, s1), gl.join(z0, z1), VBITS, D, DA, PL)
                        acc = mma_v2(a_v, _p_operand(p.to(gl.float16), DB), acc)

        if PDL == 1:  # the merge launch may place its programs once every program is past its loop
            sp = _gdc(sp, "launch_dependents")
        # ---- merge the warps, write the partial ----------------------------------------------------------------
        l_w = gl.sum(l_acc, axis=1)  # [W, 8]
        m_all = gl.max(m_i, axis=0)  # [8]
        f = gl.exp2(m_i - gl.expand_dims(m_all, 0))  # [W, 8]
        l_h = gl.sum(l_w * f, axis=0)
        o = gl.sum(acc * gl.expand_dims(f, 1), axis=0)  # [D (logical m), 8]
        if POST:
            # codes in tile order: logical m is channel m, held as slot c = 2 (m // 16) + (m // 8) % 2 of its lane
            # row, i.e. plane c % (8 / VBITS) of a byte, read as c * 2**(VBITS * plane - 24): undo that, add the zeros
            OP: gl.constexpr = o.type.layout
            pm = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, OP)), 1)
            plane = (2 * (pm // 16) + (pm // 8) % 2) % (8 // VBITS)
            o = o * gl.exp2((24 - VBITS * plane).to(gl.float32))
            zo = gl.sum(z_acc * gl.expand_dims(f, 1), axis=0)  # [16, 8]: row g < NG group g's sum, the rest 0
            zg = gl.sum(gl.reshape(zo, [16 // NG, NG, 8]), axis=0)
            o3 = gl.reshape(o, [NG, GROUP, 8])
            o3 = o3 + gl.expand_dims(gl.convert_layout(zg, gl.SliceLayout(1, o3.type.layout)), 1)
            o = gl.reshape(o3, [D, 8])
        if BCOL:
            o, l_h, m_all = _cols_merged(o, l_h, m_all)
        NO: gl.constexpr = o.shape[1]
        OL: gl.constexpr = o.type.layout
        om = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, OL)), 1)
        on = gl.expand_dims(gl.arange(0, NO, layout=gl.SliceLayout(0, OL)), 0)
        if POST:
            ch = om
        else:  # logical m = 16 (c // 2) + 8 (c % 2) + gl -> physical channel (D/8) gl + c
            ch = (D // 8) * (om % 8) + 2 * (om // 16) + (om // 8) % 2
        if DEP:  # this kernel's end must imply the window's: the merge waits only for this one
            sp = _gdc(sp, "wait")
        row = (b * HQ + h * G + on) * S_total + s_off + sp
        gl.store(out_ptr + row * D + ch, o, mask=(on < G) & (om >= 0))
        HL: gl.constexpr = l_h.type.layout
        hn = gl.arange(0, NO, layout=HL)
        rowh = (b * HQ + h * G + hn) * S_total + s_off + sp
        live = l_h > 0
        gl.store(ml_ptr + rowh * 2, gl.where(live, gl.convert_layout(m_all, HL), -1.0e30), mask=hn < G)
        gl.store(ml_ptr + rowh * 2 + 1, l_h, mask=hn < G)
        if FIN > 0:  # the splits of this (row, KV head) are one cluster: it merges every partial of its rows
            r = _cluster(_cluster(sp, "arrive.release"), "wait.acquire")
            _finish(out_ptr, ml_ptr, fo_ptr, lse_ptr, so_b, so_h, b, h, r, HQ, S_total, G, D, CL, W, FIN)


_TEXT_LAUNCHER: list = []


def text_consts(G: int, D: int, bits: int, W: int, kblk: int, group: int, sdk: int, vbits: int = 2,
                post: bool = False, pfd: int = 0, qsm: bool = False, svec: bool = False, ring: int = 0,
                ksr: bool = False, pdl: int = 0, cl: int = 0, fin: int = 0, unmasked: bool = True,
                dep: bool = False, pfn: int = 1, kpair: bool = True, bcol: bool = True) -> dict:
    """The constexpr arguments of ``_text_kernel`` for one variant (``pfd``: iterations ahead it prefetches into
    L2, 0 for none; ``qsm``: q is read back from shared memory each iteration instead of kept in registers;
    ``svec``: natural order's value scale/zero as one vector load per lane, ``svec_ok``; ``ring``: stages of the
    key codes' shared-memory ring, ``text_ring.py``, 0 for none; ``ksr``: the key scale/zero rows in it too;
    ``pdl``: where the programs let the merge launch start (programmatic dependent launch, sm_90): 0 never, 1 past
    their loop, 2 at their start; ``cl``/``fin``: the splits of a (row, KV head) are one cluster of ``cl`` CTAs that
    merges the row's partials into the output (``fin`` 1, 2 with the log-sum-exp), as the channel kernel's;
    ``unmasked``: the iterations whose every token is valid run a copy of the loop body without masks; ``dep``:
    launched as the previous kernel's programmatic dependent, it waits for that kernel before writing)."""
    if fin and (cl not in (1, 2, 4, 8) or D % cl or pdl or dep):
        raise ValueError(f"the text kernel's finish needs clusters of 1-8 CTAs and no pdl, got cl={cl}, pdl={pdl}, "
                         f"dep={dep}")
    return dict(G=G, D=D, BITS=bits, W=W, KBLK=kblk, GROUP=group, SDK=sdk, VBITS=vbits, POST=post, PFD=pfd,
                PFN=pfn, KPAIR=kpair, BCOL=bcol and bits == 1 and kblk == 32 and G <= 4 and not (ksr and ring > 0),
                QSM=qsm, SVEC=svec, ST=ring, KSR=ksr and ring > 0, PDL=pdl, CL=cl, FIN=fin, UNMASKED=unmasked,
                DEP=dep, **text_layouts(W, D, bits, D // group))


def launch_text(grid, q, seg, ks, kz, sdk, lens, T, out, ml, HQ, S_total, s_off, it_per_prog, qk_scale, *, G, W,
                pfd=0, pfn=1, regs=(False, 0), svec=False, ring=(0, False), pdl=0, cl=0, final=None, lse=None,
                unmasked=True, dep=False):
    """Thin launcher (the caller checked ``text_ok``); codes are read as int32 words. ``regs``: (q read back from
    shared memory each iteration, register cap or 0), ``plan.text_regs``; ``svec``: ``plan.text_svec``; ``ring``:
    (stages, key scale/zero too), ``plan.text_ring``; the scale/zero ride in the ring only where they are fp16 with
    contiguous channels and 16-byte aligned rows (``cp.async`` takes 16-byte chunks). ``pdl``: ``text_consts``
    (the caller launches the merge as a programmatic dependent); ``cl`` with ``final`` (the layer's output
    [B, HQ, D], ``lse`` [B, HQ] or ``None``): ``grid[0] == cl`` splits as one cluster per (row, KV head), which
    writes the output from every partial of its rows (no merge launch). ``unmasked``: ``text_consts``' (the plan
    reads ``MMKV_TEXT_FULL``, ``text_rules.text_unmasked``); ``dep``: ``window_rules.window_overlap``."""
    if not _TEXT_LAUNCHER:
        _TEXT_LAUNCHER.append(Launcher(_text_kernel))
    D = q.shape[-1]
    ksr = bool(ring[0] and ring[1] and ks.dtype == torch.float16 and sdk == 1 and ks.stride() == kz.stride()
               and all(s % 8 == 0 for s in ks.stride()[:3]) and ks.data_ptr() % 16 == 0 and kz.data_ptr() % 16 == 0)
    kw = seg.k_codes.view(torch.int32)
    # one word per lane row of a token: D * v_bits / 64 bytes
    vw = seg.v_codes.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[D * seg.v_bits // 64])
    args = (q, q.stride(0), q.stride(1),
            kw, kw.stride(0), kw.stride(1),
            ks, kz, ks.stride(0), ks.stride(1), ks.stride(2),
            vw, vw.stride(0), vw.stride(1),
            seg.v_scale, seg.v_zero, seg.v_scale.stride(0), seg.v_scale.stride(1),
            lens, T, seg.k_codes.shape[2],
            out, ml, HQ, S_total, s_off, it_per_prog, qk_scale,
            out if final is None else final, 0 if final is None else final.stride(0),
            0 if final is None else final.stride(1), ml if lse is None else lse)
    fin = 0 if final is None else 2 if lse is not None else 1
    key = (G, D, seg.k_bits, W, seg.block, seg.group, sdk, seg.v_bits, seg.v_order == "tiles", pfd, regs[0], svec,
           ring[0], ksr, pdl, cl if fin else 0, fin, bool(unmasked and not ring[0]), bool(dep), pfn if pfd else 1,
           text_kpair(), text_bcol())
    opts = dict({"maxnreg": regs[1]} if regs[1] else {}, **({"cluster": cl} if fin and cl > 1 else {}),
                **({"launch_pdl": True} if dep else {}))
    kernel = _TEXT_LAUNCHER[0](grid, args, text_consts(*key), key, num_warps=W, num_stages=1, **opts)
    record_resident(kernel, q.device, text_slot_key(q.device.index, D, seg.k_bits, seg.v_bits, W,
                                                    seg.v_order == "tiles", pfd, regs, svec, ring, unmasked,
                                                    pfn if pfd else 1, key[-2], key[-1]), W)
