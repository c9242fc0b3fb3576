"""Host side of the channel kernel: layouts and constexprs of a variant, how many of its programs an SM holds, and
the launch."""

from __future__ import annotations

import math

from .operands import HAVE_GLUON, rows_per_warp

if HAVE_GLUON:
    from triton.experimental.gluon import language as gl

    from .kernel import _channel_kernel


_LAYOUTS: dict = {}
_CONSTS: dict = {}
_LAUNCHER: list = []
_RESIDENT: dict = {}  # (device, D, bits, W, stages, mode, int8 K, itm) -> programs per SM, from the compiled kernel


def resident_programs(dev_index: int, D: int, bits: int, W: int, stages: int, mode: int,
                      i8: bool = False, itm: int = 0) -> int | None:
    """Programs of this variant one multiprocessor holds at once (registers, shared memory, warps), known once the
    variant has been compiled on this device; ``None`` before."""
    return _RESIDENT.get((dev_index, D, bits, W, stages, mode, i8, itm))


def programs_by_registers(dev_index: int, D: int, bits: int, W: int, stages: int, mode: int,
                          i8: bool = False) -> int | None:
    """Programs per SM that registers and warp slots allow for this variant (any ``itm``), once one is compiled."""
    return _RESIDENT.get((dev_index, D, bits, W, stages, mode, i8, "regs"))


def fused_shared_bytes(itm: int, W: int, bits: int = 1) -> int:
    """Shared memory the fused kernel keeps logits in: ``itm`` iterations of NJ steps, [W, 16, 4] fp32 each."""
    return itm * (4 // bits) * W * 16 * 4 * 4


def _record_resident(kernel, key, W: int) -> None:
    import torch

    try:
        props = torch.cuda.get_device_properties(key[0])
        regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
        smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        warps_sm = getattr(props, "max_threads_per_multi_processor", 2048) // 32
        regs_warp = -(-kernel.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
        # a warp's registers come from the quarter register file of its SM sub-partition (ncu's "block limit
        # registers": 134 registers give 3 warps per quarter, 6 two-warp programs per SM, not 65536 // 8704 = 7)
        by_regs = (regs_sm // 4 // max(1, regs_warp)) * 4 // W
        by_smem = smem_sm // (kernel.metadata.shared + 1024)  # the driver reserves 1 KB per block
        _RESIDENT[key] = max(1, min(by_regs, by_smem, warps_sm // W, 32))
        _RESIDENT[key[:-1] + ("regs",)] = max(1, min(by_regs, warps_sm // W, 32))
    except Exception:  # an unexpected Triton/torch version: the caller keeps its programs-per-SM heuristic
        _RESIDENT[key] = None


def _launcher():
    if not _LAUNCHER:
        from ..._launch import Launcher

        _LAUNCHER.append(Launcher(_channel_kernel))
    return _LAUNCHER[0]


def build_layouts(W: int, D: int, bits: int):
    """(XL, Y0L, YL, MMA, QL, DA, DB) for ``W`` warps, head_dim ``D`` and ``rw`` = 8 byte rows per warp (16 for
    8-bit codes).

    The code layouts are over 4-byte words [W, rw, D/4]:
    XL: K codes: lane (g, t) holds row g (and g+8) and channels [t*D/4, (t+1)*D/4) (16-byte vectors).
    Y0L: V codes, as loaded: lane (g, t) holds rows 2t, 2t+1 (and +8) and channels [g*D/8, (g+1)*D/8).
    YL: Y0L with the row parity as register 0 (so that the two rows of a pair split apart).
    """
    rw = rows_per_warp(bits)
    key = (W, D, rw)
    if key not in _LAYOUTS:
        wb = [[1 << i, 0, 0] for i in range(int(math.log2(W)))]
        cpq, cpr = D // 16, D // 32  # words per lane and row: K, V
        r8 = [[0, 8, 0]] if rw == 16 else []
        kreg = [[0, 0, 1 << i] for i in range(int(math.log2(cpq)))] + r8
        klane = [[0, 0, cpq], [0, 0, 2 * cpq], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
        creg = [[0, 0, 1 << i] for i in range(int(math.log2(cpr)))]
        vlane = [[0, 2, 0], [0, 4, 0], [0, 0, cpr], [0, 0, 2 * cpr], [0, 0, 4 * cpr]]
        XL = gl.DistributedLinearLayout(kreg, klane, wb, [], [W, rw, D // 4])
        Y0L = gl.DistributedLinearLayout(creg + [[0, 1, 0]] + r8, vlane, wb, [], [W, rw, D // 4])
        YL = gl.DistributedLinearLayout([[0, 1, 0]] + creg + r8, vlane, wb, [], [W, rw, D // 4])
        MMA = gl.NVMMADistributedLayout([2, 0], [W, 1, 1], [1, 16, 8])
        QL = gl.BlockedLayout([1, D // 16, 1], [1, 4, 8], [W, 1, 1], [1, 2, 0])
        DA = gl.DotOperandLayout(0, MMA, 2)
        DB = gl.DotOperandLayout(1, MMA, 2)
        _LAYOUTS[key] = (XL, Y0L, YL, MMA, QL, DA, DB)
    return _LAYOUTS[key]


def ring_layout(D: int):
    """Shared layout of a ``[stages, W, rw, D/4]`` word ring: 16-byte chunks XOR-swizzled by the row, so that the
    16-byte loads of the K and V register layouts (``build_layouts``) hit distinct banks within each 8-lane phase.
    (A ``SharedLinearLayout`` would say this directly; Triton 3.6 cannot index a stage of one.)"""
    return gl.SwizzledSharedLayout(4, 1, 8 if D == 128 else 4, [2, 1, 0])


def int8_layouts(W: int):
    """(S4, DA8, DB8) of the int8 K path: S4 holds [W, 16, 4] per-head logits as the int32 accumulator of
    ``mma.m16n8k32`` leaves them once each head's two byte columns are combined (lane (g, t): rows g and g + 8,
    head t); DA8/DB8 are the int8 operand layouts."""
    wb = [[1 << i, 0, 0] for i in range(int(math.log2(W)))]
    S4 = gl.DistributedLinearLayout([[0, 8, 0]], [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]], wb, [],
                                    [W, 16, 4])
    MMA = build_layouts(W, 64, 1)[3]  # the accumulator layout depends on W only
    return S4, gl.DotOperandLayout(0, MMA, 4), gl.DotOperandLayout(1, MMA, 4)


def kernel_consts(G: int, D: int, bits: int, W: int, sdk: int, sdv: int, calib: bool, mode: int,
                  stages: int = 0, pdl: bool = False, i8: bool = False, itm: int = 0, cl: int = 0,
                  fin: int = 0) -> dict:
    """The constexpr arguments of ``_channel_kernel`` for one variant (cached; ``eval/bench/sass.py`` compiles
    exactly what ``launch_channel`` launches). ``itm``: iterations per program the fused kernel (``mode=2``) keeps
    logits for in shared memory; ``cl``: its splits of a (row, KV head) are one thread block cluster of ``cl`` CTAs
    (sm_90; 1: one program per pair, no cluster; 0: the atomic-counter barrier); ``fin`` (with ``cl``): the cluster
    also merges the layer's partials into the output (1), and the log-sum-exp (2)."""
    ckey = (G, D, bits, W, sdk, sdv, calib, mode, stages, pdl, i8, itm, cl, fin)
    consts = _CONSTS.get(ckey)
    if consts is None:
        if i8 and (bits != 1 or G > 4):  # wider codes' top planes do not fit a signed byte; N = 8 holds 4 heads
            raise ValueError(f"the int8 K side needs 1-bit codes and G <= 4, got bits={bits}, G={G}")
        if mode == 2 and (not i8 or stages or itm < 1):
            raise ValueError(f"the fused kernel needs the int8 K side, no ring and itm >= 1, got i8={i8}, "
                             f"stages={stages}, itm={itm}")
        if (cl or fin) and (mode != 2 or cl not in (1, 2, 4, 8, 16) or D % cl or fin not in (0, 1, 2)):
            raise ValueError(f"clusters need the fused kernel, 1-16 CTAs (a power of two dividing D), got mode={mode}, "
                             f"cl={cl}, fin={fin}")
        XL, Y0L, YL, MMA, QL, DA, DB = build_layouts(W, D, bits)
        S4, DA8, DB8 = int8_layouts(W)
        consts = _CONSTS[ckey] = dict(G=G, D=D, BITS=bits, W=W, SDK=sdk, SDV=sdv, CALIB=calib, MODE=mode,
                                      PF=1 if mode == 0 else 2, ST=stages, PDL=pdl,
                                      RING=ring_layout(D),
                                      XL=XL, Y0L=Y0L, YL=YL, MMA=MMA, QL=QL, DA=DA, DB=DB,
                                      I8=i8, S4=S4, DA8=DA8, DB8=DB8, ITM=itm,
                                      SML=gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]), CL=cl, FIN=fin)
    return consts


def launch_channel(grid, q, seg_t, lens, T, rows_cap, cal, n_cal, tau1, tau2, out, ml, HQ, S_total, s_off,
                   it_per_prog, qk_scale, *, G, D, bits, W, sdk, sdv, calib, mode, maxnreg=None, stages=0, pdl=False,
                   i8=False, sync=None, itm=0, cl=0, final=None, lse=None, dependent=False):
    """Thin launcher; ``seg_t`` = (kw, vw, ks, kz, vs, vz) already validated by the caller, the codes as int32 views
    (4 code bytes per word, row stride D // 4). ``mode=1`` writes ``(min, max)`` rows into ``ml`` (the ``cal``
    buffer of the main pass). ``mode=2`` (fused) writes them into ``cal`` (``n_cal`` = ``grid[0]``) and needs
    ``sync``: int32 counters, one per (sequence, KV head), zero before the launch (and so after it); or ``cl``
    (``grid[0]``, a cluster per (sequence, KV head)), which needs no ``sync``. ``final`` (with ``cl``): the layer's
    output [B, HQ, D], written by the clusters from their partials (and ``lse`` [B, HQ] if given); then no merge
    is needed. ``dependent`` (with ``final`` and ``pdl``): launch as a programmatic dependent of the previous kernel
    on the stream, which must be the layer's other segment kernel that triggers at its start (``_segment_kernel``
    with ``TRIG``); everything before ``_finish`` then runs beside it. The previous kernel must not be a dependent
    itself: what this kernel reads before its wait (q, ``lens``, codes, scales) was written before that one
    started."""
    kw, vw, ks, kz, vs, vz = seg_t
    fin = 0 if final is None else 2 if lse is not None else 1
    if dependent and not (pdl and mode == 2 and fin):
        raise ValueError("dependent launches need the fused kernel with pdl and final")
    ckey = (G, D, bits, W, sdk, sdv, calib, mode, stages, pdl, i8, itm, cl, fin)
    args = (q, q.stride(0), q.stride(1),
            kw, vw, kw.stride(0), kw.stride(1),
            ks, kz, ks.stride(0), ks.stride(1),
            vs, vz, vs.stride(0), vs.stride(1),
            lens, T, rows_cap,
            cal, n_cal, tau1, tau2,
            out, ml, HQ, S_total, s_off,
            it_per_prog, qk_scale, lens if sync is None else sync,
            out if final is None else final, 0 if final is None else final.stride(0),
            0 if final is None else final.stride(1), ml if lse is None else lse)
    kernel = _launcher()(grid, args, kernel_consts(*ckey), ckey, num_warps=W, num_stages=1,
                         **({"maxnreg": maxnreg} if maxnreg else {}),
                         **({"launch_pdl": True} if pdl and (mode == 0 or dependent) else {}),
                         **({"cluster": cl} if cl else {}))
    rkey = (q.device.index, D, bits, W, stages, mode, i8, itm)
    if rkey not in _RESIDENT and not maxnreg and hasattr(kernel, "n_regs"):
        _record_resident(kernel, rkey, W)
