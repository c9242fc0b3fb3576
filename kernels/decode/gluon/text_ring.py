"""The key-code ring of the Gluon text kernel (``text.py``, ``ST > 0``): ``cp.async`` copies of iteration ``it + ST -
1``'s key code words into a shared-memory ring of ``ST`` stages while iteration ``it`` computes.

The text kernel is latency-bound (docs/BENCHMARKS.md: 3 programs of 4 warps per SM, each iteration waiting on its
own loads). Holding the next iteration's codes in registers cost 44 registers and a program per SM; a ring holds
them in shared memory instead. The key code words are copied in the register layout they are read in (``XL``: lane
(g, t) holds byte row g's 16-byte chunk t of D/16 words), so each lane reads back exactly the bytes its own copies
wrote: ``wait_group`` alone orders them, no warp or block barrier is needed for the data (Triton's shared-memory
hazard pass still places block barriers around the ring's reads and writes). The swizzle is the channel kernel's
(``launch.ring_layout``): a lane's 16-byte chunks land in distinct banks within each 8-lane phase.

``KSR`` (fp16 key scale/zero with contiguous channels): the key blocks' scale and zero rows ride in the same ring,
one [W, D] row per warp and block, 16-byte chunks copied by the first D/8 lanes of each warp and read back in ``LP``
(lane (g, t) the D/4 channels ``t D/4 ...``, the same for the 8 lane rows g): lanes read what other lanes copied,
so this half relies on the block barrier Triton places between the ring's copies and its reads (after
``wait_group``, which completes each thread's own copies). (A first version in which each lane copied its own D/4
channels into its own [D, 8] slot, 8 copies of each row, took 8x the shared memory: 1-bit keys fell to one program
per SM.)"""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from .operands import _cp_async

    @gluon.jit
    def _k_words(kbase, xrow, xcol, rows_cap, r0, D: gl.constexpr, FULL: gl.constexpr = False):
        """Key code words of the iteration starting at byte row ``r0`` straight into registers (no ring); ``FULL``: all
        its rows are valid, no mask."""
        if FULL:
            return gl.load(kbase + (r0 + xrow) * (D // 4) + xcol, eviction_policy="evict_first")
        return gl.load(kbase + (r0 + xrow) * (D // 4) + xcol, mask=(r0 + xrow < rows_cap) & (xcol >= 0), other=0,
                       eviction_policy="evict_first")

    @gluon.jit
    def _k_issue(smk, kbase, xrow, xcol, rows_cap, row0, it, n_it, ksr, D: gl.constexpr, ST: gl.constexpr,
                 PER: gl.constexpr, KBLK: gl.constexpr, NBLK: gl.constexpr, KSR: gl.constexpr):
        """Copy iteration ``it``'s key code words into stage ``it % ST`` (``KSR``: and its key blocks' scale/zero rows,
        ``ksr`` = (scale ring, zero ring, scale base, zero base, block stride, warp and channel index [W, D], T)): one commit group per
        iteration, also past the program's last (masked: no traffic), so that ``wait_group`` counts stay uniform."""
        ROWS: gl.constexpr = xrow.shape[0] * xrow.shape[1]
        TW: gl.constexpr = 8 * PER
        r0 = row0 + it * ROWS
        live = it < n_it
        _cp_async(smk.index(it % ST), kbase + (r0 + xrow) * (D // 4) + xcol,
                  mask=(r0 + xrow < rows_cap) & (xcol >= 0) & live, eviction_policy="evict_first")
        if KSR:
            sks, skz, ksb, kzb, sk_n, cw, cc, T = ksr
            for u in gl.static_range(NBLK):
                tb = r0 * PER + cw * TW + u * KBLK
                koff = (tb // KBLK) * sk_n + cc
                kmask = (tb < T) & (cc >= 0) & live
                _cp_async(sks.index((it % ST) * NBLK + u), ksb + koff, mask=kmask)
                _cp_async(skz.index((it % ST) * NBLK + u), kzb + koff, mask=kmask)
        async_copy.commit_group()

    @gluon.jit
    def _k_take(smk, kbase, xrow, xcol, rows_cap, row0, it, n_it, ksr, XL: gl.constexpr, D: gl.constexpr,
                ST: gl.constexpr, PER: gl.constexpr, KBLK: gl.constexpr, NBLK: gl.constexpr, KSR: gl.constexpr):
        """Iteration ``it``'s key code words from the ring (in ``XL``; the scale/zero rows stay there until
        ``_ks_take``), and the copy of iteration ``it + ST - 1`` into the stage iteration ``it - 1`` read."""
        async_copy.wait_group(ST - 2)
        xk = smk.index(it % ST).load(XL)
        _k_issue(smk, kbase, xrow, xcol, rows_cap, row0, it + ST - 1, n_it, ksr, D, ST, PER, KBLK, NBLK, KSR)
        return xk

    @gluon.jit
    def _ks_take(ksr, it, u, LP: gl.constexpr, ST: gl.constexpr, NBLK: gl.constexpr):
        """Key block ``u``'s scale and zero rows of iteration ``it`` from the ring, in ``LP`` (fp16)."""
        st = (it % ST) * NBLK + u
        S2: gl.constexpr = gl.SliceLayout(2, LP)
        W: gl.constexpr = ksr[0].shape[1]
        D: gl.constexpr = ksr[0].shape[2]
        full = gl.full([W, D, 8], 0.0, gl.float16, layout=LP)
        ks = gl.expand_dims(ksr[0].index(st).load(S2), 2) + full
        kz = gl.expand_dims(ksr[1].index(st).load(S2), 2) + full
        return ks, kz

    @gluon.jit
    def _ks_ring(ST: gl.constexpr, NBLK: gl.constexpr, W: gl.constexpr, D: gl.constexpr, ksb, kzb, sk_n, T):
        """The key scale/zero ring's shared memory ([ST * NBLK, W, D] fp16 each) and its copy indices."""
        CL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [W, 1], [1, 0])
        SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        cw = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, CL)), 1)
        cc = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, CL)), 0)
        sks = gl.allocate_shared_memory(gl.float16, [ST * NBLK, W, D], SL)
        skz = gl.allocate_shared_memory(gl.float16, [ST * NBLK, W, D], SL)
        return sks, skz, ksb, kzb, sk_n, cw, cc, T
