"""The constexprs of the Gluon SKVQ kernel (``skvq.py``): its register layouts per warps, head_dim, key bits and MMA
columns (built once per variant) and the rest of a launch variant's constants."""

from __future__ import annotations

import math

from ...layouts import TERNARY as TERN_BITS
from .skvq_ok import _heads_padded, _pow2, columns
from .ternary import tern_layouts

W_DEFAULT, NS_DEFAULT = 4, 2  # warps per program, 16-token steps per warp and iteration
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


def skvq_consts(G: int, D: int, ng: int, kbits: int, vbits: float, fixed_k: int, fixed_v: int, kperm: bool,
                vperm: bool, fp8: bool, W: int = W_DEFAULT, NS: int = NS_DEFAULT, tlane: bool = False,
                pdl: int = 0, dep: bool = False, unmasked: bool = True, pfd: int = 0, pfn: int = 1) -> dict:
    """The kernel's constexprs; ``vbits`` 1.5 (ternary values) reads ``TERN`` (``VBITS`` is then unused) and
    ``TLANE`` (``tern_lanes``); ``pdl``: where the programs let the merge launch start (``skvq_rules.skvq_pdl``:
    0 never, 1 past their loop, 2 at their start); ``dep``: launched as the programmatic dependent of the kernel
    before it, it waits for that kernel before writing (``window_rules.window_overlap``); ``unmasked``: the
    iterations whose every token is valid run a copy of the loop body without masks (``skvq_rules.skvq_unmasked``);
    ``pfd``: iterations ahead each asks L2 for (``skvq_rules.skvq_prefetch``, sm_90), one request every ``pfn``
    iterations for the next ``pfn`` (``skvq_rules.skvq_prefetch_span``)."""
    if pdl not in (0, 1, 2):
        raise ValueError(f"pdl must be 0, 1 or 2, got {pdl}")
    tern = vbits == TERN_BITS
    return dict(G=G, D=D, NG=ng, KBITS=kbits, VBITS=2 if tern else int(vbits), TERN=tern, TLANE=tern and tlane,
                FIXED_K=fixed_k, FIXED_V=fixed_v, KPERM=kperm,
                VPERM=vperm, FP8=fp8, W=W, NS=NS, GP=_heads_padded(G, ng), NGP=_pow2(ng), PDL=pdl, DEP=dep, UNMASKED=unmasked,
                PFD=pfd, PFN=pfn if pfd else 1, **skvq_layouts(W, D, kbits, columns(G, ng)))


def gluon_tile(W: int = W_DEFAULT, NS: int = NS_DEFAULT) -> int:
    """Tokens one program iteration covers."""
    return W * NS * 16
