"""Decode attention over SKVQ segments (``layouts.SkvqSeg``), a plug-in layout of ``decode_attention``.

One launch per segment, grid ``(splits, H, B)``, writing split-K partials into the call's shared buffers (the
``Layout`` contract of ``registry.py``; the shared merge kernel combines them with every other segment).
A program owns one split of the token axis of one row and KV head, for all G query heads of that KV head:

* **reorder without gathering the cache** (Eq. 1): codes are stored in the head's reordered channel order. The
  program loads ``q[:, perm]`` once (the K side's ``P_k q``) and accumulates ``p @ V`` in the V side's stored
  order; the final store scatters the accumulator through ``perm_v`` (``P_v^T``). Nothing per token is gathered.
* **token-wise groups**: a tile ``[TT, D]`` of codes is unpacked in registers and dequantized with its token's
  group scale/zero, read as ``scale[t, gid[c]]`` (a gather from the ``[TT, NG]`` rows; the per-channel group id
  ``gid`` is loaded once per program). ``FIXED_K/FIXED_V > 0`` (equal-size groups) loads the ``[TT, NG]`` rows
  once and broadcasts each over its group's channels in registers, with no group ids and no gather: the
  variable-vs-fixed comparison of the issue is this switch.
  Then ``logits = (q * sm_scale) . k_hat`` and ``acc += p @ v_hat`` on tensor cores (fp16 operands, fp32 acc).
  This kernel serves 3/4/8-bit planes, CI's interpreter and whatever the Gluon kernel does not take; on sm_80+
  1/2-bit keys with 1/1.5/2-bit values take the post-scaled Gluon kernel (``gluon/skvq.py``: token-wise scales
  applied to per-group MMA results instead; ternary values through ``gluon/ternary.py``).
* 3-bit codes are two planes (2-bit low + 1-bit high, ``pack_planes``), ORed in registers.
* ternary V (``v_bits = 1.5``): byte ``j`` holds channels ``5j..5j+4``; the program decodes digit ``i`` of every
  byte as one ``[TT, NB]`` operand (``NB`` = bytes per token padded to a power of two) and keeps five
  accumulators, one per digit; digit ``i`` of byte ``j`` is stored channel ``5j + i``, scattered at the end.
* FP8 scale/zero arrive as raw bytes and are widened exactly: E4M3 bits ``s eeee mmm`` placed as the fp16 bits
  ``s 0eeee mmm0000000`` give ``value * 2**-8`` for normal and subnormal numbers alike (one shift/mask, one
  bitcast, one multiply).

Reads per token and head: ``D*(k_bits+v_bits)/8`` code bytes + ``4 * NG`` scale/zero values; writes one partial
per (row, query head, split).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import Launcher
from ..layouts import TERNARY, SkvqSeg
from .gluon.skvq import gluon_tile, launch_skvq
from .gluon.skvq_ok import launch_key, resident, seg_warps
from .plan import skvq_gluon_ok
from .registry import Layout, register_layout
from .skvq_rules import skvq_pdl, skvq_split, skvq_waves
from .states import online_step, split_rows

TILE = 32


@triton.jit
def _widen(x, FP8: tl.constexpr):
    """Stored scale/zero -> fp32; FP8 arrives as raw E4M3 bytes (exact widening, see the module doc)."""
    if FP8:
        raw = x.to(tl.int16)
        h = ((raw & 0x7F) << 7) | ((raw & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return x.to(tl.float32)


@triton.jit
def _load_sz(ptr, offs_t, tm, gid, NG: tl.constexpr, FP8: tl.constexpr, GS: tl.constexpr, TT: tl.constexpr,
             D: tl.constexpr):
    """Scale or zero of each (token, channel) ``[TT, D]`` fp32. Variable groups (``GS == 0``): gathered through
    the channels' group ids. Equal groups of ``GS`` channels: the ``[TT, NG]`` rows are loaded once and
    broadcast over each group's channels in registers (no gather)."""
    if GS > 0:
        x = tl.load(ptr + offs_t[:, None] * NG + tl.arange(0, NG)[None, :], mask=tm[:, None], other=0)
        x = _widen(x, FP8)
        return tl.reshape(tl.broadcast_to(x[:, :, None], (TT, NG, GS)), (TT, D))
    return _widen(tl.load(ptr + offs_t[:, None] * NG + gid[None, :], mask=tm[:, None], other=0), FP8)


@triton.jit
def _unpack_plane(ptr, offs_t, tm, BITS: tl.constexpr, TT: tl.constexpr, D: tl.constexpr):
    """uint8 ``[TT, D // PER]`` packed along channels (rows of ``D // PER`` bytes) -> int32 codes ``[TT, D]``."""
    PER: tl.constexpr = 8 // BITS
    DB: tl.constexpr = D // PER
    x = tl.load(ptr + offs_t[:, None] * DB + tl.arange(0, DB)[None, :], mask=tm[:, None], other=0)
    sh = (tl.arange(0, PER) * BITS)[None, None, :]
    c = (x.to(tl.int32)[:, :, None] >> sh) & ((1 << BITS) - 1)
    return tl.reshape(c, (TT, D))


@triton.jit
def _codes(lo_ptr, hi_ptr, offs_t, tm, BITS: tl.constexpr, TT: tl.constexpr, D: tl.constexpr):
    if BITS == 3:
        return _unpack_plane(lo_ptr, offs_t, tm, 2, TT, D) | (_unpack_plane(hi_ptr, offs_t, tm, 1, TT, D) << 2)
    return _unpack_plane(lo_ptr, offs_t, tm, BITS, TT, D)


@triton.jit
def _logits(q16, kc_base, kh_base, ks_base, kz_base, offs_t, tm, gk, KBITS: tl.constexpr, NG: tl.constexpr,
            FP8: tl.constexpr, FIXED_K: tl.constexpr, TT: tl.constexpr, D: tl.constexpr):
    """Logits ``[GP, TT]`` of a tile: its K codes dequantized in registers, one fp16 dot with the scaled query."""
    ck = _codes(kc_base, kh_base, offs_t, tm, KBITS, TT, D).to(tl.float32)
    kdq = (ck * _load_sz(ks_base, offs_t, tm, gk, NG, FP8, FIXED_K, TT, D)
           + _load_sz(kz_base, offs_t, tm, gk, NG, FP8, FIXED_K, TT, D))
    return tl.dot(q16, tl.trans(kdq.to(tl.float16)))


@triton.jit
def _ternary_plane(x, sv_ptr, zv_ptr, offs_t, tm, gv_ptr, offs_j, I: tl.constexpr, DIV: tl.constexpr,
                   NG: tl.constexpr, D: tl.constexpr, FIXED_V: tl.constexpr, FP8: tl.constexpr):
    """Digit ``I`` of every ternary byte ``x [TT, NB]``, dequantized: stored channels ``5j + I``, fp16."""
    c = offs_j * 5 + I
    cm = c < D
    if FIXED_V > 0:
        g = c // FIXED_V
    else:
        g = tl.load(gv_ptr + c, mask=cm, other=0).to(tl.int32)
    g = tl.where(cm, g, 0)
    digit = ((x // DIV) % 3).to(tl.float32)
    s = _widen(tl.load(sv_ptr + offs_t[:, None] * NG + g[None, :], mask=tm[:, None], other=0), FP8)
    z = _widen(tl.load(zv_ptr + offs_t[:, None] * NG + g[None, :], mask=tm[:, None], other=0), FP8)
    return tl.where(cm[None, :], digit * s + z, 0.0).to(tl.float16)


@triton.jit
def _store_plane(po_ptr, row, acc, offs_j, gmask, pv_ptr, I: tl.constexpr, D: tl.constexpr, VPERM: tl.constexpr):
    c = offs_j * 5 + I
    cm = c < D
    if VPERM:
        dst = tl.load(pv_ptr + c, mask=cm, other=0).to(tl.int32)
    else:
        dst = c
    tl.store(po_ptr + row[:, None] * D + dst[None, :], acc, mask=gmask[:, None] & cm[None, :])


@triton.jit
def _skvq_kernel(
    q_ptr, sq_b, sq_h,
    kc_ptr, kh_ptr, ks_ptr, kz_ptr, vc_ptr, vh_ptr, vs_ptr, vz_ptr,
    pk_ptr, gk_ptr, pv_ptr, gv_ptr, lens_ptr,
    kc_b, kc_h, kh_b, kh_h, ks_b, ks_h, vc_b, vc_h, vh_b, vh_h, vs_b, vs_h,
    T, TPS, po_ptr, pml_ptr, HQ, S_total, s_off, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, NG: tl.constexpr,
    KBITS: tl.constexpr, VBITS: tl.constexpr, TERN: tl.constexpr, NB: tl.constexpr,
    FIXED_K: tl.constexpr, FIXED_V: tl.constexpr, KPERM: tl.constexpr, VPERM: tl.constexpr,
    FP8: tl.constexpr, TT: tl.constexpr,
):
    """One split of one SKVQ segment for KV head ``h`` of row ``b``. Row strides of codes (``D*bits/8`` or
    ``NB_real`` bytes) and of scale/zero (``NG``) are compact; batch and head strides are given."""
    sp, h, b, offs_g, offs_d, gmask, hq = split_rows(G, GP, D)
    if KPERM:
        qcol = tl.load(pk_ptr + h * D + offs_d).to(tl.int32)
    else:
        qcol = offs_d
    q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + qcol[None, :], mask=gmask[:, None], other=0.0)
    q16 = (q.to(tl.float32) * qk_scale).to(tl.float16)
    if FIXED_K > 0:
        gk = offs_d // FIXED_K
    else:
        gk = tl.load(gk_ptr + h * D + offs_d).to(tl.int32)

    L = tl.minimum(tl.load(lens_ptr + b), T)
    t_lo = sp * TPS * TT
    t_hi = tl.minimum(t_lo + TPS * TT, L)
    kc_base = kc_ptr + b * kc_b + h * kc_h
    kh_base = kh_ptr + b * kh_b + h * kh_h
    ks_base = ks_ptr + b * ks_b + h * ks_h
    kz_base = kz_ptr + b * ks_b + h * ks_h
    vc_base = vc_ptr + b * vc_b + h * vc_h
    vh_base = vh_ptr + b * vh_b + h * vh_h
    vs_base = vs_ptr + b * vs_b + h * vs_h
    vz_base = vz_ptr + b * vs_b + h * vs_h
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    row = (b * HQ + hq) * S_total + s_off + sp

    if TERN:
        NBR: tl.constexpr = (D + 4) // 5  # real bytes per token
        offs_j = tl.arange(0, NB)
        a0 = tl.zeros([GP, NB], tl.float32)
        a1 = tl.zeros([GP, NB], tl.float32)
        a2 = tl.zeros([GP, NB], tl.float32)
        a3 = tl.zeros([GP, NB], tl.float32)
        a4 = tl.zeros([GP, NB], tl.float32)
        gv_base = gv_ptr + h * D
        for t0 in range(t_lo, t_hi, TT):
            offs_t = t0 + tl.arange(0, TT)
            tm = offs_t < t_hi
            s = _logits(q16, kc_base, kh_base, ks_base, kz_base, offs_t, tm, gk, KBITS, NG, FP8, FIXED_K, TT, D)
            m_i, l_i, p, alpha = online_step(m_i, l_i, tl.where(tm[None, :], s, float("-inf")))
            p16 = p.to(tl.float16)
            x = tl.load(vc_base + offs_t[:, None] * NBR + offs_j[None, :],
                        mask=tm[:, None] & (offs_j < NBR)[None, :], other=0).to(tl.int32)
            a0 = a0 * alpha[:, None] + tl.dot(p16, _ternary_plane(x, vs_base, vz_base, offs_t, tm, gv_base, offs_j,
                                                                  0, 1, NG, D, FIXED_V, FP8))
            a1 = a1 * alpha[:, None] + tl.dot(p16, _ternary_plane(x, vs_base, vz_base, offs_t, tm, gv_base, offs_j,
                                                                  1, 3, NG, D, FIXED_V, FP8))
            a2 = a2 * alpha[:, None] + tl.dot(p16, _ternary_plane(x, vs_base, vz_base, offs_t, tm, gv_base, offs_j,
                                                                  2, 9, NG, D, FIXED_V, FP8))
            a3 = a3 * alpha[:, None] + tl.dot(p16, _ternary_plane(x, vs_base, vz_base, offs_t, tm, gv_base, offs_j,
                                                                  3, 27, NG, D, FIXED_V, FP8))
            a4 = a4 * alpha[:, None] + tl.dot(p16, _ternary_plane(x, vs_base, vz_base, offs_t, tm, gv_base, offs_j,
                                                                  4, 81, NG, D, FIXED_V, FP8))
        pv_base = pv_ptr + h * D
        _store_plane(po_ptr, row, a0, offs_j, gmask, pv_base, 0, D, VPERM)
        _store_plane(po_ptr, row, a1, offs_j, gmask, pv_base, 1, D, VPERM)
        _store_plane(po_ptr, row, a2, offs_j, gmask, pv_base, 2, D, VPERM)
        _store_plane(po_ptr, row, a3, offs_j, gmask, pv_base, 3, D, VPERM)
        _store_plane(po_ptr, row, a4, offs_j, gmask, pv_base, 4, D, VPERM)
    else:
        if FIXED_V > 0:
            gv = offs_d // FIXED_V
        else:
            gv = tl.load(gv_ptr + h * D + offs_d).to(tl.int32)
        acc = tl.zeros([GP, D], tl.float32)
        for t0 in range(t_lo, t_hi, TT):
            offs_t = t0 + tl.arange(0, TT)
            tm = offs_t < t_hi
            s = _logits(q16, kc_base, kh_base, ks_base, kz_base, offs_t, tm, gk, KBITS, NG, FP8, FIXED_K, TT, D)
            m_i, l_i, p, alpha = online_step(m_i, l_i, tl.where(tm[None, :], s, float("-inf")))
            cv = _codes(vc_base, vh_base, offs_t, tm, VBITS, TT, D).to(tl.float32)
            vdq = (cv * _load_sz(vs_base, offs_t, tm, gv, NG, FP8, FIXED_V, TT, D)
                   + _load_sz(vz_base, offs_t, tm, gv, NG, FP8, FIXED_V, TT, D))
            vdq = tl.where(tm[:, None], vdq, 0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vdq.to(tl.float16))
        if VPERM:
            ocol = tl.load(pv_ptr + h * D + offs_d).to(tl.int32)
        else:
            ocol = offs_d
        tl.store(po_ptr + row[:, None] * D + ocol[None, :], acc, mask=gmask[:, None])
    tl.store(pml_ptr + row * 2, m_i, mask=gmask)
    tl.store(pml_ptr + row * 2 + 1, l_i, mask=gmask)


_KERNEL = Launcher(_skvq_kernel)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _compact(t: torch.Tensor | None) -> torch.Tensor | None:
    """Token rows must be compact (row stride = row size); batch/head strides may be anything."""
    if t is None:
        return None
    if t.stride(-1) == 1 and (t.shape[2] <= 1 or t.stride(2) == t.shape[3]):
        return t
    return t.contiguous()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _capacity(seg: SkvqSeg) -> int:
    return seg.k_codes.shape[2]


def _tile_bytes(seg: SkvqSeg, tt: int, d: int) -> int:
    vb = -(-d // 5) * 8 if seg.v_bits == TERNARY else d * int(seg.v_bits)
    ng = seg.k_scale.shape[3]
    return tt * ((d * seg.k_bits + vb) // 8 + 4 * ng * seg.k_scale.element_size())


def _tile(seg: SkvqSeg, d: int) -> int:
    """Tokens per program iteration: the Gluon kernel's where it may read the segment (any G; ``launch`` checks G
    and falls back to the Triton kernel over the same split boundaries), else ``TILE``."""
    return gluon_tile(seg_warps(seg, d)) if skvq_gluon_ok(seg, seg.k_codes.device, 1, d) else TILE


def _wave_tiles(seg: SkvqSeg, it, B: int, H: int, G: int, D: int, nsm: int) -> int:
    """Tiles per split of the Gluon kernel such that its ``B * H * splits`` programs fit whole waves: as many splits
    per (row, KV head) as ``skvq_rules.skvq_waves`` waves of resident programs hold (at least one; 0 waves: the byte
    rule). The byte rule rounds tiles per split down, which at B16 H8 n32768 gave 5 splits, 640 programs for 528
    slots (1.21 waves; ncu)."""
    if it["tt"] == TILE:
        return 0
    dev = seg.k_codes.device
    per_sm = resident(dev.index if dev.index is not None else 0, launch_key(seg, G, D))
    waves = skvq_waves(B, H, per_sm, nsm, it["T"], D)
    if not waves:
        return 0
    splits = max(1, waves * per_sm * nsm // (B * H))
    return -(-it["tiles"] // splits)


def _split(seg: SkvqSeg, it, B: int, H: int, D: int, tps: int) -> tuple[int, int]:
    """(tiles per split, where the Gluon kernel lets the merge launch start): ``skvq_rules``."""
    gl = it["tt"] != TILE
    return skvq_split(it, B, H, tps, D, gl), skvq_pdl(B, H, it["T"], D) if gl else 0


def launch(ctx, it) -> None:
    seg: SkvqSeg = it["seg"]
    q, D = ctx.q, ctx.D
    tps = it["tps"]
    if it["tt"] != TILE:  # planned for the Gluon kernel
        if skvq_gluon_ok(seg, q.device, ctx.G, D):
            launch_gluon(ctx, it, seg)
            return
        tps = tps * it["tt"] // TILE  # the same splits in Triton tiles
    it["pdl"] = 0  # the Triton kernel does not let the merge launch start early
    kc, kh, vc, vh = (_compact(seg.k_codes), _compact(seg.k_hi), _compact(seg.v_codes), _compact(seg.v_hi))
    ks, kz, vs, vz = (_compact(seg.k_scale), _compact(seg.k_zero), _compact(seg.v_scale), _compact(seg.v_zero))
    if ks.stride() != kz.stride():
        ks, kz = ks.contiguous(), kz.contiguous()
    if vs.stride() != vz.stride():
        vs, vz = vs.contiguous(), vz.contiguous()
    fp8 = ks.dtype == torch.float8_e4m3fn
    if (vs.dtype == torch.float8_e4m3fn) != fp8:
        raise ValueError("skvq: K and V scales must both be FP8 or both not")
    ks, kz, vs, vz = _raw(ks), _raw(kz), _raw(vs), _raw(vz)
    tern = seg.v_bits == TERNARY
    khp = kh if kh is not None else kc
    vhp = vh if vh is not None else vc
    dev = q.device
    pk = seg.k_perm.to(dev).contiguous() if seg.k_perm is not None else kc
    pv = seg.v_perm.to(dev).contiguous() if seg.v_perm is not None else kc
    gk = seg.k_gid.to(dev).contiguous()
    gv = seg.v_gid.to(dev).contiguous()
    consts = dict(G=ctx.G, GP=ctx.GP, D=D, NG=ks.shape[3], KBITS=seg.k_bits, VBITS=0 if tern else int(seg.v_bits),
                  TERN=tern, NB=max(16, _pow2(-(-D // 5))), FIXED_K=seg.k_group, FIXED_V=seg.v_group,
                  KPERM=seg.k_perm is not None, VPERM=seg.v_perm is not None, FP8=fp8, TT=TILE)
    _KERNEL((it["nsplit"], ctx.H, ctx.B),
            (q, q.stride(0), q.stride(1),
             kc, khp, ks, kz, vc, vhp, vs, vz, pk, gk, pv, gv, it["lens"],
             kc.stride(0), kc.stride(1), khp.stride(0), khp.stride(1), ks.stride(0), ks.stride(1),
             vc.stride(0), vc.stride(1), vhp.stride(0), vhp.stride(1), vs.stride(0), vs.stride(1),
             it["T"], tps, ctx.part_o, ctx.part_ml, ctx.HQ, ctx.S, it["s_off"], ctx.qk_scale),
            consts, tuple(consts.values()), num_warps=4)


def launch_gluon(ctx, it, seg: SkvqSeg) -> None:
    ks, kz, vs, vz = seg.k_scale, seg.k_zero, seg.v_scale, seg.v_zero
    fp8 = ks.dtype == torch.float8_e4m3fn
    if (vs.dtype == torch.float8_e4m3fn) != fp8:
        raise ValueError("skvq: K and V scales must both be FP8 or both not")
    launch_skvq(ctx, it, seg, _raw(ks), _raw(kz), _raw(vs), _raw(vz), fp8)


register_layout(SkvqSeg, Layout(capacity=_capacity, kv_heads=lambda s: s.k_codes.shape[1],
                                tile=_tile, tile_bytes=_tile_bytes, launch=launch,
                                wave_tiles=_wave_tiles, split=_split, dependent=True))
