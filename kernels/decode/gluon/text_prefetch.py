"""L2 prefetch of a later iteration's bytes for the Gluon text kernel (``text.py``, ``PFD > 0``, sm_90).

The text kernel is latency-bound (docs/BENCHMARKS.md: ~155 registers leave 3 programs of 4 warps per SM, and each
iteration waits on its own global loads). Keeping the next iteration's codes in registers cost 44 registers and
was slower; a ``cp.async`` ring whose lanes read back their own bytes does not fit the value side, whose lanes hold
1-, 2- or 4-byte words of separate tokens (``cp.async`` copies 4, 8 or 16 bytes). Each iteration's bytes are six
contiguous ranges (key codes, key scale and zero rows, value codes, value scale and zero), so one
``cp.async.bulk.prefetch.L2`` each, issued by one lane, asks L2 for iteration ``it + PFD`` while ``it`` computes:
no registers held for the data, no shared memory, no barrier, and that iteration's loads hit L2 instead of DRAM.
(Per-thread ``prefetch.global.L2`` of every line took 12-40 more registers, enough to lose a program per SM.)

Bulk prefetches take 16-byte aligned addresses and sizes: ``_bulk_l2`` widens each range to 16-byte boundaries."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _bulk_l2(ptr, nbytes, ok):
        """``cp.async.bulk.prefetch.L2`` of the ``nbytes`` from ``ptr`` where ``ok`` (int32, nonzero) holds and
        ``nbytes > 0``, widened to 16-byte boundaries (the instruction's granule; a granule that holds a valid byte
        lies in a mapped page). Nothing comes back: the int32 result is a placeholder, ``is_pure=False`` keeps it."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b64 a, e; .reg .b32 n; setp.ne.b32 q, $3, 0; setp.gt.and.s32 p, $2, 0, q; "
            "and.b64 a, $1, -16; cvt.s64.s32 e, $2; add.s64 e, e, $1; add.s64 e, e, 15; and.b64 e, e, -16; "
            "sub.s64 e, e, a; cvt.u32.u64 n, e; @p cp.async.bulk.prefetch.L2.global [a], n; mov.b32 $0, 0; }",
            "=r,l,r,r", [ptr, nbytes, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _prefetch(kbase, vbase, ksb, kzb, vsb, vzb, sk_n, r0, rows_end, L,
                  W: gl.constexpr, D: gl.constexpr, PER: gl.constexpr, VBITS: gl.constexpr, NG: gl.constexpr,
                  KBLK: gl.constexpr, SDK: gl.constexpr, NIT: gl.constexpr):
        """Ask L2 for what the ``NIT`` iterations starting at byte row ``r0`` will load: their key code rows (below
        ``rows_end``), the scale/zero rows of their key blocks, their value codes and value scale/zero (tokens below
        ``L``); each range is contiguous over consecutive iterations, so ``NIT`` of them cost one request. ``kbase``: the (row, KV head)'s key code words (int32, D/4 per byte row); ``vbase``: its value words
        (eight per token); ``ksb``/``kzb``: its key scale/zero (block rows ``sk_n`` elements apart, channels
        ``SDK``); ``vsb``/``vzb``: its fp16 value scale/zero (NG per token). Lane 0 of warps 0, 1, 2, ... issues
        range 0, 1, 2, ... (modulo W)."""
        TL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        i = gl.arange(0, W * 32, layout=TL)
        ROWS: gl.constexpr = W * 8 * NIT
        NTOK: gl.constexpr = ROWS * PER
        VB: gl.constexpr = D * VBITS // 8  # value bytes per token
        t0 = r0 * PER
        nrows = gl.minimum(rows_end - r0, ROWS)
        ntok = gl.minimum(L - t0, NTOK)
        z = i * 0
        # sizes <= 0 (the iteration is past the rows' end) issue nothing
        _bulk_l2(kbase + r0 * (D // 4) + z, nrows * D + z, i == 0)
        _bulk_l2(vbase + t0 * 8 + z, ntok * VB + z, i == 32 % (32 * W))
        _bulk_l2(vsb + t0 * NG + z, ntok * (NG * 2) + z, i == 64 % (32 * W))
        _bulk_l2(vzb + t0 * NG + z, ntok * (NG * 2) + z, i == 96 % (32 * W))
        b0 = t0 // KBLK
        nblk = gl.where(ntok > 0, (t0 + ntok - 1) // KBLK - b0 + 1, 0)
        ES: gl.constexpr = ksb.dtype.element_ty.primitive_bitwidth // 8
        kspan = gl.where(nblk > 0, (nblk - 1) * sk_n * ES + (D * SDK + 1 - SDK) * ES, 0) + z
        _bulk_l2(ksb + b0 * sk_n + z, kspan, i == 128 % (32 * W))
        _bulk_l2(kzb + b0 * sk_n + z, kspan, i == 160 % (32 * W))
