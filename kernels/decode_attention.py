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
   constant term. Channel segments run the Gluon kernels of ``_gluon_channel.py`` on CUDA (sm_80+, one scale
   block, G <= 8, D in {64, 128}); everything else, and everything under ``TRITON_INTERPRET=1``, runs
   ``_segment_kernel`` here.
3. merge: grid ``(Hq, B)``; reads the S partials of a row, writes ``out[B, Hq, D]`` (q.dtype) and, if asked,
   ``lse[B, Hq]`` (natural log, fp32). Rows without any valid token give out 0 and lse -inf (as the reference).

A 1-bit ``ChannelSeg`` may instead take one fused launch for 1. and 2. (``_gluon_channel`` mode 2, see there; K is
read once) where its K logits fit in shared memory. Its programs have 2-16 warps (``_fused_warps``, by shape) and
the splits of a (row, KV head) meet at a barrier in one of two ways (``_fused_plan``):

* sm_90: one thread block cluster of 2-8 CTAs per (row, KV head), or a single 8- or 16-warp program per pair (no
  cluster), any number of waves. That launch goes last and its clusters also merge every partial of their rows,
  those of the layer's other segments included, into ``out`` (and ``lse``): no merge launch. Where a dense or
  KIVI segment's kernel runs just before it, that kernel lets it launch at once (programmatic dependent launch)
  and the clusters wait for it only before they merge (``MMKV_OVERLAP=0``: one after the other).
  ``MMKV_CLUSTER=0`` turns clusters off; ``MMKV_CLUSTER_MAX`` (default 8) and ``MMKV_FIN=0`` (merge launch kept)
  are switches for side-by-side measurements (``eval/bench_ab.py``).
* otherwise (or where a wave holds 8+ splits of 8+ tiles, or a few rows of a long span): one wave of programs, at
  most 32 splits per pair, one int32 counter per (row, KV head) in a zeroed buffer per (GPU, stream) that each
  launch leaves zeroed.

Both read and write ``cal``.

Split counts come from the token capacity of each segment (host-side shapes only: no device sync) and the batch:
enough programs to cover the GPU a few times over at batch 1, one split per (row, head) when the batch alone
fills it.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _gluon_channel as _gc
from ._launch import Launcher, on_device
from .reference import ChannelSeg, DenseSeg, KiviSeg, per_byte

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

KIND_DENSE, KIND_CHANNEL, KIND_KIVI = 1, 2, 3
KIND_PLUGIN = 0  # a layout registered in LAYOUTS; its own module launches its own kernel


@dataclass(frozen=True)
class Layout:
    """How a segment type defined outside this file plugs into the split-K plan and the shared merge.

    ``capacity(seg)``: token capacity; ``kv_heads(seg)``: H; ``tile(seg, D)``: tokens one program iteration
    covers; ``tile_bytes(seg, tt, D)``: bytes such a tile moves (balances splits across segments);
    ``launch(ctx, it)``: writes partials for the global splits ``[it["s_off"], it["s_off"] + it["nsplit"])`` of
    every (row, query head) into ``ctx.part_o [B, Hq, S, D]`` (un-normalized fp32 accumulator) and
    ``ctx.part_ml [B, Hq, S, 2]`` (running max in log2 units, i.e. of ``logit * ctx.qk_scale``, and the sum of
    ``exp2(x - max)``), exactly as ``_segment_kernel`` does; ``it`` holds ``seg, T, lens (int32 on q's device),
    tt, tiles, tps (tiles per split), nsplit, s_off``.
    """

    capacity: Callable
    kv_heads: Callable
    tile: Callable
    tile_bytes: Callable
    launch: Callable


LAYOUTS: dict[type, Layout] = {}


def register_layout(seg_type: type, layout: Layout) -> None:
    LAYOUTS[seg_type] = layout


@dataclass
class LaunchContext:
    """What a plug-in launch needs from the call (see ``Layout.launch``)."""

    q: torch.Tensor
    B: int
    H: int
    G: int
    GP: int
    D: int
    HQ: int
    S: int
    part_o: torch.Tensor
    part_ml: torch.Tensor
    qk_scale: float
    nsm: int


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _unpack_tokens(x, BITS: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """uint8 [R, D] packed along tokens -> int32 codes [R * PER, D], token j * PER + i (natural order)."""
    PER: tl.constexpr = 8 // BITS
    sh = (tl.arange(0, PER) * BITS)[None, :, None]
    c = (x.to(tl.int32)[:, None, :] >> sh) & ((1 << BITS) - 1)
    return tl.reshape(c, (R * PER, D))


@triton.jit
def _unpack_channels(x, BITS: tl.constexpr, TT: tl.constexpr, D: tl.constexpr):
    """uint8 [TT, D // PER] packed along channels -> int32 codes [TT, D], channel j * PER + i."""
    PER: tl.constexpr = 8 // BITS
    sh = (tl.arange(0, PER) * BITS)[None, None, :]
    c = (x.to(tl.int32)[:, :, None] >> sh) & ((1 << BITS) - 1)
    return tl.reshape(c, (TT, D))


@triton.jit
def _fold_block(q, ks_base, kz_base, s_nb, blk, offs_d, qk_scale, ratio, shift, SDK: tl.constexpr):
    """Post-scaling constants of one K scale block: (q*s*scale*ratio as fp16 [GP, D], q.z*scale*ratio+shift [GP])."""
    ks = tl.load(ks_base + blk * s_nb + offs_d * SDK).to(tl.float32)
    kz = tl.load(kz_base + blk * s_nb + offs_d * SDK).to(tl.float32)
    qs = (q * ks[None, :] * qk_scale * ratio[:, None]).to(tl.float16)
    qz = tl.sum(q * kz[None, :], 1) * qk_scale * ratio + shift
    return qs, qz


@triton.jit
def _segment_kernel(
    q_ptr, sq_b, sq_h,
    P0, P1, P2, P3, P4, P5, lens_ptr,
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9,
    T, BLK, TPS,
    cal_ptr, n_cal, tau1, tau2,
    po_ptr, pml_ptr, HQ, S_total, s_off,
    qk_scale,
    KIND: tl.constexpr, MODE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BITS: tl.constexpr, VBITS: tl.constexpr, GROUP: tl.constexpr, TT: tl.constexpr,
    SDK: tl.constexpr, SDV: tl.constexpr, SINGLE: tl.constexpr, CALIB: tl.constexpr, IEEE: tl.constexpr,
    KBLK: tl.constexpr, TRIG: tl.constexpr,
):
    """One segment, one split of its token axis, all G query heads of KV head ``h``.

    Pointer / stride meaning by KIND (row strides of the innermost two dims are compact):
      dense:   P0=k, P1=v; s0..s2 = k (b, h, t) strides, s3..s5 = v (b, h, t) strides.
      channel: P0=k_codes, P1=v_codes (same strides s0, s1 for b, h; row stride D), P2/P3 = k scale/zero
               (b, h, block strides s2, s3, s4; D stride SDK), P4/P5 = v scale/zero (s5, s6, s7; SDV).
      kivi:    P0=k_codes (s0, s1), P2/P3 = k scale/zero (s2, s3, s4; SDK), P1 = v codes [B, H, T, D/PV]
               (s5, s6), P4/P5 = v scale/zero [B, H, T, D/GROUP] (s7, s8).
    MODE 0 writes the softmax partial; MODE 1 (channel keys only) writes (min, max) of the uncalibrated logits.
    ``TRIG`` (sm_90): the next kernel, a fused channel kernel launched as its dependent, may start at once.
    """
    sp = tl.program_id(0)
    if TRIG:
        sp = tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, $1;", "=r,r", [sp],
                                       dtype=tl.int32, is_pure=False, pack=1)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    hq = h * G + offs_g
    q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + offs_d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32)
    L = tl.minimum(tl.load(lens_ptr + b), T)
    t_lo = sp * TPS * TT
    t_hi = tl.minimum(t_lo + TPS * TT, L)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    lo_i = tl.full([GP], float("inf"), tl.float32)
    hi_i = tl.full([GP], float("-inf"), tl.float32)

    if KIND == 1:
        kdt = P0.dtype.element_ty
        if IEEE:  # fp32 cache, or bf16 under the interpreter (its bf16 tl.dot is wrong): exact fp32 dots
            kdt = tl.float32
        qk = q.to(kdt)
        for t0 in range(t_lo, t_hi, TT):
            offs_t = t0 + tl.arange(0, TT)
            tm = offs_t < t_hi
            k = tl.load(P0 + b * s0 + h * s1 + offs_t[:, None] * s2 + offs_d[None, :], mask=tm[:, None], other=0.0)
            k = k.to(kdt)
            if IEEE:
                s = tl.dot(qk, tl.trans(k), input_precision="ieee") * qk_scale
            else:
                s = tl.dot(qk, tl.trans(k)) * qk_scale
            s = tl.where(tm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(P1 + b * s3 + h * s4 + offs_t[:, None] * s5 + offs_d[None, :], mask=tm[:, None], other=0.0)
            v = v.to(kdt)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    elif KIND == 3:
        # KIVI / XQuant: the tile is dequantized in registers (K: one scale row per KBLK tokens, broadcast over
        # the block; V: one scale per GROUP channels of each token, broadcast over the group), then two fp16 dots.
        # Loading each scale once per block/group instead of once per element keeps the kernel off the LSU.
        PER: tl.constexpr = 8 // BITS
        R: tl.constexpr = TT // PER
        TR = (T + PER - 1) // PER
        NBT: tl.constexpr = TT // KBLK if TT >= KBLK else 1
        BT: tl.constexpr = KBLK if TT >= KBLK else TT
        PV: tl.constexpr = 8 // VBITS
        DV: tl.constexpr = D // PV
        NG: tl.constexpr = D // GROUP
        qh = (q * qk_scale).to(tl.float16)
        offs_r = tl.arange(0, R)
        offs_nb = tl.arange(0, NBT)
        offs_g2 = tl.arange(0, NG)
        ks_base = P2 + b * s2 + h * s3
        kz_base = P3 + b * s2 + h * s3
        for t0 in range(t_lo, t_hi, TT):
            offs_t = t0 + tl.arange(0, TT)
            tm = offs_t < t_hi
            rows = t0 // PER + offs_r
            x = tl.load(P0 + b * s0 + h * s1 + rows[:, None] * D + offs_d[None, :], mask=(rows < TR)[:, None], other=0)
            # fp16 arithmetic on purpose: packed half FMAs and half the registers of fp32 tiles; the dequantized
            # value is rounded to fp16 for the tensor cores either way
            c = tl.reshape(_unpack_tokens(x, BITS, R, D).to(tl.float16), (NBT, BT, D))
            kb = t0 // KBLK + offs_nb
            koff = kb[:, None] * s4 + offs_d[None, :] * SDK
            kbm = (kb < (T + KBLK - 1) // KBLK)[:, None]  # a tile may reach past the last block of the capacity
            ksc = tl.load(ks_base + koff, mask=kbm, other=0.0).to(tl.float16)
            kzc = tl.load(kz_base + koff, mask=kbm, other=0.0).to(tl.float16)
            k16 = tl.reshape(tl.fma(c, ksc[:, None, :], kzc[:, None, :]), (TT, D))  # one rounding, as fp32 would
            s = tl.dot(qh, tl.trans(k16))
            s = tl.where(tm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            xv = tl.load(P1 + b * s5 + h * s6 + offs_t[:, None] * DV + tl.arange(0, DV)[None, :],
                         mask=tm[:, None], other=0)
            cv = tl.reshape(_unpack_channels(xv, VBITS, TT, D).to(tl.float16), (TT, NG, GROUP))
            voff = offs_t[:, None] * NG + offs_g2[None, :]
            vsc = tl.load(P4 + b * s7 + h * s8 + voff, mask=tm[:, None], other=0.0).to(tl.float16)
            vzc = tl.load(P5 + b * s7 + h * s8 + voff, mask=tm[:, None], other=0.0).to(tl.float16)
            vdq = tl.reshape(tl.fma(cv, vsc[:, :, None], vzc[:, :, None]), (TT, D))
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vdq)
    else:
        PER: tl.constexpr = 8 // BITS
        R: tl.constexpr = TT // PER
        TR = (T + PER - 1) // PER
        ratio = tl.full([GP], 1.0, tl.float32)
        shift = tl.zeros([GP], tl.float32)
        if CALIB:
            gmin = tl.full([GP], float("inf"), tl.float32)
            gmax = tl.full([GP], float("-inf"), tl.float32)
            for c_ in range(n_cal):
                cb = cal_ptr + ((b * HQ + hq) * n_cal + c_) * 2
                gmin = tl.minimum(gmin, tl.load(cb, mask=gmask, other=float("inf")))
                gmax = tl.maximum(gmax, tl.load(cb + 1, mask=gmask, other=float("-inf")))
            width = gmax - gmin
            ok = width > 0
            width = tl.where(ok, width, 1.0)
            ratio = tl.where(ok, (width + tau1 - tau2) / width, 1.0)
            shift = tl.where(ok, (1.0 - ratio) * tl.where(ok, gmin, 0.0) - tau1, 0.0)
        ks_base = P2 + b * s2 + h * s3
        kz_base = P3 + b * s2 + h * s3
        qs, qz = _fold_block(q, ks_base, kz_base, s4, 0, offs_d, qk_scale, ratio, shift, SDK)
        offs_r = tl.arange(0, R)
        for t0 in range(t_lo, t_hi, TT):
            offs_t = t0 + tl.arange(0, TT)
            tm = offs_t < t_hi
            rows = t0 // PER + offs_r
            x = tl.load(P0 + b * s0 + h * s1 + rows[:, None] * D + offs_d[None, :], mask=(rows < TR)[:, None], other=0)
            c16 = _unpack_tokens(x, BITS, R, D).to(tl.float16)
            blk0 = t0 // BLK
            t_b = (blk0 + 1) * BLK  # first token of the next scale block
            if not SINGLE:
                qs, qz = _fold_block(q, ks_base, kz_base, s4, blk0, offs_d, qk_scale, ratio, shift, SDK)
            s = tl.dot(qs, tl.trans(c16)) + qz[:, None]
            if not SINGLE:
                if t_b < t0 + TT:  # the tile straddles two blocks (TT <= BLK: never more)
                    qs1, qz1 = _fold_block(q, ks_base, kz_base, s4, blk0 + 1, offs_d, qk_scale, ratio, shift, SDK)
                    s_nx = tl.dot(qs1, tl.trans(c16)) + qz1[:, None]
                    s = tl.where((offs_t >= t_b)[None, :], s_nx, s)
            if MODE == 1:
                lo_i = tl.minimum(lo_i, tl.min(tl.where(tm[None, :], s, float("inf")), 1))
                hi_i = tl.maximum(hi_i, tl.max(tl.where(tm[None, :], s, float("-inf")), 1))
            else:
                s = tl.where(tm[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
                p16 = p.to(tl.float16)
                xv = tl.load(P1 + b * s0 + h * s1 + rows[:, None] * D + offs_d[None, :],
                             mask=(rows < TR)[:, None], other=0)
                cv = _unpack_tokens(xv, BITS, R, D).to(tl.float16)
                vs_base = P4 + b * s5 + h * s6
                vz_base = P5 + b * s5 + h * s6
                if SINGLE:
                    p_a = p16
                else:
                    p_a = tl.where((offs_t < t_b)[None, :], p16, 0.0).to(tl.float16)
                vs = tl.load(vs_base + blk0 * s7 + offs_d * SDV).to(tl.float32)
                vz = tl.load(vz_base + blk0 * s7 + offs_d * SDV).to(tl.float32)
                pv = tl.dot(p_a, cv) * vs[None, :] + tl.sum(p_a.to(tl.float32), 1)[:, None] * vz[None, :]
                if not SINGLE:
                    if t_b < t_hi:
                        p_b = tl.where((offs_t >= t_b)[None, :], p16, 0.0).to(tl.float16)
                        vs1 = tl.load(vs_base + (blk0 + 1) * s7 + offs_d * SDV).to(tl.float32)
                        vz1 = tl.load(vz_base + (blk0 + 1) * s7 + offs_d * SDV).to(tl.float32)
                        pv += tl.dot(p_b, cv) * vs1[None, :] + tl.sum(p_b.to(tl.float32), 1)[:, None] * vz1[None, :]
                acc = acc * alpha[:, None] + pv

    row = (b * HQ + hq) * S_total + s_off + sp
    if MODE == 1:
        tl.store(pml_ptr + row * 2, lo_i, mask=gmask)
        tl.store(pml_ptr + row * 2 + 1, hi_i, mask=gmask)
    else:
        tl.store(po_ptr + row[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
        tl.store(pml_ptr + row * 2, m_i, mask=gmask)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _merge_kernel(po_ptr, pml_ptr, out_ptr, lse_ptr, S, so_b, so_h, sl_b,
                  D: tl.constexpr, BS: tl.constexpr, HAS_LSE: tl.constexpr, PDL: tl.constexpr):
    """Log-sum-exp merge of the S partials of row (b, hq) -> out (and lse). ``PDL``: launched as a programmatic
    dependent of the last segment kernel; waits for it (``griddepcontrol.wait``) before reading any partial."""
    if PDL:
        S = tl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [S], dtype=tl.int32,
                                      is_pure=False, pack=1)
    hq = tl.program_id(0)
    b = tl.program_id(1)
    HQ = tl.num_programs(0)
    row = b * HQ + hq
    offs_d = tl.arange(0, D)
    m_run = tl.max(tl.full([BS], -1.0e30, tl.float32), 0)
    l_run = tl.sum(tl.zeros([BS], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, S, BS):
        offs_s = s0 + tl.arange(0, BS)
        sm = offs_s < S
        ms = tl.load(pml_ptr + (row * S + offs_s) * 2, mask=sm, other=-1.0e30)
        ls = tl.load(pml_ptr + (row * S + offs_s) * 2 + 1, mask=sm, other=0.0)
        m_new = tl.maximum(m_run, tl.max(ms, 0))
        w = tl.exp2(ms - m_new)
        alpha = tl.exp2(m_run - m_new)
        tile = tl.load(po_ptr + (row * S + offs_s)[:, None] * D + offs_d[None, :], mask=sm[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * tile, 0)
        l_run = l_run * alpha + tl.sum(w * ls, 0)
        m_run = m_new
    ok = l_run > 0
    o = tl.where(ok, acc / tl.where(ok, l_run, 1.0), 0.0)
    tl.store(out_ptr + b * so_b + hq * so_h + offs_d, o.to(out_ptr.dtype.element_ty))
    if HAS_LSE:
        lse = tl.where(ok, (m_run + tl.log2(tl.where(ok, l_run, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + b * sl_b + hq, lse)


# ----------------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------------

_SEG = Launcher(_segment_kernel)
_MERGE = Launcher(_merge_kernel)
_CAPABILITY: dict = {}

_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Plan:
    """What one call launches: per segment its kind, tensors, tile and split sizes."""

    def __init__(self):
        self.items = []
        self.total = 0


def _capacity(seg) -> int:
    if isinstance(seg, DenseSeg):
        return seg.k.shape[2]
    if isinstance(seg, ChannelSeg):
        return seg.k_codes.shape[2] * per_byte(seg.bits)
    if isinstance(seg, KiviSeg):
        return seg.k_codes.shape[2] * per_byte(seg.k_bits)
    if type(seg) in LAYOUTS:
        return LAYOUTS[type(seg)].capacity(seg)
    raise TypeError(f"unknown segment type {type(seg).__name__}")


def _kv_heads(seg) -> int:
    if isinstance(seg, DenseSeg):
        return seg.k.shape[1]
    if isinstance(seg, (ChannelSeg, KiviSeg)):
        return seg.k_codes.shape[1]
    if type(seg) in LAYOUTS:
        return LAYOUTS[type(seg)].kv_heads(seg)
    raise TypeError(f"unknown segment type {type(seg).__name__}")


_GLUON_BROKEN: list = []


def _generic_channel_tiles(it, S_tokens: int):
    """(tile tokens, tiles per split) of the Triton channel kernel covering the same tokens per split."""
    per = per_byte(it["seg"].bits)
    tt = min(128, max(16, per * 8))
    return tt, max(1, S_tokens // tt)


def _capability(device: torch.device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def _gluon_ok(seg, q, G, D) -> bool:
    if _GLUON_BROKEN or not (_gc.HAVE_GLUON and q.is_cuda and os.environ.get("MMKV_NO_GLUON", "0") != "1"):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return (_capability(q.device)[0] >= 8 and G <= 8 and D in (64, 128) and seg.block >= _capacity(seg)
            and seg.k_codes.stride(-1) == 1 and seg.k_codes.stride(-2) == D
            and seg.v_codes.stride() == seg.k_codes.stride())


def _splits(n_units: int, units_per_split: int) -> int:
    return max(1, -(-n_units // max(1, units_per_split)))


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

    # ---- plan: tiles per segment, then tokens per split from the total work ------------------------------------
    items = []
    for seg in segs:
        T = _capacity(seg)
        lens = seg.lens
        if lens.device != dev or lens.dtype != torch.int32:
            lens = lens.to(device=dev, dtype=torch.int32)
        if isinstance(seg, DenseSeg):
            it = dict(kind=KIND_DENSE, seg=seg, T=T, lens=lens, tt=64 if D <= 64 else 32, gl=False)
        elif isinstance(seg, ChannelSeg):
            use_gl = _gluon_ok(seg, q, G, D) if gluon is None else (gluon and _gluon_ok(seg, q, G, D))
            per = per_byte(seg.bits)
            if use_gl:
                tt = warps * _gc.rows_per_warp(seg.bits) * per  # tokens per program iteration
            else:
                tt = min(128, max(16, per * 8))
                single = seg.block >= T or seg.k_scale.shape[2] == 1
                if not single:
                    tt = min(tt, 1 << (seg.block.bit_length() - 1))
                    if tt < 16 or tt % per:
                        raise NotImplementedError(f"channel block {seg.block} too small for the kernel")
            it = dict(kind=KIND_CHANNEL, seg=seg, T=T, lens=lens, tt=tt, gl=use_gl)
        elif isinstance(seg, KiviSeg):
            tt = text_tile
            if seg.block < 16 or seg.block & (seg.block - 1) or seg.group & (seg.group - 1):
                raise ValueError(f"KIVI block {seg.block} and group {seg.group} must be powers of two >= 16")
            it = dict(kind=KIND_KIVI, seg=seg, T=T, lens=lens, tt=tt, gl=False)
        elif type(seg) in LAYOUTS:
            it = dict(kind=KIND_PLUGIN, seg=seg, T=T, lens=lens, tt=LAYOUTS[type(seg)].tile(seg, D), gl=False)
        else:
            raise TypeError(f"unknown segment type {type(seg).__name__}")
        it["tiles"] = max(1, -(-T // it["tt"]))
        items.append(it)

    # bytes a tile moves, to balance splits across kinds (codes vs fp16)
    def tile_bytes(it):
        s = it["seg"]
        if it["kind"] == KIND_DENSE:
            return it["tt"] * D * 2 * s.k.element_size()
        if it["kind"] == KIND_CHANNEL:
            return it["tt"] * D * 2 * s.bits // 8
        if it["kind"] == KIND_PLUGIN:
            return LAYOUTS[type(s)].tile_bytes(s, it["tt"], D)
        return it["tt"] * D * (s.k_bits + s.v_bits) // 8

    total_bytes = sum(it["tiles"] * tile_bytes(it) for it in items) * B * H
    target_programs = (programs_per_sm or 4.0) * nsm
    bytes_per_prog = max(total_bytes / target_programs, 16 * 1024)
    S = 0
    for it in items:
        tps = max(1, int(bytes_per_prog // max(1, tile_bytes(it))))
        fused = it["gl"] and channel_stages in (None, 0) and _plan_fused(it, dev, B, H, D, G, warps, nsm,
                                                                         programs_per_sm, auto_warps, tile_bytes)
        if fused:
            tps, it["itm"], it["cl"] = fused
        elif it["gl"] and programs_per_sm is None:
            tps = _one_wave_tiles(it, dev, B, H, D, HQ // H, warps, channel_stages, nsm, tile_bytes(it))
        it["tps"] = min(tps, it["tiles"])
        it["nsplit"] = it.get("cl") or _splits(it["tiles"], it["tps"])  # a cluster's CTAs past the span idle
        it["s_off"] = S
        S += it["nsplit"]

    # a segment that runs as clusters goes last and its clusters merge every partial of their rows into the output
    # (no merge launch); the other segments' kernels run before it on the stream
    clustered = [it for it in items if it.get("cl")]
    fin = clustered[-1] if clustered and os.environ.get("MMKV_FIN", "1") != "0" else None
    if fin is not None:
        fin["fin"] = True
        items = [it for it in items if it is not fin] + [fin]
    part_o = torch.empty((B, HQ, S, D), dtype=torch.float32, device=dev)
    part_ml = torch.empty((B, HQ, S, 2), dtype=torch.float32, device=dev)
    dummy = part_ml
    ctx = None

    trigger = False  # did the last launched kernel let the next one start early (programmatic dependent launch)?
    # the clusters' kernel may start beside the segment kernel before it (that kernel triggers at once), and waits
    # for it only where it merges the partials: the fused kernel leaves memory bandwidth to spare (a text segment of
    # a budget batch hid behind it, docs/BENCHMARKS.md); MMKV_OVERLAP=0 launches them one after the other
    overlap = (fin is not None and len(items) > 1 and items[-2]["kind"] in (KIND_DENSE, KIND_KIVI)
               and _pdl_ok(dev) and os.environ.get("MMKV_OVERLAP", "1") != "0")
    for it in items:
        seg, kind = it["seg"], it["kind"]
        grid = (it["nsplit"], H, B)
        trigger = False
        trig = overlap and it is items[-2]
        if kind == KIND_PLUGIN:
            if ctx is None:
                ctx = LaunchContext(q, B, H, G, GP, D, HQ, S, part_o, part_ml, qk_scale, nsm)
            LAYOUTS[type(seg)].launch(ctx, it)
            continue
        if kind == KIND_DENSE:
            k = _inner_ok(seg.k, D)
            v = _inner_ok(seg.v, D)
            ieee = (k.dtype == torch.float32 or v.dtype == torch.float32 or k.dtype != v.dtype
                    or (k.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"))
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
                                       dependent=overlap and it is fin)
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
        # KIVI
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
    so = out.stride()
    # the merge starts early only after a kernel that lets it (measured: after any other it cost time); a kernel
    # triggers only where _pdl_ok holds
    pdl = bool(trigger)
    _MERGE((HQ, B), (part_o, part_ml, out, lse if return_lse else dummy, S, so[0], so[1], HQ if return_lse else 0),
           dict(D=D, BS=16, HAS_LSE=return_lse, PDL=pdl), (D, return_lse, pdl), num_warps=4,
           **({"launch_pdl": True} if pdl else {}))
    return _result(out, final, lse, return_lse)


def _result(out, final, lse, return_lse):
    if final is not None and final is not out:
        final.copy_(out)
        out = final
    if return_lse:
        return out, lse
    return out


def _one_wave_tiles(it, dev, B, H, D, G, warps, channel_stages, nsm, tile_bytes) -> int:
    """Tiles per split of a Gluon channel segment's main pass such that its programs fill one wave: the programs
    one multiprocessor holds at once (measured best on the H100; fewer leave latency unhidden, more start a second
    wave), at least 16 KB of codes per program. Before the variant is compiled, 5 per multiprocessor."""
    bits = it["seg"].bits
    st = _gc.default_stages(bits) if channel_stages is None else channel_stages  # the long-program variant
    cap = _gc.resident_programs(dev.index, D, bits, warps, st, 0, _int8_k(bits, G)) or 5
    splits = max(1, cap * nsm // (B * H))
    return max(-(-it["tiles"] // splits), -(-16384 // max(1, tile_bytes)))


def _fused_warps(pairs: int, n: int, nsm: int) -> int:
    """Warps per program of the fused kernel for ``pairs`` (row, KV head) pairs over a span of ``n`` tokens, from
    side-by-side sweeps of 2, 4, 8 and 16 warps on the H100 (docs/results/h100_warps_sweep.txt). Larger programs pay
    their fixed costs (q and scales, the (min, max) exchange, the epilogue) once per more warps, so they win wherever
    their loops stay long enough and their programs fill the waves they take:

    * n >= 8192: 16 warps (one program per pair and SM) from 0.9 x nsm pairs while up to 4 waves fill (B=16: 21.5 vs
      26.9 us at 2 warps; B=64: 76.6 vs 79.6 at 4), 4 beyond (B=139: 158.7 vs 167.3 at 16, 166.7 at 2), 8 below
      (B=8: 15.8 vs 18.3);
    * n >= 3072: 8 warps (two per SM) while up to 4 waves fill (B=16 n=3328: 11.5 vs 13.1 at 4; B=128: 65.9 vs 68.8
      at 2), else 2 (B=40: 1.21 waves, 26.0 vs 29.7 at 8; B=139: 4.21 waves, 73.2 vs 75.2);
    * n >= 16384 (a pair's logits no longer fit one SM): 2 warps from nsm / 4 to nsm pairs (B=16, n=32768: 88.9 vs
      90.8 at 4), else 4 (B=64: 325.4 vs 448.6 at 2);
    * fewer than nsm / 4 pairs: 4 warps spread further (B=4, n=3328: 10.5 vs 11.7 at 8)."""

    def fills(waves: float) -> bool:  # within one wave, or up to 4 whose last is >= 85% full
        return waves <= 1 or (waves <= 4 and waves / math.ceil(waves) >= 0.85)

    if n >= 16384:
        return 2 if nsm / 4 <= pairs <= nsm or pairs > 4 * nsm else 4
    if pairs < nsm / 4:
        return 4
    if n >= 8192:
        return 8 if pairs < 0.9 * nsm else (16 if fills(pairs / nsm) else 4)
    if n >= 3072:
        return 8 if fills(pairs / (2 * nsm)) else 2
    return 4 if pairs <= 4 * nsm else 2


def _plan_fused(it, dev, B, H, D, G, warps, nsm, pps, auto_warps, tile_bytes):
    """``_fused_plan`` at the warps ``_fused_warps`` picks (where the caller left warps and programs per SM open),
    else at ``warps``; a plan at other warps re-tiles the segment (``it["tt"]``, ``it["tiles"]``, ``it["w"]``)."""
    seg = it["seg"]
    per = per_byte(seg.bits)
    tries = [warps]
    if auto_warps:
        w = _fused_warps(B * H, it["T"], nsm)
        tries = [w] + ([warps] if w != warps else [])
    for w in tries:
        tt = w * _gc.rows_per_warp(seg.bits) * per
        trial = dict(it, tt=tt, tiles=max(1, -(-it["T"] // tt)))
        plan = _fused_plan(trial, dev, B, H, D, G, w, nsm, tile_bytes(trial), pps)
        if plan:
            it.update(tt=trial["tt"], tiles=trial["tiles"], w=w)
            return plan
    return None


def _fused_plan(it, dev, B, H, D, G, warps, nsm, tile_bytes, pps=None):
    """(tiles per split, logit slots per program, CTAs per cluster) of the fused channel kernel (``_gluon_channel``
    mode 2: K, the barrier over a (row, KV head)'s splits, then V; K is read once), or ``None`` where it does not
    apply. On sm_90 the splits of a pair are one thread block cluster (``_cluster_plan``) unless the rule below
    prefers the counter barrier; that one (cluster size 0) needs every program of the grid resident at once (one
    wave) with its logits in shared memory.
    The most programs per SM (``pps``, else what registers allow, 8 before the first compile) whose shared memory
    fits wins; below 4 per SM, and above 32 splits per (row, KV head) (batch 1 at n = 32768: 64 splits, 17.7 vs
    16.8 us two-pass on the H100; every program waits for all splits), the two-pass kernels are used.
    ``MMKV_FUSED=0`` switches it off."""
    bits = it["seg"].bits
    if os.environ.get("MMKV_FUSED", "1") == "0" or not _int8_k(bits, G):
        return None
    cap = int(pps or _gc.programs_by_registers(dev.index, D, bits, warps, 0, 2, True) or max(1, 16 // warps))
    smem = _smem_per_sm(dev)
    floor = -(-16384 // max(1, tile_bytes))
    wave = cap * nsm // (B * H)  # splits per (row, KV head) that one wave of programs holds
    # measured on the H100 at 2 warps (docs/results/h100_cluster_ablation.txt): where a wave holds 8+ splits of 8+
    # tiles each, the counter barrier over one exactly full wave is faster (B=16, n=8192: 25.1 us; clusters of 8 do
    # not all fit at once, of 4 28.5); elsewhere clusters (B=16, n=3328: 15.4 vs 16.4; B=32: 21.7 vs 24.5; B=64:
    # 42.5 vs 44.3; B=128: 69.2 vs 92.9 two-pass, where no counter plan exists)
    # the GPU co-schedules ~94% of the clusters its SMs would hold (H100: 124 of 8 CTAs, 248 of 4, 528 of 2)
    fit = int(0.93 * cap * nsm) // (B * H)
    if (_clusters_ok(dev) and not (wave >= 8 and it["tiles"] >= 8 * min(wave, 32))
            and not (fit > 16 and it["tiles"] > 64)):  # few rows of a long span: more splits than 8 pay (B=2,
        # n=32768: 23.0 us in clusters of 8, 21.9 two-pass)
        plan = _cluster_plan(it["tiles"], min(fit, _cluster_max()), floor, smem, warps, bits)
        if plan:
            return plan
    for c in range(cap, 3, -1):
        splits = max(1, c * nsm // (B * H))
        tps = min(it["tiles"], max(-(-it["tiles"] // splits), floor))
        itm = tps + tps % 2  # even: fewer compiled variants, and a whole short span still fits (B=64, n=3328: 26)
        if c * (_gc.fused_shared_bytes(itm, warps, bits) + 2048) > smem:
            continue
        nsplit = _splits(it["tiles"], tps)
        if nsplit > 32 or nsplit * B * H > c * nsm or not _int8_k(bits, G, nsplit * B * H, nsm):
            return None
        return tps, itm, 0
    return None


def _cluster_plan(tiles: int, wave_splits: int, floor: int, smem: int, warps: int, bits: int):
    """(tiles per split, logit slots, cluster size) of the fused kernel with one thread block cluster per (row, KV
    head) (sm_90): its CTAs are the splits, a hardware cluster barrier replaces the counters, and the grid may take
    several waves (each cluster is co-scheduled as a whole, so no wait can block). Splits: ``wave_splits`` (those
    that one wave holds) rounded down to a power of two in 2..8 (8: the portable cluster size; 1, one program per
    pair and no cluster, for programs of 8+ warps), fewer where a split would read under ``floor`` tiles, more where
    the logits would not fit in shared memory with 8 warps per SM. ``None`` where one wave would want more than 8
    splits (few rows: the counter barrier spreads wider)."""
    if wave_splits > 8:
        return None
    low = 1 if warps >= 8 else 2
    cl = max(low, 1 << max(0, wave_splits.bit_length() - 1))
    while cl > low and -(-tiles // cl) < floor:
        cl //= 2
    # where the logits do not fit, more CTAs per cluster; not for programs of 8+ warps, which then take several
    # waves (measured slow: B=16, n=32768 at 16 warps in clusters of 4, 114 us; two-pass 91)
    top = 8 if warps <= 4 else cl
    while cl <= top:
        tps = -(-tiles // cl)
        itm = tps + tps % 2
        if max(1, 8 // warps) * (_gc.fused_shared_bytes(itm, warps, bits) + 2048) <= smem:  # 8+ warps per SM
            return tps, itm, cl
        cl *= 2
    return None


def _cluster_max() -> int:
    return int(os.environ.get("MMKV_CLUSTER_MAX", "8"))


def _clusters_ok(dev) -> bool:
    """Thread block clusters (sm_90+, compiled kernels through ``Launcher``); ``MMKV_CLUSTER=0`` switches them off."""
    return os.environ.get("MMKV_FAST_LAUNCH", "1") != "0" and _sm90_compiled(dev, "MMKV_CLUSTER")


def _sm90_compiled(dev, switch: str) -> bool:
    """A CUDA device of sm_90+ running compiled kernels (not the interpreter), and the environment switch ``switch``
    not set to 0."""
    return (dev.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and os.environ.get(switch, "1") != "0" and _capability(dev)[0] >= 9)


def _smem_per_sm(dev) -> int:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SMEM:
        _SMEM[idx] = getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_multiprocessor", 228 * 1024)
    return _SMEM[idx]


_SMEM: dict = {}
_SYNC: dict = {}


def _sync_counters(dev, n: int) -> torch.Tensor:
    """Zeroed int32 counters for the fused kernel's barriers, one per (row, KV head). Each launch leaves them at 0,
    so one buffer per (GPU, stream) serves every call; launches on one stream never overlap (the fused kernel
    starts only after the previous kernel ended)."""
    from ._launch import _stream

    key = (dev.index, _stream())
    buf = _SYNC.get(key)
    if buf is None or buf.numel() < n:
        buf = _SYNC[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=dev)
    return buf


def _int8_k(bits: int, G: int, programs: int | None = None, nsm: int = 0) -> bool:
    """Whether the Gluon channel kernels run their K side on int8 tensor cores (q*s as 16-bit fixed point in two
    bytes, both in one m16n8k32 MMA): for 1-bit codes and up to 4 query heads per KV head, where the main pass has at
    least one program per multiprocessor (``programs``; ``None``: eligibility only). The int8 side has a longer
    prologue and per-iteration dependency chain; with fewer programs nothing hides them, and fp16 measured faster
    (docs/BENCHMARKS.md). ``MMKV_INT8_K=0`` switches it off, ``=1`` on wherever eligible."""
    mode = os.environ.get("MMKV_INT8_K", "auto")
    if mode == "0" or bits != 1 or G > 4:
        return False
    return mode == "1" or programs is None or programs >= nsm


def _pdl_ok(dev) -> bool:
    """Programmatic dependent launch (a kernel's programs start while the previous kernel ends, and wait for it
    before they read its output; used range pass -> main pass -> merge) needs sm_90+ and compiled kernels;
    ``MMKV_PDL=0`` switches it off."""
    return _sm90_compiled(dev, "MMKV_PDL")


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
