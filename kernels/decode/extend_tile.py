"""The extend path's wide case: many new query tokens over dense and KIVI/XQuant segments, on tensor cores.

The decode kernels hold a few query rows per program and dequantize every tile per program; with hundreds of new
tokens (a long second turn, chunked prefill) they re-read and re-dequantize the history once per chunk of rows.
Here instead:

* ``_tile_kernel``: flash-style attention of ``BM`` query rows of one KV head (the ``G * Tq`` rows of its query
  heads, folded as ``extend.py`` does) over a dense ``[B, H, T, D]`` span with per-row ``lens``, both products
  through ``tl.dot``; the token axis is split where rows alone do not fill the GPU.
* ``_dequant_kernel``: a KIVI/XQuant segment is dequantized a group of (row, KV head) pairs at a time
  (``code * scale + zero`` in fp32, rounded to the query's dtype) into one scratch buffer of about
  ``SCRATCH_BYTES`` that every layer and step reuses, and each group goes through the tile kernel. Dequantizing in
  the tile kernel itself was
  measured slower (H200, InternVL heads, 512 new tokens over 32k KIVI-2: 1212 us fused, 610 us for the dense tile
  kernel alone, docs/BENCHMARKS.md): every program of ``BM`` rows paid the unpacking again, where a group is
  unpacked once and its fp16 copy is written and read back at memory speed.

Output per split: normalized ``o [S, B, Hq, Tq, D]`` fp32 and ``lse2 [S, B, Hq, Tq]`` (log2 units, ``-inf`` where
the split holds no valid token of that row); :func:`merge_splits` combines splits and segments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import Launcher
from ..layouts import DenseSeg, KiviSeg, natural_values, per_byte
from .plan import _num_sms
from .registry import LN2, LOG2E
from .segment_kernel import _unpack_channels, _unpack_tokens

TILE_LAYOUTS = (DenseSeg, KiviSeg)
SCRATCH_BYTES = 256 * 2**20  # fp16 K and V of a group: 32k tokens of InternVL2.5-8B's 8 KV heads for 2 rows


@triton.jit
def _tile_kernel(q_ptr, sqb, sqh, sqt, k_ptr, v_ptr, lens_ptr, skb, skh, skt, svb, svh, svt,
                 o_ptr, l_ptr, sob, soh, sot, sos, slb, slh, sls, H, TQ, T, tps, qk_scale,
                 G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, TT: tl.constexpr, CAUSAL: tl.constexpr,
                 PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    sp = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = bh % H
    r = pid_m * BM + tl.arange(0, BM)
    rmask = r < G * TQ
    hq = h * G + r // TQ
    t_q = r % TQ
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + t_q[:, None] * sqt + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    n = tl.load(lens_ptr + b)
    start = sp * tps
    end = tl.minimum(start + tps, n)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    tok = tl.arange(0, TT)
    for t0 in range(start, end, TT):
        t = t0 + tok
        tin = t < T
        k = tl.load(k_ptr + b * skb + h * skh + t[:, None] * skt + offs_d[None, :], mask=tin[:, None], other=0.0)
        # scaled in fp32 after the product: a bf16 q would lose bits to a pre-scale
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale
        keep = (t < end)[None, :]
        if CAUSAL:  # the new tokens among themselves: token t_q sees new tokens 0..t_q
            keep = keep & (t[None, :] <= t_q[:, None])
        s = tl.where(keep, s, float("-inf"))
        # a row may have no visible token yet (causal): keep its max finite so that no -inf - -inf appears
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * svb + h * svh + t[:, None] * svt + offs_d[None, :], mask=tin[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    live = l_i > 0
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    lse2 = tl.where(live, m_i + tl.log2(tl.where(live, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + sp * sos + b * sob + hq[:, None] * soh + t_q[:, None] * sot + offs_d[None, :], o,
             mask=rmask[:, None])
    tl.store(l_ptr + sp * sls + b * slb + hq * slh + t_q, lse2, mask=rmask)


@triton.jit
def _dequant_kernel(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, ko_ptr, vo_ptr,
                    skcb, skch, ssb, ssh, ssn, sdk, svcb, svch, svsb, svsh, svst, sob, soh, b0, h0, T,
                    D: tl.constexpr, TT: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                    KBLK: tl.constexpr, GROUP: tl.constexpr):
    """Tokens ``[i * TT, +TT)`` of (row ``b0 + b``, KV head ``h0 + h``) -> rows of the buffers' ``[b, h]``."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    sb_, sh_ = b + b0, h + h0
    offs_d = tl.arange(0, D)
    t = i * TT + tl.arange(0, TT)
    tin = t < T
    PK: tl.constexpr = 8 // KBITS
    rk = i * (TT // PK) + tl.arange(0, TT // PK)
    kc = tl.load(kc_ptr + sb_ * skcb + sh_ * skch + rk[:, None] * D + offs_d[None, :],
                 mask=(rk < T // PK)[:, None], other=0)
    kc = _unpack_tokens(kc, KBITS, TT // PK, D).to(tl.float32)
    sb = sb_ * ssb + sh_ * ssh + (t // KBLK)[:, None] * ssn + offs_d[None, :] * sdk
    k = kc * tl.load(ks_ptr + sb, mask=tin[:, None], other=0.0).to(tl.float32) \
        + tl.load(kz_ptr + sb, mask=tin[:, None], other=0.0).to(tl.float32)
    PV: tl.constexpr = 8 // VBITS
    vc = tl.load(vc_ptr + sb_ * svcb + sh_ * svch + t[:, None] * (D // PV) + tl.arange(0, D // PV)[None, :],
                 mask=tin[:, None], other=0)
    vc = _unpack_channels(vc, VBITS, TT, D).to(tl.float32)
    vb = sb_ * svsb + sh_ * svsh + t[:, None] * svst + (offs_d // GROUP)[None, :]
    v = vc * tl.load(vs_ptr + vb, mask=tin[:, None], other=0.0).to(tl.float32) \
        + tl.load(vz_ptr + vb, mask=tin[:, None], other=0.0).to(tl.float32)
    row = b * sob + h * soh + t[:, None] * D + offs_d[None, :]
    tl.store(ko_ptr + row, k.to(ko_ptr.dtype.element_ty), mask=tin[:, None])
    tl.store(vo_ptr + row, v.to(vo_ptr.dtype.element_ty), mask=tin[:, None])


_TILE = Launcher(_tile_kernel)
_DEQUANT = Launcher(_dequant_kernel)
_SCRATCH: dict = {}


def _empty(shape, dtype, device) -> torch.Tensor:
    """The split buffers (every element is written by the kernel; tests fill them with NaN to check that)."""
    return torch.empty(shape, dtype=dtype, device=device)


def tile_plan(B: int, H: int, rows: int, T: int, dev, bm: int | None = None, tt: int = 64, splits: int | None = None):
    """(BM, TT, splits, tokens per split): ``BM`` rows a program (128 where a KV head has that many, else 64 or
    32; ``tl.dot`` wants 16+), and enough token splits that programs cover the GPU about twice (a program keeps
    at least 4 tiles)."""
    bm = bm or (128 if rows >= 128 else 64 if rows >= 64 else 32)
    progs = B * H * -(-rows // bm)
    tiles = max(1, -(-T // tt))
    if splits is None:
        splits = max(1, min(tiles // 4, -(-2 * _num_sms(dev) // progs)))
    tps = -(-tiles // splits) * tt
    return bm, tt, -(-tiles * tt // tps), tps


def tile_attention(q: torch.Tensor, seg: DenseSeg, sm_scale: float, bm: int | None = None, tt: int = 64,
                   splits: int | None = None, warps: int = 8, stages: int = 3, out=None, causal: bool = False):
    """``q [B, Hq, Tq, D]`` (fp16/bf16; fp32 keeps fp32 products) over one ``DenseSeg`` -> ``(o [S, B, Hq, Tq, D],
    lse2 [S, B, Hq, Tq])`` fp32 per token split (module docstring), written into ``out`` if given (views with those
    shapes; ``splits`` must then give ``S``). ``causal``: ``seg`` holds the ``Tq`` new tokens themselves, query
    token ``t`` sees tokens ``0..t``. Defaults: H200 sweep, docs/BENCHMARKS.md."""
    B, HQ, TQ, D = q.shape
    k, v = seg.k, seg.v
    H, T = k.shape[1], k.shape[2]
    G = HQ // H
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    bm, tt, S, tps = tile_plan(B, H, G * TQ, T, q.device, bm, tt, splits)
    if out is None:
        out = (_empty((S, B, HQ, TQ, D), torch.float32, q.device), _empty((S, B, HQ, TQ), torch.float32, q.device))
    o, lse2 = out
    if o.shape[0] != S:
        raise ValueError(f"out holds {o.shape[0]} splits, the plan {S}")
    lens = seg.lens.to(device=q.device, dtype=torch.int32)
    # an fp32 query (fp32 models) keeps fp32 products: TF32 would round them to 10 mantissa bits
    consts = dict(G=G, D=D, BM=bm, TT=tt, CAUSAL=causal, PREC="ieee" if q.dtype == torch.float32 else "tf32")
    _TILE((-(-(G * TQ) // bm), S, B * H),
          (q, q.stride(0), q.stride(1), q.stride(2), k, v, lens,
           k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           o, lse2, o.stride(1), o.stride(2), o.stride(3), o.stride(0), lse2.stride(1), lse2.stride(2),
           lse2.stride(0), H, TQ, T, tps, float(sm_scale) * LOG2E),
          consts, tuple(consts.values()), num_warps=warps, num_stages=stages)
    return o, lse2


def _scratch(n: int, dtype, device) -> torch.Tensor:
    key = (device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]


def kivi_attention(q: torch.Tensor, seg: KiviSeg, sm_scale: float, scratch_bytes: int | None = None,
                   tt: int = 64, **kw):
    """``q [B, Hq, Tq, D]`` over a KIVI/XQuant segment, as :func:`tile_attention` returns it: the segment is
    dequantized to ``q.dtype`` a group of (row, KV head) pairs at a time (all their tokens, so no pair's softmax
    is split across groups) into one reused buffer of about ``scratch_bytes`` (at least one pair), and each group
    goes through the tile kernel, writing its slice of the output (``None``: ``SCRATCH_BYTES``)."""
    seg = natural_values(seg)  # the dequantizing kernel reads values in natural channel order
    kc, vc = seg.k_codes.contiguous(), seg.v_codes.contiguous()
    B, H, T, D = vc.shape[0], vc.shape[1], vc.shape[2], kc.shape[3]
    HQ, TQ = q.shape[1], q.shape[2]
    G = HQ // H
    if tt % per_byte(seg.k_bits):
        raise ValueError(f"tile {tt} is not a whole number of bytes of {seg.k_bits}-bit key codes")
    ks, kz = seg.k_scale, seg.k_zero
    sdk = 0 if ks.stride(-1) == 0 and D > 1 else 1
    if sdk or ks.stride() != kz.stride():
        ks, kz, sdk = ks.contiguous(), kz.contiguous(), 1
    vs, vz = seg.v_scale.contiguous(), seg.v_zero.contiguous()
    lens = seg.lens.to(device=vc.device, dtype=torch.int32)
    pair = 2 * T * D * q.element_size()
    per = max(1, (scratch_bytes or SCRATCH_BYTES) // pair)  # (row, head) pairs a group
    groups = ([(b0, min(B, b0 + per // H), 0, H) for b0 in range(0, B, per // H)] if per >= H else
              [(b, b + 1, h0, min(H, h0 + per)) for b in range(B) for h0 in range(0, H, per)])
    # splits planned for one group's launch (not the whole batch): a group alone must fill the GPU (H200, B16,
    # 128 new tokens: planning for the batch left one split a pair and ran 1.6x slower)
    nb, nh = groups[0][1] - groups[0][0], groups[0][3] - groups[0][2]
    bm, tt, S, _ = tile_plan(nb, nh, G * TQ, T, q.device, kw.pop("bm", None), tt, kw.pop("splits", None))
    o = _empty((S, B, HQ, TQ, D), torch.float32, q.device)
    lse2 = _empty((S, B, HQ, TQ), torch.float32, q.device)
    consts = dict(D=D, TT=tt, KBITS=seg.k_bits, VBITS=seg.v_bits, KBLK=seg.block, GROUP=seg.group)
    for b0, b1, h0, h1 in groups:
        nb, nh = b1 - b0, h1 - h0
        buf = _scratch(2 * nb * nh * T * D, q.dtype, q.device).view(2, nb, nh, T, D)
        _DEQUANT((-(-T // tt), nh, nb),
                 (kc, ks, kz, vc, vs, vz, buf[0], buf[1],
                  kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), ks.stride(2), sdk,
                  vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1), vs.stride(2),
                  buf.stride(1), buf.stride(2), b0, h0, T),
                 consts, tuple(consts.values()), num_warps=4)
        hq = slice(h0 * G, h1 * G)
        tile_attention(q[b0:b1, hq], DenseSeg(buf[0], buf[1], lens[b0:b1]), sm_scale, bm=bm, tt=tt, splits=S,
                       out=(o[:, b0:b1, hq], lse2[:, b0:b1, hq]), **kw)
    return o, lse2


def merge_splits(parts: list[tuple[torch.Tensor, torch.Tensor]]):
    """Splits ``(o [S, ..., D], lse2 [S, ...])`` of one or more segments -> ``(out [..., D], lse [...])`` fp32,
    natural-log ``lse``; rows without any valid token give out 0 and lse ``-inf``."""
    o = torch.cat([p[0] for p in parts])
    l2 = torch.cat([p[1] for p in parts])
    m = l2.amax(0)
    live = torch.isfinite(m)
    w = torch.exp2(l2 - torch.where(live, m, 0.0))
    tot = w.sum(0)
    out = (w.unsqueeze(-1) * o).sum(0) / torch.where(live, tot, 1.0).unsqueeze(-1)
    lse = torch.where(live, (m + torch.log2(torch.where(live, tot, 1.0))) * LN2, float("-inf"))
    return out, lse
