"""The register layouts of the Gluon text kernel (``text.py``) per warps, head_dim, key bits and value groups, built
once per variant: how each lane's code words, value scales and MMA operands map onto tokens and channels."""

from __future__ import annotations

import math

_TEXT_LAYOUTS: dict = {}


def text_layouts(W: int, D: int, bits: int = 2, ng: int = 1):
    """(XL, VL, LP, MMA, DA, DB, PL, VS) of the text kernel for ``W`` warps, head_dim ``D`` and ``ng`` value groups."""
    key = (W, D, bits, ng)
    if key not in _TEXT_LAYOUTS:
        from triton.experimental.gluon import language as gl

        from .launch import build_layouts, ring_layout  # defined only where Gluon is

        XL, _, _, MMA, _, DA, DB = build_layouts(W, D, 2)
        wb = [[1 << i, 0, 0] for i in range(int(math.log2(W)))]
        tpl = 2 * (8 // bits)  # tokens per lane: lane (gl, tl) holds tokens [tl * tpl, (tl + 1) * tpl) of its warp
        VL = gl.DistributedLinearLayout([[0, 1 << i, 0] for i in range(int(math.log2(tpl)))],
                                        [[0, tpl, 0], [0, 2 * tpl, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], wb, [],
                                        [W, 4 * tpl, 8])
        per = D // 4  # consecutive physical channels per lane
        LP = gl.DistributedLinearLayout([[0, 1 << i, 0] for i in range(int(math.log2(per)))],
                                        [[0, per, 0], [0, 2 * per, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], wb, [],
                                        [W, D, 8])
        # V pairs [W, tl, hh, gl, 2 (token a)]: the pair axis is register 0 (see _deq)
        PL = gl.DistributedLinearLayout([[0, 0, 0, 0, 1], [0, 0, 1, 0, 0]],
                                        [[0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0],
                                         [0, 0, 0, 4, 0]], [[1 << i, 0, 0, 0, 0] for i in range(int(math.log2(W)))],
                                        [], [W, 4, 2, 8, 2])
        # every group's value scale of the lane's tokens (post-scaled side): VL with the groups as fastest registers
        VS = gl.DistributedLinearLayout([[0, 0, 0, 1 << i] for i in range(int(math.log2(ng)))]
                                        + [[0, 1 << i, 0, 0] for i in range(int(math.log2(tpl)))],
                                        [[0, tpl, 0, 0], [0, 2 * tpl, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
                                        [[1 << i, 0, 0, 0] for i in range(int(math.log2(W)))], [], [W, 4 * tpl, 8, ng])
        # natural order's value constants of the lane's tokens, every group ([W, 4 (tl), 8 (gl), tpl * ng]): the
        # tokens' constants are contiguous in the registers, so one lane's load is one or two 16-byte vectors
        FL = gl.DistributedLinearLayout([[0, 0, 0, 1 << i] for i in range(int(math.log2(tpl * ng)))],
                                        [[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
                                        [[1 << i, 0, 0, 0] for i in range(int(math.log2(W)))], [],
                                        [W, 4, 8, tpl * ng])
        _TEXT_LAYOUTS[key] = dict(XL=XL, VL=VL, LP=LP, MMA=MMA, DA=DA, DB=DB, PL=PL, VS=VS, FL=FL,
                                  RING=ring_layout(D))
    return _TEXT_LAYOUTS[key]
