"""Reductions of the channel kernel: the softmax reference from the range pass, calibration, the barriers over a
(row, KV head)'s splits (counters or a thread block cluster) and the epilogue that merges partials (``_finish``)."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .operands import _block_barrier, _cols8, _l2_only

    @gluon.jit
    def _reference(cal_ptr, n_cal, row0, g2, qz, tau1, tau2, G: gl.constexpr, CALIB: gl.constexpr,
                   L2_ONLY: gl.constexpr):
        """Reduce the ``cal`` rows ``row0 + g2`` (every split's (min, max)) to gamma, delta; returns the calibration
        ratio ``r`` (1 without ``CALIB``), the softmax reference ``M = max g`` and ``q.z*r + (1-r)*gamma - tau1 - M``
        per column (-1e30 for padding heads and empty rows: p = 0). ``L2_ONLY``: the rows were written by other
        programs of this launch, so they are read past L1 (which is not coherent)."""
        W: gl.constexpr = g2.shape[0]
        NCH: gl.constexpr = 32  # splits per load: one round trip for up to 32 splits
        CL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [W, 1, 1], [2, 1, 0])
        g3 = gl.expand_dims(gl.convert_layout(g2, gl.SliceLayout(2, CL)), 2)
        s3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NCH, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL))), 0), 1)
        gmin = gl.full([W, 8], float("inf"), gl.float32, layout=gl.SliceLayout(2, CL))
        gmax = gl.full([W, 8], float("-inf"), gl.float32, layout=gl.SliceLayout(2, CL))
        for s0 in range(0, n_cal, NCH):
            cbase = cal_ptr + ((row0 + g3) * n_cal + s0 + s3) * 2
            ok = (g3 < G) & (s0 + s3 < n_cal)
            lo = gl.load(cbase, mask=ok, other=float("inf"), cache_modifier=_l2_only(L2_ONLY))
            hi = gl.load(cbase + 1, mask=ok, other=float("-inf"), cache_modifier=_l2_only(L2_ONLY))
            gmin = gl.minimum(gmin, gl.min(lo, axis=2))
            gmax = gl.maximum(gmax, gl.max(hi, axis=2))
        gmin = gl.convert_layout(gmin, g2.type.layout)
        gmax = gl.convert_layout(gmax, g2.type.layout)
        return _calibrated(gmin, gmax, g2, qz, tau1, tau2, G, CALIB)

    @gluon.jit
    def _minmax(a_lo, a_hi, b_lo, b_hi):  # combine of one reduction that yields min and max together
        return gl.minimum(a_lo, b_lo), gl.maximum(a_hi, b_hi)

    @gluon.jit
    def _own_calibrated(lo, hi, kq, qzh, tau1, tau2, G: gl.constexpr, CALIB: gl.constexpr):
        """A one-program pair's calibration, per head in the int8 path's ``S4``: (min, max) of ``lo``/``hi`` ([W, 16,
        4]) over rows and warps in one reduction (one shared-memory round), then ``_calibrated``'s rule per head on
        [1, 1, 4] operands that broadcast against the K loop's per-head constants ``kq`` (fixed-point scale) and
        ``qzh`` (q.z), so no layout conversion follows. Returns the V loop's ``(kq * r, q.z*r + shift - M)`` and
        ``M`` per head ([4])."""
        hmin, hmax = gl.reduce((lo, hi), 1, _minmax)
        hmin, hmax = gl.reduce((hmin, hmax), 0, _minmax)  # [4], the same in every warp
        hd = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=hmin.type.layout), 0), 1)  # [1, 1, 4] in S4
        ratio, m_ref, c0 = _calibrated(gl.expand_dims(gl.expand_dims(hmin, 0), 1),
                                       gl.expand_dims(gl.expand_dims(hmax, 0), 1), hd, qzh, tau1, tau2, G, CALIB)
        if CALIB:
            kq = kq * ratio
        return (kq, c0), gl.reshape(m_ref, [4])

    @gluon.jit
    def _calibrated(gmin, gmax, g2, qz, tau1, tau2, G: gl.constexpr, CALIB: gl.constexpr):
        """``_reference``'s result from the pair's gamma = ``gmin``, delta = ``gmax`` per column (``g2``: its head; or
        per head, ``_own_calibrated``)."""
        m_ref = gmax
        ratio = gl.full(g2.shape, 1.0, gl.float32, layout=g2.type.layout)
        if CALIB:
            big = gmax - gmin
            ok = big > 0
            width = gl.where(ok, big, 1.0)
            # slope floored at reference.CALIB_MIN_RATIO (0.25), so the calibrated max is at gmax: gmin - tau1 + r w
            ratio = gl.maximum(gl.where(ok, (width + tau1 - tau2) / width, 1.0), 0.25)
            shift = gl.where(ok, (1.0 - ratio) * gl.where(ok, gmin, 0.0) - tau1, 0.0)
            m_ref = gl.where(ok, gmin - tau1 + ratio * width, gmax)
            qz = qz * ratio + shift
        live = (g2 < G) & (m_ref > float("-inf"))
        m_ref = gl.where(live, m_ref, 0.0)
        return ratio, m_ref, gl.where(live, qz - m_ref, -1.0e30)

    @gluon.jit
    def _store_range(ptr, row, lo, hi, hv, I8: gl.constexpr, MMA: gl.constexpr):
        """Write (min, max) over the warps and rows of ``lo``/``hi`` per column to ``ptr + 2 * row``."""
        HL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, MMA))
        if I8:
            lo = _cols8(lo, float("inf"), MMA)
            hi = _cols8(hi, float("-inf"), MMA)
        gl.store(ptr + row * 2, gl.convert_layout(gl.min(gl.min(lo, axis=1), axis=0), HL), mask=hv)
        gl.store(ptr + row * 2 + 1, gl.convert_layout(gl.max(gl.max(hi, axis=1), axis=0), HL), mask=hv)

    @gluon.jit
    def _arrive(counter):
        """First half of the barrier of the programs that share ``counter`` (the splits of one sequence and KV head):
        the program's stores so far become visible to the others (block barrier, then a release add by one thread;
        its fence also waits for that thread's loads in flight, so the caller issues prefetches after it)."""
        _block_barrier()
        return gl.atomic_add(counter, 1, sem="release", scope="gpu") + 1

    @gluon.jit
    def _wait(counter, seen, n):
        """Second half: poll until all ``n`` programs have arrived (acquire). Needs the ``n`` programs to run at
        once: ``decode_attention`` launches the fused kernel only as one wave, and programs start in grid order, so
        the splits of the lowest unfinished pair are always resident."""
        while seen < n:
            seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        _block_barrier()

    @gluon.jit
    def _depart(counter, n):
        """Count this program out (after its wait); the last of the ``n`` sets the counter back to 0 for the next
        launch, so the buffer needs no clearing between launches (the counter is at n..2n-1 here: no program still
        waits for it)."""
        old = gl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
        gl.atomic_add(counter, -2 * n, mask=old == 2 * n - 1, sem="relaxed", scope="gpu")

    @gluon.jit
    def _cluster(x, OP: gl.constexpr):
        """``barrier.cluster.arrive.release`` / ``barrier.cluster.wait.acquire`` (sm_90 thread block clusters): every
        thread of every CTA of the cluster arrives; a wait returns once all have, with their earlier writes visible.
        Returns ``x`` (a scalar) so that what must follow can depend on it."""
        return gl.inline_asm_elementwise(f"barrier.cluster.{OP}.aligned; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _finish(po_ptr, ml_ptr, fo_ptr, lse_ptr, so_b, so_h, b, h, r, HQ, S_total,
                G: gl.constexpr, D: gl.constexpr, CL: gl.constexpr, W: gl.constexpr, FIN: gl.constexpr):
        """CTA ``r`` of a (row, KV head)'s cluster, after every CTA wrote its partial (and the layer's other segments'
        kernels, launched before this one, theirs): merges all ``S_total`` partials of channels [r*D/CL,
        (r+1)*D/CL) as the merge kernel does (log-sum-exp, ``CL`` partials per round) and writes ``fo`` (and, CTA 0
        with ``FIN == 2``, the natural-log ``lse``)."""
        DC: gl.constexpr = D // CL
        FL: gl.constexpr = gl.BlockedLayout([CL, 1, 1], [1, 4, 8], [1, 1, W], [2, 1, 0])
        s3 = gl.expand_dims(gl.expand_dims(gl.arange(0, CL, layout=gl.SliceLayout(1, gl.SliceLayout(2, FL))), 1), 2)
        g3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, FL))), 0), 2)
        c3 = gl.expand_dims(gl.expand_dims(gl.arange(0, DC, layout=gl.SliceLayout(0, gl.SliceLayout(1, FL))), 0), 1)
        OL: gl.constexpr = gl.SliceLayout(0, FL)
        m_run = gl.full([8, 1], -1.0e30, gl.float32, layout=OL)
        l_run = gl.zeros([8, 1], gl.float32, layout=OL)
        acc = gl.zeros([8, DC], gl.float32, layout=OL)
        for s0 in range(0, S_total, CL):
            row = (b * HQ + h * G + g3) * S_total + s0 + s3  # [CL, 8, 1]
            ok = (g3 < G) & (s0 + s3 < S_total)
            ms = gl.load(ml_ptr + row * 2, mask=ok, other=-1.0e30, cache_modifier=".cg")
            ls = gl.load(ml_ptr + row * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            o = gl.load(po_ptr + row * D + r * DC + c3, mask=ok & (c3 >= 0), other=0.0, cache_modifier=".cg")
            m_new = gl.maximum(m_run, gl.max(ms, axis=0))
            w = gl.exp2(ms - gl.expand_dims(m_new, 0))
            alpha = gl.exp2(m_run - m_new)
            acc = acc * alpha + gl.sum(w * o, axis=0)
            l_run = l_run * alpha + gl.sum(w * ls, axis=0)
            m_run = m_new
        live = l_run > 0
        res = gl.where(live, acc / gl.where(live, l_run, 1.0), 0.0)  # [8, DC]
        g2 = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, OL)), 1)
        c2 = gl.expand_dims(gl.arange(0, DC, layout=gl.SliceLayout(0, OL)), 0)
        gl.store(fo_ptr + b * so_b + (h * G + g2) * so_h + r * DC + c2, res.to(fo_ptr.dtype.element_ty),
                 mask=(g2 < G) & (c2 >= 0))
        if FIN == 2:
            lse = gl.where(live, (m_run + gl.log2(gl.where(live, l_run, 1.0))) * 0.6931471805599453, float("-inf"))
            gl.store(lse_ptr + b * HQ + h * G + g2, lse, mask=(g2 < G) & (r == 0))
