"""The value side's loads of one iteration of the Gluon text kernel (``text.py``): the V code words of its tokens and,
in natural order, their scale/zero (per token, or as vectors: ``text_svec.py``); ``FULL`` iterations, whose every
token is valid, load without masks."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .text_svec import _vec_consts

    @gluon.jit
    def _text_load(vptr, vtok, vg, r0, T, D: gl.constexpr, PER: gl.constexpr,
                   VWD: gl.constexpr, NG: gl.constexpr, POST: gl.constexpr = False, SVEC: gl.constexpr = False,
                   fx=0, FULL: gl.constexpr = False):
        """The value side one iteration reads, starting at byte row ``r0``: V code words and the V scale/zero of its
        tokens (``POST``: no scale/zero, ``_post_scales`` reads them). ``FULL``: every token of the iteration is
        valid, so the loads take no mask (no predicate and no zero fill per load)."""
        t0 = r0 * PER
        vmask = (t0 + vtok < T) & (vg >= 0)
        if FULL:
            xv = gl.load(vptr[0] + (t0 + vtok) * VWD + vg, eviction_policy="evict_first")
        else:
            xv = gl.load(vptr[0] + (t0 + vtok) * VWD + vg, mask=vmask, other=0, eviction_policy="evict_first")
        # 1-bit rows are read as 2-byte words (only bytes 0 and 1 are used): widened unsigned, which the 16-bit load
        # already does, where a signed widening costs a prmt a word
        UW: gl.constexpr = gl.uint16 if xv.dtype.primitive_bitwidth == 16 else gl.uint8
        if xv.dtype.primitive_bitwidth < 32:
            xv = xv.to(UW, bitcast=True)
        xv = xv.to(gl.int32)
        if POST:
            sv = xv
            zv = xv
        elif SVEC:
            VLL: gl.constexpr = xv.type.layout
            sv = _vec_consts(vptr[1], fx, t0, T, VLL, NG)
            zv = _vec_consts(vptr[2], fx, t0, T, VLL, NG)
        else:
            soff = (t0 + vtok) * NG + vptr[3]
            if FULL:
                sv = gl.load(vptr[1] + soff)
                zv = gl.load(vptr[2] + soff)
            else:
                sv = gl.load(vptr[1] + soff, mask=vmask, other=0.0)
                zv = gl.load(vptr[2] + soff, mask=vmask, other=0.0)
        return xv, sv, zv
