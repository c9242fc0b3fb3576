"""Natural-order value scale/zero of the Gluon text kernel read as one vector load per lane and chunk of its tokens
(``SVEC``, ``MMKV_TEXT_SVEC``; off by default: docs/BENCHMARKS.md measured it mixed on the H100). Used by
``text.py``."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _lane_groups(a, GS: gl.constexpr):
        """[1, 1, 8, 1] in ``a``'s layout ([W, 4, 8, tpl]): the value group of lane row gl's channels (``GS``: lane
        rows per group)."""
        AL: gl.constexpr = a.type.layout
        gi = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, AL))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(gi // GS, 0), 1), 3)

    @gluon.jit
    def _vec_consts(ptr, fx, t0, T, VL: gl.constexpr, NG: gl.constexpr):
        """Natural order's per-token value constants (scale or zero, fp16) of the lane's tokens, in ``VL``, from one
        vector load per lane of every group's constant of its ``tpl`` consecutive tokens (``SVEC``): ``fx`` = (chunk
        [W, 4, 1, 1]: first token of lane column tl, its offset [W, 4, 1, F] in the constants (F = tpl * NG), lane
        row gl's group [1, 1, 8, 1]); a chunk loads whole where it starts below ``T`` (``svec_ok``: T % 16 == 0,
        so no chunk straddles it), then each lane keeps its row's group."""
        chunk, foff, fgrp = fx
        W: gl.constexpr = foff.shape[0]
        F: gl.constexpr = foff.shape[3]
        TPL: gl.constexpr = F // NG
        GS: gl.constexpr = 8 // NG  # lane rows per value group
        x = gl.load(ptr + t0 * NG + foff + fgrp * 0, mask=(t0 + chunk < T) & (fgrp >= 0), other=0.0)
        if NG == 1:
            y = x
        elif NG == 2:
            a0, a1 = gl.split(gl.reshape(x, [W, 4, 8, TPL, 2]))
            y = gl.where(_lane_groups(a0, GS) == 0, a0, a1)
        else:
            lo0, lo1 = gl.split(gl.reshape(x, [W, 4, 8, TPL, 2, 2]))  # g = 2 hi + lo: split lo, then hi
            a0, a2 = gl.split(lo0)
            a1, a3 = gl.split(lo1)
            g = _lane_groups(a0, GS)
            y = gl.where(g == 0, a0, gl.where(g == 1, a1, gl.where(g == 2, a2, a3)))
        y = gl.reshape(gl.permute(y, [0, 1, 3, 2]), [W, 4 * TPL, 8])  # token tl * TPL + t, lane row gl
        return gl.convert_layout(y, VL, assert_trivial=True)

    @gluon.jit
    def _svec_index(W: gl.constexpr, TW: gl.constexpr, NG: gl.constexpr, D: gl.constexpr, GROUP: gl.constexpr,
                    FL: gl.constexpr):
        """``_vec_consts``'s ``fx``: (chunk [W, 4, 1, 1], offsets [W, 4, 1, F], lane row's group [1, 1, 8, 1]) in
        ``FL``."""
        TPL: gl.constexpr = TW // 4
        fw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, FL))))
        ftl = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, FL))))
        fgl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, FL))))
        ff = gl.arange(0, TPL * NG, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, FL))))
        chunk = (gl.expand_dims(gl.expand_dims(gl.expand_dims(fw, 1), 2), 3) * TW
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(ftl, 0), 2), 3) * TPL)
        foff = chunk * NG + gl.expand_dims(gl.expand_dims(gl.expand_dims(ff, 0), 1), 2)
        fgrp = (gl.expand_dims(gl.expand_dims(gl.expand_dims(fgl, 0), 1), 3) * (D // 8)) // GROUP
        return chunk, foff, fgrp
