"""The register layouts of the Gluon SKVQ kernel (``skvq.py``) per warps, head_dim, key bits and MMA columns, built
once per variant."""

from __future__ import annotations

import math

from .ternary import tern_layouts

_LAYOUTS: dict = {}


def skvq_layouts(W: int, D: int, kbits: int, nc: int) -> dict:
    """(KXL, VXL, QBL, MMA, DA, DB) of the kernel for ``W`` warps, head_dim ``D`` and ``kbits``-bit keys.

    KXL: K words [W, 16 tokens, 4 NWL]: lane (g, t) holds tokens g and g + 8 (a register), words [t NWL, (t+1) NWL)
    (its D/4 channels: one 4- or 8-byte load). VXL: V words [W, 16 tokens, 8]: lane (g, t) holds word g (D/8
    channels) of tokens 2t, 2t+1 (register 0) and 2t+8, 2t+9 (register 1)."""
    key = (W, D, kbits, nc)
    if key not in _LAYOUTS:
        from triton.experimental.gluon import language as gl

        wb = [[1 << i, 0, 0] for i in range(int(math.log2(W)))]
        kbpt = D * kbits // 32
        nwl = max(1, kbpt // 4)
        KXL = gl.DistributedLinearLayout([[0, 0, 1 << i] for i in range(int(math.log2(nwl)))] + [[0, 8, 0]],
                                         [[0, 0, nwl], [0, 0, 2 * nwl], [0, 1, 0], [0, 2, 0], [0, 4, 0]], wb, [],
                                         [W, 16, 4 * nwl])
        VXL = gl.DistributedLinearLayout([[0, 1, 0], [0, 8, 0]],
                                         [[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], wb, [], [W, 16, 8])
        QBL = gl.BlockedLayout([1, 1, nc], [1, 32, 1], [W, 1, 1], [2, 1, 0])
        MMA = gl.NVMMADistributedLayout([2, 0], [W, 1, 1], [1, 16, 8])
        _LAYOUTS[key] = dict(KXL=KXL, VXL=VXL, QBL=QBL, MMA=MMA, DA=gl.DotOperandLayout(0, MMA, 2),
                             DB=gl.DotOperandLayout(1, MMA, 2), **tern_layouts(W))
    return _LAYOUTS[key]
