"""Decode attention over a layer's mixed KV segments, read as stored (Triton; spec: ``reference.py``).

``decode_attention(q [B, Hq, D], segments)`` attends one query token per row over every valid token of every
segment (dense fp16/bf16/fp32, channel-wise b-bit ``ChannelSeg``, KIVI/XQuant ``KiviSeg``), with GQA (``Hq = G *
H``), per-row ``lens`` and CalibQuant's pre-softmax calibration. Nothing dequantizes a segment to memory:
channel-wise keys use post-scaling (``logit = (q*s) . code + q . z`` per token block), channel-wise values
``p @ codes`` then ``* s + sum(p) * z``, token-group values ``p @ (code*s + z)`` on the tile in registers.

Launches (all on ``q``'s stream, fp32 partials in log2 units so that splits of all segments merge exactly):

1. range pass, one per ``ChannelSeg`` with ``calib`` (per ``ChannelSeg`` on the Gluon path, whose main pass uses
   its maximum as the softmax reference): grid ``(splits, H, B)``; reads q, the segment's K codes, K scale/zero
   and ``lens``; writes ``cal[B, Hq, splits, 2]`` = (min, max) of that split's valid uncalibrated logits. (Gluon
   kernel on CUDA when eligible, else the Triton kernel below in MODE 1.)
2. main split-K pass, one per segment: grid ``(splits, H, B)``; a program loads its G query rows once (all
   heads of one KV head share every load of codes), walks its token range in tiles (codes 16 B per load), keeps
   an fp32 online softmax (m, l, acc) and writes one partial ``part_o[B, Hq, S, D]``, ``part_ml[B, Hq, S, 2]``
   at its own split index ``s`` (splits of all segments are numbered globally, ``S`` in total). Calibrated
   segments first reduce their ``cal`` row (gamma = min, delta = max) and fold ``g(x)`` into ``q*s`` and the
   constant term. Channel segments run the Gluon kernels of ``gluon/`` on CUDA (sm_80+, one scale
   block, G <= 8, D in {64, 128}); everything else, and everything under ``TRITON_INTERPRET=1``, runs
   ``_segment_kernel`` here.
3. merge: grid ``(Hq, B, D / DC)`` (``states.merge_shape``: up to 128 partials per round, the channels in
   chunks where that many); reads the S partials of a row, writes ``out[B, Hq, D]`` (q.dtype) and, if asked,
   ``lse[B, Hq]`` (natural log, fp32). Rows without any valid token give out 0 and lse -inf (as the reference).

A 1-bit ``ChannelSeg`` may instead take one fused launch for 1. and 2. (``gluon/kernel.py`` mode 2, see there; K is
read once) where its K logits fit in shared memory. Its programs have 2-16 warps (``_fused_warps``, by shape) and
the splits of a (row, KV head) meet at a barrier in one of two ways (``_fused_plan``):

* sm_90: one thread block cluster of 2-8 CTAs per (row, KV head), or a single 8- or 16-warp program per pair (no
  cluster), any number of waves. That launch goes last and its clusters also merge every partial of their rows,
  those of the layer's other segments included, into ``out`` (and ``lse``): no merge launch. Where a dense or
  KIVI segment's kernel runs just before it, that kernel lets it launch at once (programmatic dependent launch)
  and the clusters wait for it only before they merge (``MMKV_OVERLAP=0``: one after the other).
  ``MMKV_CLUSTER=0`` turns clusters off; ``MMKV_CLUSTER_MAX`` (default 8) and ``MMKV_FIN=0`` (merge launch kept)
  are switches for side-by-side measurements (``eval/bench/ab.py``).
* otherwise (or where a wave holds 8+ splits of 8+ tiles, or a few rows of a long span): one wave of programs, at
  most 32 splits per pair, one int32 counter per (row, KV head) in a zeroed buffer per (GPU, stream) that each
  launch leaves zeroed.

Both read and write ``cal``.

Split counts come from the token capacity of each segment (host-side shapes only: no device sync) and the batch:
enough programs to cover the GPU a few times over at batch 1, one split per (row, head) when the batch alone
fills it; a dense segment of up to 1024 tokens (the fp16 window) beside one of 8x its tokens takes one tile a
split (``window_rules.window_tps``).
"""

from __future__ import annotations

import math
import warnings

import torch

from .._launch import Launcher, on_device
from ..layouts import natural_values, per_byte
from ..switches import interpreted, switch
from . import gluon as _gc
from .gluon.text import launch_text
from .plan import (
    _GLUON_BROKEN,
    _generic_channel_tiles,
    _int8_k,
    _kv_heads,
    _num_sms,
    _pdl_ok,
    _pow2,
    _splits,
    plan_items,
)
from .registry import KIND_CHANNEL, KIND_DENSE, KIND_KIVI, KIND_PLUGIN, LAYOUTS, LOG2E, LaunchContext
from .segment_kernel import _segment_kernel
from .states import _merge_kernel, merge_shape

_SEG = Launcher(_segment_kernel)
_MERGE = Launcher(_merge_kernel)


def _inner_ok(t: torch.Tensor, row: int) -> torch.Tensor:
    """``t`` with unit last stride and row stride ``row`` on dim -2 (copies only when the view is not already so)."""
    if t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) == row):
        return t
    return t.contiguous()


def _scale_pair(s: torch.Tensor, z: torch.Tensor, D: int):
    """Scale/zero [B, H, NB, D] sharing strides; D stride 0 (global range) or 1. Returns (s, z, sd)."""
    def norm(t):
        if t.stride(-1) in (0, 1):
            return t
        return t.contiguous()
    s, z = norm(s), norm(z)
    if s.stride() != z.stride():
        s, z = s.contiguous(), z.contiguous()
    return s, z, (0 if s.stride(-1) == 0 and D > 1 else 1)


def decode_attention(q: torch.Tensor, segments: list, sm_scale: float | None = None, return_lse: bool = False,
                     out: torch.Tensor | None = None, *, gluon: bool | None = None, warps: int | None = None,
                     programs_per_sm: float | None = None, range_programs_per_sm: float | None = None,
                     maxnreg: int | None = None, channel_stages: int | None = None, text_tile: int | None = None,
                     text_warps: int = 4, text_stages: int = 3):
    """Attention of one decode token per row over every segment of a layer.

    ``q [B, Hq, D]`` (fp16/bf16/fp32), ``segments``: ``DenseSeg | ChannelSeg | KiviSeg`` (same B, H = KV heads,
    D). Returns ``out [B, Hq, D]`` in ``q.dtype`` (written into ``out`` if given) and, with ``return_lse``, also
    ``lse [B, Hq]`` fp32 (natural log). ``gluon=False`` forces the generic Triton kernel for channel segments
    (``None``: Gluon where eligible); ``warps``: warps per Gluon program (``None``: 2, and the fused 1-bit kernel
    picks its own by shape, ``_fused_warps``); ``programs_per_sm``: how many
    programs per multiprocessor the split heuristic aims for (splits never go below one tile per program; ``None``:
    4, and a Gluon channel segment's main pass takes as many splits as fill one wave of the programs a
    multiprocessor holds at once, read off the compiled kernel);
    ``range_programs_per_sm``: the same for the Gluon range pass (``None``: 8 where its K side runs on int8
    tensor cores, 4 otherwise); ``maxnreg``: register cap of the Gluon kernels
    (H100 sweep in docs/BENCHMARKS.md: the defaults were fastest); ``channel_stages``: depth of the Gluon kernels'
    shared-memory ring for the codes (0: prefetch into registers instead; ``None``: by bit-width, H100 sweep in
    docs/BENCHMARKS.md); ``text_tile``,
    ``text_warps``, ``text_stages``: tokens per iteration (a power of two >= 16), warps and software-pipeline depth
    of the KIVI/XQuant segment kernel.
    """
    if text_tile is None:  # H100 sweep (docs/BENCHMARKS.md): 128-token tiles at head_dim 64, 64 at 128
        text_tile = 128 if q.shape[-1] <= 64 else 64
    if text_tile < 16 or text_tile & (text_tile - 1):
        raise ValueError(f"text_tile must be a power of two >= 16, got {text_tile}")
    if channel_stages is not None and channel_stages not in (0, 2, 3, 4, 5, 6, 7, 8):
        raise ValueError(f"channel_stages must be 0 (register prefetch) or 2..8, got {channel_stages}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    with on_device(q):  # a layer of a sharded model: launch on its GPU, not the current one (docs/MULTIGPU.md)
        return _decode_attention(q, segments, sm_scale, return_lse, out, gluon, warps, programs_per_sm,
                                 range_programs_per_sm, maxnreg, channel_stages, text_tile, text_warps, text_stages)


def _decode_attention(q, segments, sm_scale, return_lse, out, gluon, warps, programs_per_sm, range_programs_per_sm,
                      maxnreg, channel_stages, text_tile, text_warps, text_stages):
    B, HQ, D = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    qk_scale = float(sm_scale) * LOG2E
    dev = q.device
    if q.stride(-1) != 1:
        q = q.contiguous()
    final = out
    if out is None or out.stride(-1) != 1 or out.dtype != q.dtype:
        out = torch.empty((B, HQ, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, HQ), dtype=torch.float32, device=dev) if return_lse else None
    segs = [s for s in segments if s is not None]
    if not segs:
        out.zero_()
        if final is not None and final is not out:
            final.copy_(out)
            out = final
        if return_lse:
            lse.fill_(float("-inf"))
            return out, lse
        return out
    H = _kv_heads(segs[0])
    if HQ % H:
        raise ValueError(f"{HQ} query heads is not a multiple of {H} KV heads")
    G = HQ // H
    GP = max(1, _pow2(G))
    nsm = _num_sms(dev)
    auto_warps = warps is None and programs_per_sm is None
    warps = warps or 2

    items, S, fin = plan_items(q, segs, B, H, G, D, nsm, gluon, warps, auto_warps, programs_per_sm, channel_stages,
                               text_tile)
    part_o = torch.empty((B, HQ, S, D), dtype=torch.float32, device=dev)
    part_ml = torch.empty((B, HQ, S, 2), dtype=torch.float32, device=dev)
    dummy = part_ml
    ctx = None

    trigger = False  # did the last launched kernel let the next one start early (programmatic dependent launch)?
    for it in items:
        seg, kind = it["seg"], it["kind"]
        grid = (it["nsplit"], H, B)
        trigger = False
        # the plan's "trig": the next kernel, launched as this one's dependent ("dep"), starts beside it
        # (window_rules: window_overlap, channel_overlap)
        trig = it.get("trig", False)
        if kind == KIND_PLUGIN:
            ctx = ctx or LaunchContext(q, B, H, G, GP, D, HQ, S, part_o, part_ml, qk_scale, nsm)
            LAYOUTS[type(seg)].launch(ctx, it)
            trigger = bool(it.get("pdl"))  # its kernel let the merge launch start early (Layout.split)
            continue
        if kind == KIND_DENSE:
            k = _inner_ok(seg.k, D)
            v = _inner_ok(seg.v, D)
            ieee = (k.dtype == torch.float32 or v.dtype == torch.float32 or k.dtype != v.dtype
                    or (k.dtype == torch.bfloat16 and interpreted()))
            consts = dict(KIND=KIND_DENSE, MODE=0, G=G, GP=GP, D=D, BITS=8, VBITS=8, GROUP=1, TT=it["tt"],
                          SDK=1, SDV=1, SINGLE=True, CALIB=False, IEEE=ieee, KBLK=1, TRIG=trig)
            _SEG(grid, (q, q.stride(0), q.stride(1),
                        k, v, dummy, dummy, dummy, dummy, it["lens"],
                        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), 0, 0, 0, 0,
                        it["T"], 1, it["tps"],
                        dummy, 0, 0.0, 0.0,
                        part_o, part_ml, HQ, S, it["s_off"], qk_scale),
                 consts, tuple(consts.values()), num_warps=4)
            continue
        if kind == KIND_CHANNEL:
            try:
                trigger = _run_channel(it, q, H, G, GP, D, HQ, S, part_o, part_ml, qk_scale, it.get("w", warps), nsm,
                                       maxnreg, range_programs_per_sm, channel_stages, out, lse,
                                       dependent=it.get("dep", False))
            except Exception as e:  # a Gluon build problem must not take decoding down: use the Triton kernel
                if not it["gl"]:
                    raise
                _GLUON_BROKEN.append(repr(e))
                warnings.warn(f"Gluon channel kernel failed ({e!r}); using the Triton kernel from now on",
                              stacklevel=2)
                it["gl"] = False
                it["fin"] = False
                it["tt"], it["tps"] = _generic_channel_tiles(it, S_tokens=it["tps"] * it["tt"])
                trigger = _run_channel(it, q, H, G, GP, D, HQ, S, part_o, part_ml, qk_scale, warps, nsm, maxnreg,
                                       range_programs_per_sm, channel_stages)
            continue
        if it.get("tgl"):
            seg = _run_text(it, grid, q, G, D, HQ, S, part_o, part_ml, qk_scale, out, lse)
        if seg is None:  # KIVI: the Gluon text kernel read it; else the Triton kernel (values in natural order)
            trigger = bool(it.get("pdl"))
            continue
        it["fin"] = False
        kc = _inner_ok(seg.k_codes, D)
        ks, kz, sdk = _scale_pair(seg.k_scale, seg.k_zero, D)
        pv = per_byte(seg.v_bits)
        vc = _inner_ok(seg.v_codes, D // pv)
        vs = _inner_ok(seg.v_scale, D // seg.group)
        vz = _inner_ok(seg.v_zero, D // seg.group)
        if vs.stride() != vz.stride():
            vs, vz = vs.contiguous(), vz.contiguous()
        single = seg.k_scale.shape[2] == 1 or seg.block >= it["T"]
        consts = dict(KIND=KIND_KIVI, MODE=0, G=G, GP=GP, D=D, BITS=seg.k_bits, VBITS=seg.v_bits, GROUP=seg.group,
                      TT=it["tt"], SDK=sdk, SDV=1, SINGLE=single, CALIB=False, IEEE=False, KBLK=seg.block, TRIG=trig)
        _SEG(grid, (q, q.stride(0), q.stride(1),
                    kc, vc, ks, kz, vs, vz, it["lens"],
                    kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), ks.stride(2), vc.stride(0), vc.stride(1),
                    vs.stride(0), vs.stride(1), 0,
                    it["T"], seg.block, it["tps"],
                    dummy, 0, 0.0, 0.0,
                    part_o, part_ml, HQ, S, it["s_off"], qk_scale),
             consts, tuple(consts.values()), num_warps=text_warps, num_stages=text_stages)

    if fin is not None and fin["fin"]:
        return _result(out, final, lse, return_lse)
    # the merge starts early only after a kernel that lets it (measured: after any other it cost time); a kernel
    # triggers only where _pdl_ok holds
    _launch_merge(part_o, part_ml, out, lse, S, bool(trigger))
    return _result(out, final, lse, return_lse)


def _launch_merge(part_o, part_ml, out, lse, S, pdl):
    """The merge launch: grid ``(Hq, B, D / DC)`` (``states.merge_shape``), ``lse`` written where not ``None``."""
    B, HQ, D = out.shape
    so = out.stride()
    bs, dc = merge_shape(S, D, switch("MMKV_MERGE_WIDE") != "0")
    has_lse = lse is not None
    _MERGE((HQ, B, D // dc), (part_o, part_ml, out, lse if has_lse else part_ml, S, so[0], so[1], HQ if has_lse else 0),
           dict(D=D, BS=bs, HAS_LSE=has_lse, PDL=pdl, DC=dc), (D, has_lse, pdl, bs, dc), num_warps=4,
           **({"launch_pdl": True} if pdl else {}))


def _run_text(it, grid, q, G, D, HQ, S, part_o, part_ml, qk_scale, out, lse):
    """The Gluon text kernel (plan: ``_text_gluon_ok``): None once it ran. Where it failed to build, no Gluon kernel
    runs from now on (``_GLUON_BROKEN``, as after a channel kernel's failure) and the Triton kernel reads the
    segment returned (values in natural order) with the plan's tile. The plan's ``fin`` item (clusters, ``cl``)
    also merges every partial into ``out`` (and ``lse``); ``pdl``: it lets the merge launch start early."""
    seg = it["seg"]
    ks, kz, sdk = _scale_pair(seg.k_scale, seg.k_zero, D)
    fin = bool(it.get("fin"))
    try:
        launch_text(grid, q, seg, ks, kz, sdk, it["lens"], it["T"], part_o, part_ml, HQ, S, it["s_off"], it["tps"],
                    qk_scale, G=G, W=it["tw"], pfd=it["pfd"], pfn=it.get("pfn", 1), regs=it["regs"],
                    svec=it.get("svec", False), ring=it.get("ring", (0, False)), pdl=0 if fin else it.get("pdl", 0),
                    cl=it.get("cl", 0), final=out if fin else None, lse=lse if fin else None,
                    unmasked=it.get("full", True), dep=it.get("dep", False))
    except Exception as e:
        _GLUON_BROKEN.append(repr(e))
        warnings.warn(f"Gluon text kernel failed ({e!r}); using the Triton kernel from now on", stacklevel=3)
        return natural_values(seg)
    return None


def _result(out, final, lse, return_lse):
    if final is not None and final is not out:
        final.copy_(out)
        out = final
    if return_lse:
        return out, lse
    return out


_SYNC: dict = {}


def _sync_counters(dev, n: int) -> torch.Tensor:
    """Zeroed int32 counters for the fused kernel's barriers, one per (row, KV head). Each launch leaves them at 0,
    so one buffer per (GPU, stream) serves every call; launches on one stream never overlap (the fused kernel
    starts only after the previous kernel ended)."""
    from .._launch import _stream

    key = (dev.index, _stream())
    buf = _SYNC.get(key)
    if buf is None or buf.numel() < n:
        buf = _SYNC[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=dev)
    return buf


def _run_channel(it, q, H, G, GP, D, HQ, S, part_o, part_ml, qk_scale, warps, nsm, maxnreg, range_programs_per_sm,
                 stages, out=None, lse=None, dependent=False):
    seg = it["seg"]
    B = q.shape[0]
    dev = q.device
    kc, vc = seg.k_codes, seg.v_codes
    ks, kz, sdk = _scale_pair(seg.k_scale, seg.k_zero, D)
    vs, vz, sdv = _scale_pair(seg.v_scale, seg.v_zero, D)
    calib = seg.calib is not None
    tau1 = tau2 = 0.0
    if calib:
        tau1, tau2 = float(seg.calib[0]) * LOG2E, float(seg.calib[1]) * LOG2E
    if it["gl"]:
        # range pass (min/max of the uncalibrated logits; also the softmax reference without calibration), then
        # the main pass; both read K in the same order, so at moderate sizes the second read hits L2
        rows_cap = kc.shape[2]
        words = (kc.view(torch.int32), vc.view(torch.int32), ks, kz, vs, vz)  # the kernels read 4 code bytes at a time
        n_it_total = it["tiles"]
        # measured (docs/BENCHMARKS.md): the early start pays for 1-bit codes, and for wider ones from B*H >= 64;
        # at batch 1 it made 2/4-bit spans slower
        pdl = _pdl_ok(dev) and (seg.bits == 1 or B * H >= 64)
        if it.get("itm"):  # one fused launch (its min/max rows go to cal, which it also reads back)
            cal = torch.empty((B, HQ, it["nsplit"], 2), dtype=torch.float32, device=dev)
            _gc.launch_channel((it["nsplit"], H, B), q, words, it["lens"], it["T"], rows_cap,
                               cal, it["nsplit"], tau1, tau2, part_o, part_ml, HQ, S, it["s_off"], it["tps"],
                               qk_scale, G=G, D=D, bits=seg.bits, W=warps, sdk=sdk, sdv=sdv, calib=calib, mode=2,
                               maxnreg=maxnreg, pdl=pdl, i8=True, itm=it["itm"], cl=it["cl"],
                               sync=None if it["cl"] else _sync_counters(dev, B * H),
                               final=out if it.get("fin") else None, lse=lse if it.get("fin") else None,
                               dependent=dependent and pdl)
            return pdl
        i8 = _int8_k(seg.bits, G, it["nsplit"] * B * H, nsm)
        rpps = range_programs_per_sm or (8.0 if i8 else 4.0)  # H100 sweep (docs/BENCHMARKS.md)
        # at least 4 iterations per range program: every main-pass program reads all range splits' (min, max)
        cal_ipp = min(n_it_total, max(4, -(-n_it_total * B * H // max(1, int(rpps * nsm)))))
        st_range = _gc.default_stages(seg.bits, cal_ipp) if stages is None else stages
        st = _gc.default_stages(seg.bits, it["tps"]) if stages is None else stages
        n_cal = _splits(n_it_total, cal_ipp)
        cal = torch.empty((B, HQ, n_cal, 2), dtype=torch.float32, device=dev)
        _gc.launch_channel((n_cal, H, B), q, words, it["lens"], it["T"], rows_cap,
                           part_ml, 0, 0.0, 0.0, part_o, cal, HQ, n_cal, 0, cal_ipp, qk_scale,
                           G=G, D=D, bits=seg.bits, W=warps, sdk=sdk, sdv=sdv, calib=False, mode=1, maxnreg=maxnreg,
                           stages=st_range, pdl=pdl, i8=i8)
        _gc.launch_channel((it["nsplit"], H, B), q, words, it["lens"], it["T"], rows_cap,
                           cal, n_cal, tau1, tau2, part_o, part_ml, HQ, S, it["s_off"], it["tps"], qk_scale,
                           G=G, D=D, bits=seg.bits, W=warps, sdk=sdk, sdv=sdv, calib=calib, mode=0, maxnreg=maxnreg,
                           stages=st, pdl=pdl, i8=i8)
        return pdl
    kc = _inner_ok(kc, D)
    vc = _inner_ok(vc, D)
    if vc.stride() != kc.stride():
        kc, vc = kc.contiguous(), vc.contiguous()
    single = seg.block >= it["T"] or seg.k_scale.shape[2] == 1
    cal, n_cal = part_ml, 0
    args = lambda mode, cal_, n_cal_, po, pml, s_tot, s_off, tps, cal_on: (  # noqa: E731
        q, q.stride(0), q.stride(1),
        kc, vc, ks, kz, vs, vz, it["lens"],
        kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1),
        vs.stride(2), 0, 0,
        it["T"], seg.block, tps,
        cal_, n_cal_, tau1, tau2,
        po, pml, HQ, s_tot, s_off, qk_scale,
    )
    if calib:
        n_cal = it["nsplit"]
        cal = torch.empty((B, HQ, n_cal, 2), dtype=torch.float32, device=dev)
        consts = dict(KIND=KIND_CHANNEL, MODE=1, G=G, GP=GP, D=D, BITS=seg.bits, VBITS=8, GROUP=1, TT=it["tt"],
                      SDK=sdk, SDV=sdv, SINGLE=single, CALIB=False, IEEE=False, KBLK=1, TRIG=False)
        _SEG((n_cal, H, B), args(1, part_ml, 0, part_o, cal, n_cal, 0, it["tps"], False), consts,
             tuple(consts.values()), num_warps=4)
    consts = dict(KIND=KIND_CHANNEL, MODE=0, G=G, GP=GP, D=D, BITS=seg.bits, VBITS=8, GROUP=1, TT=it["tt"],
                  SDK=sdk, SDV=sdv, SINGLE=single, CALIB=calib, IEEE=False, KBLK=1, TRIG=False)
    _SEG((it["nsplit"], H, B), args(0, cal, n_cal, part_o, part_ml, S, it["s_off"], it["tps"], calib), consts,
         tuple(consts.values()), num_warps=4)
