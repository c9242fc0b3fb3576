"""One tile of the channel kernel (``_tile``: K logits, p, V accumulation) and the shared-memory ring that feeds it
(``_load``, ``_issue``, ``_iterations``)."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from .operands import (
        _cols8,
        _cp_async,
        _k_evict,
        _k_operand,
        _k_operand8,
        _p_operand,
        _prmt,
        _quad,
        _row_consts,
        _rw,
        _v_operand,
    )

    @gluon.jit
    def _load(kbase, vbase, r0, xrow, xcol, yrow, ycol, rows_cap, MODE: gl.constexpr, D: gl.constexpr,
              Y0L: gl.constexpr, FUSED: gl.constexpr = False):
        """Code words (4 bytes) of one iteration (rows r0 + warp tiles); rows past the capacity read as 0. The range
        pass asks L2 to keep K for the main pass, which reads K and V for the last time. The fused kernel's V phase
        (``MODE 0`` with ``FUSED``) reads V only."""
        if MODE == 0 and FUSED:
            xk = (xrow + xcol) * 0  # unused: a zero tensor in K's layout
        else:
            xk = gl.load(kbase + (r0 + xrow) * (D // 4) + xcol, mask=(r0 + xrow < rows_cap) & (xcol >= 0), other=0,
                         eviction_policy=_k_evict(MODE))
        if MODE == 1:
            xv = gl.zeros([xrow.shape[0], xrow.shape[1], D // 4], gl.int32, layout=Y0L)
        else:
            xv = gl.load(vbase + (r0 + yrow) * (D // 4) + ycol, mask=(r0 + yrow < rows_cap) & (ycol >= 0), other=0,
                         eviction_policy="evict_first")
        return xk, xv

    @gluon.jit
    def _tile(xk, xv, rbase, L, a_q, c0, l_acc, acc, lo, hi,
              MODE: gl.constexpr, MASKED: gl.constexpr, BITS: gl.constexpr,
              YL: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr,
              I8: gl.constexpr, S4: gl.constexpr, DA8: gl.constexpr, sml=0, slot=0, FUSED: gl.constexpr = False):
        """One iteration over every warp's byte rows. MODE 0 adds to (l_acc, acc); MODE 1 to (lo, hi).

        ``I8``: the K side on int8 tensor cores; ``a_q`` holds q*s as 16-bit fixed point, high and low bytes in
        columns 2h and 2h + 1, ``c0`` = (per-head scale of the fixed point, offset) as [W, 1, 4] in ``S4``.
        ``FUSED`` (int8 only): MODE 1 also keeps the raw logits of step j in slot ``slot`` of the shared-memory
        buffer ``sml[j]``, and MODE 0 takes them from there instead of reading K."""
        PER: gl.constexpr = 8 // BITS
        NJ: gl.constexpr = 1 if BITS == 8 else PER // 2
        RW: gl.constexpr = _rw(BITS)
        W: gl.constexpr = xk.shape[0]
        D: gl.constexpr = 4 * xk.shape[2]
        LA: gl.constexpr = S4 if I8 else MMA  # layout of the logits
        xk4 = _quad(xk)
        if I8:
            kq, c0 = c0
            zk = gl.zeros([W, 16, 8], gl.int32, layout=MMA)
        else:
            xk8 = _quad(xk >> 8)
            zk = gl.zeros([W, 16, 8], gl.float32, layout=MMA)
        if MASKED:  # first token of accumulator row v = 8*hh + g (add the step's 2*J)
            aw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LA))), 1), 2)
            av = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA))), 0), 2)
            if BITS == 8:
                tok0 = rbase + aw * RW + av
            else:
                tok0 = (rbase + aw * RW + av % 8) * PER + av // 8
        ps = ()
        for j in gl.static_range(NJ):  # K side: logits of 16 (row, plane) pairs per warp, then p'
            ksc, psh, lsc = _row_consts(BITS, j, LA, I8)
            if FUSED and MODE == 0:
                s = sml[j].index(slot).load(S4)
                ksc = ksc * kq
            elif I8:  # x = (high * 256 + low) * scale: the two bytes of each head sit in one lane's registers
                ci = mma_v2(_k_operand8(xk4, BITS, j, DA8), a_q, zk)
                chi, clo = gl.split(gl.reshape(ci, [W, 16, 4, 2]))
                s = gl.convert_layout(chi * 256 + clo, S4, assert_trivial=True).to(gl.float32)
                ksc = ksc * kq
                if FUSED:
                    sml[j].index(slot).store(s)
            else:
                s = mma_v2(_k_operand(xk4, xk8, BITS, j, DA), a_q, zk)
            if MODE == 1:
                x = s * ksc + c0
                if MASKED:
                    ok = (tok0 + 2 * j) < L
                    lo = gl.minimum(lo, gl.where(ok, x, float("inf")))
                    hi = gl.maximum(hi, gl.where(ok, x, float("-inf")))
                else:
                    lo = gl.minimum(lo, x)
                    hi = gl.maximum(hi, x)
            else:
                p = gl.exp2(s * ksc + (c0 + psh))
                if MASKED:
                    p = gl.where((tok0 + 2 * j) < L, p, 0.0)
                l_acc = l_acc + p * lsc
                if I8:
                    ps = ps + (_p_operand(_cols8(p.to(gl.float16), 0.0, MMA), DB),)
                else:
                    ps = ps + (_p_operand(p.to(gl.float16), DB),)
        if MODE == 0:  # V side, after the K codes are dead: fewer registers live at once
            xv = gl.convert_layout(xv, YL)  # register renumbering only (the rows' parity becomes register 0)
            x0, x1 = gl.split(gl.permute(gl.reshape(xv, [W, RW // 2, 2, D // 4]), [0, 1, 3, 2]))
            ua = _prmt(x0, x1, "prmt.b32 $0, $1, $2, 0x5410;")  # bytes 0, 1 of both rows
            ub = _prmt(x0, x1, "prmt.b32 $0, $1, $2, 0x7632;")  # bytes 2, 3
            sa = _quad(ua >> 8)
            sb = _quad(ub >> 8)
            ua = _quad(ua)
            ub = _quad(ub)
            for j in gl.static_range(NJ):
                acc = mma_v2(_v_operand(ua, sa, ub, sb, BITS, j, DA), ps[j], acc)
        return l_acc, acc, lo, hi

    @gluon.jit
    def _issue(smk, smv, it, codes, MODE: gl.constexpr, D: gl.constexpr, ST: gl.constexpr):
        """Asynchronous copies (``cp.async``, 16 bytes per lane and instruction) of iteration ``it``'s code words into
        ring stage ``it % ST``; one commit group per iteration, also for iterations past the program's last (masked:
        no memory traffic) so that ``wait_group`` counts stay uniform."""
        kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, n_it = codes
        ROWS: gl.constexpr = xrow.shape[0] * xrow.shape[1]
        r0 = row0 + it * ROWS
        live = it < n_it
        st = it % ST
        _cp_async(smk.index(st), kbase + (r0 + xrow) * (D // 4) + xcol,
                  mask=(r0 + xrow < rows_cap) & (xcol >= 0) & live, eviction_policy=_k_evict(MODE))
        if MODE == 0:
            _cp_async(smv.index(st), vbase + (r0 + yrow) * (D // 4) + ycol,
                      mask=(r0 + yrow < rows_cap) & (ycol >= 0) & live,
                      eviction_policy="evict_first")
        async_copy.commit_group()

    @gluon.jit
    def _iterations(it0, it1, codes, L, a_q, c0, xk, xv, xk2, xv2, l_acc, acc, lo, hi, smk, smv,
                    MODE: gl.constexpr, MASKED: gl.constexpr, PF: gl.constexpr, ST: gl.constexpr,
                    BITS: gl.constexpr, D: gl.constexpr, XL: gl.constexpr,
                    Y0L: gl.constexpr, YL: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr,
                    I8: gl.constexpr, S4: gl.constexpr, DA8: gl.constexpr, sml=0, FUSED: gl.constexpr = False):
        """Iterations [it0, it1) of a program.

        ``ST > 0``: the codes arrive through a shared-memory ring of ``ST`` stages, ``ST - 1`` iterations ahead
        (each lane reads back exactly the bytes its own copies wrote, so no barrier would be needed; Triton's
        shared-memory hazard pass still inserts two block barriers per iteration).
        ``ST == 0``: register prefetch; the codes of iteration it + PF (``xk``/``xv`` hold it's, ``xk2``/``xv2``
        it + 1's when PF = 2) are requested before iteration it's are used; the branch keeps ptxas from sinking
        those loads to the end of the loop body (it does, to shorten their registers' lives, and then every
        iteration waits for memory)."""
        kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, n_it = codes
        ROWS: gl.constexpr = xrow.shape[0] * xrow.shape[1]
        for it in range(it0, it1):
            if ST > 0:
                async_copy.wait_group(ST - 2)
                xk = smk.index(it % ST).load(XL)
                if MODE == 0:
                    xv = smv.index(it % ST).load(Y0L)
                _issue(smk, smv, it + ST - 1, codes, MODE, D, ST)
                l_acc, acc, lo, hi = _tile(xk, xv, row0 + it * ROWS, L, a_q, c0, l_acc, acc, lo, hi,
                                           MODE, MASKED, BITS, YL, MMA, DA, DB, I8, S4, DA8)
            else:
                if it + PF < n_it:
                    nk, nv = _load(kbase, vbase, row0 + (it + PF) * ROWS, xrow, xcol, yrow, ycol, rows_cap, MODE, D,
                                   Y0L, FUSED)
                else:
                    nk, nv = xk, xv
                l_acc, acc, lo, hi = _tile(xk, xv, row0 + it * ROWS, L, a_q, c0, l_acc, acc, lo, hi,
                                           MODE, MASKED, BITS, YL, MMA, DA, DB, I8, S4, DA8, sml, it, FUSED)
                if PF == 2:
                    xk, xv = xk2, xv2
                    xk2, xv2 = nk, nv
                else:
                    xk, xv = nk, nv
        return xk, xv, xk2, xv2, l_acc, acc, lo, hi
