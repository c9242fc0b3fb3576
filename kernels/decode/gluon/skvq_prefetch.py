"""L2 prefetch of a later iteration's bytes for the Gluon SKVQ kernel (``skvq.py``, ``PFD > 0``, sm_90), as the text
kernel's (``text_prefetch.py``, whose docstring says why bulk prefetches and not registers or a ring).

An SKVQ iteration of ``TT`` tokens reads six contiguous token-major ranges of its (row, KV head): key codes, value
codes, and the per-token group scale and zero of each side; one ``cp.async.bulk.prefetch.L2`` each, issued by one
lane, asks L2 for them."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .text_prefetch import _bulk_l2

    @gluon.jit
    def _skvq_prefetch(kbase, vbase, ksb, kzb, vsb, vzb, t0, t_end,
                       W: gl.constexpr, TT: gl.constexpr, KW: gl.constexpr, KROW: gl.constexpr,
                       VW: gl.constexpr, VROW: gl.constexpr, NG: gl.constexpr, ES: gl.constexpr):
        """Ask L2 for the tokens ``[t0, min(t0 + TT, t_end))``: ``KW`` / ``VW`` code elements and ``KROW`` / ``VROW``
        bytes a token on each side, ``NG`` scale (and zero) elements of ``ES`` bytes a token. Lane 0 of warps 0, 1,
        ... issues range 0, 1, ... (modulo W); an empty range (past the split) issues nothing."""
        TL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        i = gl.arange(0, W * 32, layout=TL)
        z = i * 0
        n = gl.minimum(t_end - t0, TT) + z
        _bulk_l2(kbase + t0 * KW + z, n * KROW, i == 0)
        _bulk_l2(vbase + t0 * VW + z, n * VROW, i == 32 % (32 * W))
        _bulk_l2(ksb + t0 * NG + z, n * (NG * ES), i == 64 % (32 * W))
        _bulk_l2(kzb + t0 * NG + z, n * (NG * ES), i == 96 % (32 * W))
        _bulk_l2(vsb + t0 * NG + z, n * (NG * ES), i == 128 % (32 * W))
        _bulk_l2(vzb + t0 * NG + z, n * (NG * ES), i == 160 % (32 * W))
