"""Gluon (explicit-layout Triton) kernel for channel-wise segments (CalibQuant K and V), NVIDIA sm_80+.

Why Gluon: values are packed along *tokens*, while a tensor-core operand for ``p @ V`` needs each thread to hold
consecutive tokens of one channel. Plain ``tl.dot`` makes Triton stage the unpacked fp16 V tile through shared
memory (4 bytes of shared traffic per code, 8x the DRAM bytes of 1-bit codes), which caps the kernel far below
memory bandwidth. Here every operand is built in registers straight from 16-byte global loads:

* the channel axis is relabelled (a permutation applied identically to ``q``/scales on the K side and to the
  output/scales on the V side) so that each lane's channels of an mma fragment are contiguous bytes;
* ``_unpack_asm`` turns 4 code bytes into fp16 ``1 + c * 2**(pos-10)`` values for every bit plane with one
  ``lop3`` per 2 codes; the affine map is undone on fp32 accumulators (``S0`` below, and the ``accl`` sums);
* K side: ``logits[head, token] = mma(q*s, codes_plane)`` (M = 16 heads, padded; N = 16 tokens of a plane);
  V side: ``out^T[channel, head] += mma(codes_plane^T, p^T)`` (N = 8 heads), whose B operand is exactly the
  K side's accumulator fragment (no data movement), and ``accl = mma(onehot, p^T)`` gives sum(p) per bit plane
  in the same precision as the codes' products.

Launch: grid ``(splits, H, B)``, ``W`` warps per program; warp ``w`` of iteration ``it`` owns byte rows
``row0 + (it * W + w) * 16 + [0, 16)`` (``16 * 8 // bits`` tokens) and keeps its own online-softmax state; the
warps are merged once at the end. Per program it reads: its q rows (G heads), the K/V scale+zero vectors, the
K and V code rows of its token range (each byte once), ``lens[b]`` and, with calibration, the prepass partials
``cal[b, h*G:(h+1)*G, :]``. It writes one partial ``(acc[G, D], m[G], l[G])`` (MODE 0) or the min/max of its
uncalibrated logits (MODE 1, the calibration prepass). Requirements (checked by the caller): one scale block
covers the capacity, G <= 8, D in {64, 128}, codes rows contiguous (row stride D).
"""

from __future__ import annotations

import math

from ._unpack_asm import MAGIC, make_asm, plane_pos

try:  # Gluon ships with Triton >= 3.4; the CPU interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "build_layouts", "launch_channel"]

if HAVE_GLUON:

    @gluon.jit
    def _heads8(c):
        """[W, 16, N] mma accumulator -> its rows 0..7 (the real heads), a pure relabelling of registers."""
        W: gl.constexpr = c.shape[0]
        N: gl.constexpr = c.shape[2]
        c4 = gl.permute(gl.reshape(c, [W, 2, 8, N]), [0, 2, 3, 1])
        lo, hi = gl.split(c4)
        return lo

    @gluon.jit
    def _k_operand(hx, MMA: gl.constexpr):
        """fp16 [W, 16 rows, D physical] -> B operand [W, D logical, 16] (logical k = 16kb + 8h + 2q + e)."""
        W: gl.constexpr = hx.shape[0]
        D: gl.constexpr = hx.shape[2]
        h6 = gl.reshape(hx, [W, 16, 4, D // 16, 2, 2])
        h6 = gl.permute(h6, [0, 1, 3, 4, 2, 5])
        hl = gl.reshape(h6, [W, 16, D])
        return gl.convert_layout(gl.permute(hl, [0, 2, 1]), gl.DotOperandLayout(1, MMA, 2), assert_trivial=True)

    @gluon.jit
    def _v_operand(hy, MMA: gl.constexpr):
        """fp16 [W, 16 rows, D physical] -> A operand [W, D logical, 16] (logical m = 16mt + 8h + r)."""
        W: gl.constexpr = hy.shape[0]
        D: gl.constexpr = hy.shape[2]
        h5 = gl.reshape(hy, [W, 16, 8, D // 16, 2])
        h5 = gl.permute(h5, [0, 1, 3, 4, 2])
        hl = gl.reshape(h5, [W, 16, D])
        return gl.convert_layout(gl.permute(hl, [0, 2, 1]), gl.DotOperandLayout(0, MMA, 2), assert_trivial=True)

    @gluon.jit
    def _onehot_operand(row: gl.constexpr, W: gl.constexpr, MMA: gl.constexpr, BL: gl.constexpr):
        r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, BL)))
        r3 = gl.expand_dims(gl.expand_dims(r, 0), 2)
        x = gl.where(r3 == row, 1.0, 0.0) + gl.zeros([W, 16, 16], gl.float32, layout=BL)
        return gl.convert_layout(x.to(gl.float16), gl.DotOperandLayout(0, MMA, 2))

    @gluon.jit
    def _pick4(a, b, c, d, I: gl.constexpr):
        if I == 0:
            return a
        elif I == 1:
            return b
        elif I == 2:
            return c
        else:
            return d

    @gluon.jit
    def _channel_kernel(
        q_ptr, sq_b, sq_h,
        kc_ptr, vc_ptr, sc_b, sc_h,
        ks_ptr, kz_ptr, sk_b, sk_h,
        vs_ptr, vz_ptr, sv_b, sv_h,
        lens_ptr, T, rows_cap,
        cal_ptr, n_cal, tau1, tau2,
        out_ptr, ml_ptr, HQ, S_total, s_off,
        it_per_prog, qk_scale, magic,
        G: gl.constexpr, D: gl.constexpr, BITS: gl.constexpr, W: gl.constexpr,
        SDK: gl.constexpr, SDV: gl.constexpr, CALIB: gl.constexpr, MODE: gl.constexpr, STAGES: gl.constexpr,
        ASM: gl.constexpr, CONS: gl.constexpr,
        XL: gl.constexpr, YL: gl.constexpr, Y2L: gl.constexpr, MMA: gl.constexpr, QL: gl.constexpr,
    ):
        PER: gl.constexpr = 8 // BITS
        ROWS: gl.constexpr = W * 16
        CPQ: gl.constexpr = D // 4
        CPR: gl.constexpr = D // 8
        sp = gl.program_id(0)
        h = gl.program_id(1)
        b = gl.program_id(2)
        L = gl.minimum(gl.load(lens_ptr + b), T)
        rows_l = (L + PER - 1) // PER
        row0 = sp * it_per_prog * ROWS
        n_it = gl.minimum(it_per_prog, (gl.maximum(rows_l - row0, 0) + ROWS - 1) // ROWS)

        # ---- prologue: q * scale (K side, permuted channels), per-head constants -------------------------
        qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, QL)))
        qg = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, QL)))
        qk_ = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, QL)))
        phi = ((qk_ // 2) % 4) * CPQ + (qk_ // 16) * 4 + ((qk_ // 8) % 2) * 2 + qk_ % 2
        w3 = gl.expand_dims(gl.expand_dims(qw, 1), 2)
        g3 = gl.expand_dims(gl.expand_dims(qg, 0), 2)
        k3 = gl.expand_dims(gl.expand_dims(phi, 0), 1)
        qmask = (g3 < G) & (k3 >= 0) & (w3 >= 0)
        qv = gl.load(q_ptr + b * sq_b + (h * G + g3) * sq_h + k3 + w3 * 0, mask=qmask, other=0.0).to(gl.float32)
        ksv = gl.load(ks_ptr + b * sk_b + h * sk_h + k3 * SDK).to(gl.float32)
        kzv = gl.load(kz_ptr + b * sk_b + h * sk_h + k3 * SDK).to(gl.float32)
        qz = gl.sum(qv * kzv, axis=2) * qk_scale
        qsf = qv * ksv * qk_scale
        if CALIB:
            g2 = gl.expand_dims(qg, 0) + gl.expand_dims(qw, 1) * 0
            gmin = gl.full([W, 16], float("inf"), gl.float32, layout=gl.SliceLayout(2, QL))
            gmax = gl.full([W, 16], float("-inf"), gl.float32, layout=gl.SliceLayout(2, QL))
            for s in range(n_cal):
                cbase = cal_ptr + ((b * HQ + h * G + g2) * n_cal + s) * 2
                gmin = gl.minimum(gmin, gl.load(cbase, mask=g2 < G, other=float("inf")))
                gmax = gl.maximum(gmax, gl.load(cbase + 1, mask=g2 < G, other=float("-inf")))
            width = gmax - gmin
            ok = width > 0
            width = gl.where(ok, width, 1.0)
            ratio = gl.where(ok, (width + tau1 - tau2) / width, 1.0)
            shift = gl.where(ok, (1.0 - ratio) * gl.where(ok, gmin, 0.0) - tau1, 0.0)
            qsf = qsf * gl.expand_dims(ratio, 2)
            qz = qz * ratio + shift
        qs16 = qsf.to(gl.float16)
        s0 = gl.sum(qs16.to(gl.float32), axis=2)
        a_q = gl.convert_layout(qs16, gl.DotOperandLayout(0, MMA, 2))

        zc = gl.zeros([W, 16, 16], gl.float32, layout=MMA)
        qz8 = gl.max(_heads8(zc + gl.expand_dims(gl.convert_layout(qz, gl.SliceLayout(2, MMA)), 2)), axis=2)
        s08 = gl.max(_heads8(zc + gl.expand_dims(gl.convert_layout(s0, gl.SliceLayout(2, MMA)), 2)), axis=2)
        LS: gl.constexpr = _heads8(zc).type.layout
        sw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LS)))
        sj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS)))
        rel_rows = gl.expand_dims(gl.expand_dims(sw, 1), 2) * 16 + gl.expand_dims(gl.expand_dims(sj, 0), 1)

        # ---- code addresses (16-byte vectors per lane) -------------------------------------------------------
        xw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL)))
        xr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        xc = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
        xrow = gl.expand_dims(gl.expand_dims(xw, 1), 2) * 16 + gl.expand_dims(gl.expand_dims(xr, 0), 2)
        xcol = gl.expand_dims(gl.expand_dims(xc, 0), 1)
        kbase = kc_ptr + b * sc_b + h * sc_h
        magic_k = gl.full([W, 16, D], magic, gl.int32, layout=XL)

        m_i = gl.full([W, 8], -1.0e30, gl.float32, layout=gl.SliceLayout(2, LS))
        if MODE == 0:
            yw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, YL)))
            yr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, YL)))
            yc = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, YL)))
            yrow = gl.expand_dims(gl.expand_dims(yw, 1), 2) * 16 + gl.expand_dims(gl.expand_dims(yr, 0), 2)
            ycol = gl.expand_dims(gl.expand_dims(yc, 0), 1)
            vbase = vc_ptr + b * sc_b + h * sc_h
            magic_v = gl.full([W, 16, D], magic, gl.int32, layout=Y2L)
            BLQ: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [W, 1, 1], [2, 1, 0])
            one0 = _onehot_operand(0, W, MMA, BLQ)
            one1 = _onehot_operand(1, W, MMA, BLQ)
            one2 = _onehot_operand(2, W, MMA, BLQ)
            one3 = _onehot_operand(3, W, MMA, BLQ)
            acc = gl.zeros([W, D, 8], gl.float32, layout=MMA)
            accl = gl.zeros([W, 16, 8], gl.float32, layout=MMA)
        else:
            m_lo = gl.full([W, 8], float("inf"), gl.float32, layout=gl.SliceLayout(2, LS))

        if STAGES > 0:  # cp.async pipeline: the codes of iteration it+STAGES-1 are in flight while it computes
            SL: gl.constexpr = gl.SwizzledSharedLayout(16, 1, D // 16, [2, 1, 0])
            smk = gl.allocate_shared_memory(gl.uint8, [STAGES, W, 16, D], SL)
            if MODE == 0:
                smv = gl.allocate_shared_memory(gl.uint8, [STAGES, W, 16, D], SL)
            for st in gl.static_range(STAGES - 1):
                r_ = row0 + st * ROWS
                cp.async_copy_global_to_shared(smk.index(st), kbase + (r_ + xrow) * D + xcol,
                                               mask=(r_ + xrow < rows_cap) & (xcol >= 0) & (st < n_it))
                if MODE == 0:
                    cp.async_copy_global_to_shared(smv.index(st), vbase + (r_ + yrow) * D + ycol,
                                                   mask=(r_ + yrow < rows_cap) & (ycol >= 0) & (st < n_it))
                cp.commit_group()
        for it in range(n_it):
            rbase = row0 + it * ROWS
            if STAGES > 0:
                nx = it + STAGES - 1
                r_ = row0 + nx * ROWS
                cp.async_copy_global_to_shared(smk.index(nx % STAGES), kbase + (r_ + xrow) * D + xcol,
                                               mask=(r_ + xrow < rows_cap) & (xcol >= 0) & (nx < n_it))
                if MODE == 0:
                    cp.async_copy_global_to_shared(smv.index(nx % STAGES), vbase + (r_ + yrow) * D + ycol,
                                                   mask=(r_ + yrow < rows_cap) & (ycol >= 0) & (nx < n_it))
                cp.commit_group()
                cp.wait_group(STAGES - 1)
                xk = smk.index(it % STAGES).load(XL)
                if MODE == 0:
                    xv = smv.index(it % STAGES).load(YL)
            else:
                xra = rbase + xrow
                xk = gl.load(kbase + xra * D + xcol, mask=(xra < rows_cap) & (xcol >= 0), other=0)
                if MODE == 0:
                    yra = rbase + yrow
                    xv = gl.load(vbase + yra * D + ycol, mask=(yra < rows_cap) & (ycol >= 0), other=0)
            khs = gl.inline_asm_elementwise(ASM, CONS, [xk, magic_k], dtype=(gl.float16,) * PER, is_pure=True,
                                            pack=4)
            tok0 = (rbase + rel_rows) * PER
            mx = gl.full([W, 8], float("-inf"), gl.float32, layout=gl.SliceLayout(2, LS))
            ts = ()
            for i in gl.static_range(PER):
                POS = 2 if BITS == 8 else (i * BITS + 6 if i * BITS < 4 else i * BITS + 2)
                SC = 1 << (10 - POS)
                c = mma_v2(a_q, _k_operand(khs[i], MMA), zc)
                t = _heads8(c) * SC + gl.expand_dims(qz8 - s08 * SC, 2)
                valid = (tok0 + i) < L
                if MODE == 0:
                    t = gl.where(valid, t, float("-inf"))
                    mx = gl.maximum(mx, gl.max(t, axis=2))
                    ts = ts + (t,)
                else:
                    mx = gl.maximum(mx, gl.max(gl.where(valid, t, float("-inf")), axis=2))
                    m_lo = gl.minimum(m_lo, gl.min(gl.where(valid, t, float("inf")), axis=2))
            if MODE == 0:
                m_new = gl.maximum(m_i, mx)
                alpha = gl.expand_dims(gl.convert_layout(gl.exp2(m_i - m_new), gl.SliceLayout(1, MMA)), 1)
                acc = acc * alpha
                accl = accl * alpha
                m_i = m_new
                vhs = gl.inline_asm_elementwise(ASM, CONS, [gl.convert_layout(xv, Y2L), magic_v],
                                                dtype=(gl.float16,) * PER, is_pure=True, pack=4)
                for i in gl.static_range(PER):
                    POS = 2 if BITS == 8 else (i * BITS + 6 if i * BITS < 4 else i * BITS + 2)
                    ROW = 0 if BITS == 8 else POS - 6
                    p = gl.exp2(ts[i] - gl.expand_dims(m_i - (10 - POS), 2)).to(gl.float16)
                    p_op = gl.convert_layout(gl.permute(p, [0, 2, 1]), gl.DotOperandLayout(1, MMA, 2),
                                             assert_trivial=True)
                    acc = mma_v2(_v_operand(vhs[i], MMA), p_op, acc)
                    accl = mma_v2(_pick4(one0, one1, one2, one3, ROW), p_op, accl)
            else:
                m_i = gl.maximum(m_i, mx)

        # ---- epilogue: merge the W warps, undo the fp16 code map, write the partial ----------------------------
        m_all = gl.max(m_i, axis=0)
        ho = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LS)))
        row_ml = (b * HQ + h * G + ho) * S_total + s_off + sp
        if MODE == 0:
            wgt = gl.expand_dims(gl.convert_layout(gl.exp2(m_i - gl.expand_dims(m_all, 0)), gl.SliceLayout(1, MMA)), 1)
            acc_s = gl.sum(acc * wgt, axis=0)
            accl_s = gl.sum(accl * wgt, axis=0)
            jr = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(0, MMA))), 1)
            if BITS == 8:
                wl = gl.where(jr == 0, 1.0 / 256.0, 0.0)
                wp = gl.where(jr == 0, 1.0, 0.0)
            else:
                wl = gl.where(jr < 4, gl.exp2((jr - 4).to(gl.float32)), 0.0)
                wp = gl.where(jr < 4, 1.0, 0.0)
            l_g = gl.sum(accl_s * wl, axis=0)
            sp_g = gl.sum(accl_s * wp, axis=0)
            mo = gl.arange(0, D, layout=gl.SliceLayout(1, gl.SliceLayout(0, MMA)))
            psi = (mo % 8) * CPR + (mo // 16) * 2 + (mo // 8) % 2
            vsv = gl.expand_dims(gl.load(vs_ptr + b * sv_b + h * sv_h + psi * SDV).to(gl.float32), 1)
            vzv = gl.expand_dims(gl.load(vz_ptr + b * sv_b + h * sv_h + psi * SDV).to(gl.float32), 1)
            o = (acc_s - gl.expand_dims(sp_g, 0)) * vsv + gl.expand_dims(l_g, 0) * vzv
            go = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, MMA))), 0)
            dst = out_ptr + ((b * HQ + h * G + go) * S_total + s_off + sp) * D + gl.expand_dims(psi, 1)
            gl.store(dst, o, mask=(go < G) & (gl.expand_dims(psi, 1) >= 0))
            gl.store(ml_ptr + row_ml * 2, m_all, mask=ho < G)
            lo_ = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, MMA)))
            gl.store(ml_ptr + ((b * HQ + h * G + lo_) * S_total + s_off + sp) * 2 + 1, l_g, mask=lo_ < G)
        else:
            lo_all = gl.min(m_lo, axis=0)
            gl.store(ml_ptr + row_ml * 2, lo_all, mask=ho < G)
            gl.store(ml_ptr + row_ml * 2 + 1, m_all, mask=ho < G)


_LAYOUTS: dict = {}
_ASM: dict = {}
_CONSTS: dict = {}
_LAUNCHER: list = []


def _launcher():
    if not _LAUNCHER:
        from ._launch import Launcher

        _LAUNCHER.append(Launcher(_channel_kernel))
    return _LAUNCHER[0]


def build_layouts(W: int, D: int):
    """(XL, YL, Y2L, MMA, QL) for ``W`` warps and head_dim ``D``; see the module docstring for the mapping."""
    key = (W, D)
    if key not in _LAYOUTS:
        wb = [[1 << i, 0, 0] for i in range(int(math.log2(W)))]
        cpq, cpr = D // 4, D // 8
        kreg = [[0, 0, 1 << i] for i in range(int(math.log2(cpq)))] + [[0, 8, 0]]
        klane = [[0, 0, cpq], [0, 0, 2 * cpq], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
        creg = [[0, 0, 1 << i] for i in range(int(math.log2(cpr)))]
        vlane = [[0, 2, 0], [0, 4, 0], [0, 0, cpr], [0, 0, 2 * cpr], [0, 0, 4 * cpr]]
        XL = gl.DistributedLinearLayout(kreg, klane, wb, [], [W, 16, D])
        YL = gl.DistributedLinearLayout(creg + [[0, 1, 0], [0, 8, 0]], vlane, wb, [], [W, 16, D])
        Y2L = gl.DistributedLinearLayout([[0, 1, 0]] + creg + [[0, 8, 0]], vlane, wb, [], [W, 16, D])
        MMA = gl.NVMMADistributedLayout([2, 0], [W, 1, 1], [1, 16, 8])
        QL = gl.BlockedLayout([1, 1, D // 16], [1, 2, 16], [W, 1, 1], [2, 1, 0])
        _LAYOUTS[key] = (XL, YL, Y2L, MMA, QL)
    return _LAYOUTS[key]


def asm_for(bits: int):
    if bits not in _ASM:
        _ASM[bits] = make_asm(bits)
    return _ASM[bits]


def launch_channel(grid, q, seg_t, lens, T, rows_cap, cal, n_cal, tau1, tau2, out, ml, HQ, S_total, s_off,
                   it_per_prog, qk_scale, *, G, D, bits, W, sdk, sdv, calib, mode, stages=0, maxnreg=None,
                   num_stages=1):
    """Thin launcher; ``seg_t`` = (kc, vc, ks, kz, vs, vz) already validated by the caller."""
    kc, vc, ks, kz, vs, vz = seg_t
    ckey = (G, D, bits, W, sdk, sdv, calib, mode, stages)
    consts = _CONSTS.get(ckey)
    if consts is None:
        asm, cons = asm_for(bits)
        XL, YL, Y2L, MMA, QL = build_layouts(W, D)
        consts = _CONSTS[ckey] = dict(G=G, D=D, BITS=bits, W=W, SDK=sdk, SDV=sdv, CALIB=calib, MODE=mode,
                                      STAGES=stages, ASM=asm, CONS=cons, XL=XL, YL=YL, Y2L=Y2L, MMA=MMA, QL=QL)
    _launcher()(grid, (q, q.stride(0), q.stride(1),
                       kc, vc, kc.stride(0), kc.stride(1),
                       ks, kz, ks.stride(0), ks.stride(1),
                       vs, vz, vs.stride(0), vs.stride(1),
                       lens, T, rows_cap,
                       cal, n_cal, tau1, tau2,
                       out, ml, HQ, S_total, s_off,
                       it_per_prog, qk_scale, MAGIC),
                consts, ckey, num_warps=W, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))


def plane_scale(bits: int, i: int) -> int:
    return 1 << (10 - plane_pos(bits, i)[1])
