"""Triton pack / unpack of 1, 2, 4 and 8-bit integer codes along any axis.

Bit order is the one of :func:`kernels.layouts.pack` (the spec): packing along ``dim`` with ``per = 8 // bits``
puts element ``j * per + i`` of that axis into bits ``[i * bits, (i + 1) * bits)`` of byte ``j``. The two layouts
the cache uses are special cases of it:

* ``ChannelSeg`` codes and KIVI/XQuant keys: ``[B, H, T, D]`` packed along tokens (``dim=2``);
* KIVI/XQuant values: ``[B, H, T, D]`` packed along channels (``dim=3``).

The tensor is viewed as ``[outer, n, inner]`` around ``dim`` (a free view of a contiguous tensor); one program
owns ``BLOCK`` consecutive output bytes (flat index): it reads ``per`` codes per byte and writes the byte (unpack:
the reverse, one byte read, ``per`` codes written). Codes outside ``[0, 2**bits)`` are truncated to their low ``bits``
bits (the reference only defines in-range codes).

Quantization itself (min/max, rounding) stays in torch inside each method; these kernels only move bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layouts
from .._launch import Launcher, on_device
from ..switches import interpreted

BLOCK = 1024


@triton.jit
def _pack_kernel(src_ptr, dst_ptr, total, n_out, inner, BITS: tl.constexpr, BLOCK: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index of the output byte
    valid = offs < total
    i = offs % inner
    j = (offs // inner) % n_out
    o = offs // (inner * n_out)
    src = src_ptr + (o * n_out * PER + j * PER) * inner + i
    acc = tl.zeros([BLOCK], tl.int32)
    for k in tl.static_range(PER):
        c = tl.load(src + k * inner, mask=valid, other=0).to(tl.int32)
        acc = acc | ((c & MASK) << (k * BITS))
    tl.store(dst_ptr + offs, acc.to(tl.uint8), mask=valid)


@triton.jit
def _unpack_kernel(src_ptr, dst_ptr, total, n_in, inner, BITS: tl.constexpr, BLOCK: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index of the input byte
    valid = offs < total
    i = offs % inner
    j = (offs // inner) % n_in
    o = offs // (inner * n_in)
    byte = tl.load(src_ptr + offs, mask=valid, other=0).to(tl.int32)
    dst = dst_ptr + (o * n_in * PER + j * PER) * inner + i
    for k in tl.static_range(PER):
        tl.store(dst + k * inner, ((byte >> (k * BITS)) & MASK).to(tl.uint8), mask=valid)


_PACK = Launcher(_pack_kernel)
_UNPACK = Launcher(_unpack_kernel)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreted()


def _split(shape: torch.Size, dim: int) -> tuple[int, int, int]:
    outer = 1
    for s in shape[:dim]:
        outer *= s
    inner = 1
    for s in shape[dim + 1:]:
        inner *= s
    return outer, shape[dim], inner


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along ``dim`` (size a multiple of ``8 // bits``) into uint8."""
    per = layouts.per_byte(bits)
    dim = dim % codes.dim()
    n = codes.shape[dim]
    if n % per:
        raise ValueError(f"size {n} along dim {dim} is not a multiple of {per} (bits={bits})")
    if not _use_triton(codes):
        return layouts.pack(codes, bits, dim)
    src = codes.contiguous()
    outer, _, inner = _split(src.shape, dim)
    shape = list(src.shape)
    shape[dim] = n // per
    out = torch.empty(shape, dtype=torch.uint8, device=src.device)
    total = outer * (n // per) * inner
    if total:
        with on_device(src):
            _PACK((triton.cdiv(total, BLOCK),), (src, out, total, n // per, inner), dict(BITS=bits, BLOCK=BLOCK),
                  (bits, BLOCK))
    return out


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 codes, ``8 // bits`` times longer along ``dim``."""
    per = layouts.per_byte(bits)
    dim = dim % packed.dim()
    if not _use_triton(packed):
        return layouts.unpack(packed, bits, dim)
    src = packed.contiguous()
    if src.dtype != torch.uint8:
        src = src.to(torch.uint8)
    outer, n_in, inner = _split(src.shape, dim)
    shape = list(src.shape)
    shape[dim] = n_in * per
    out = torch.empty(shape, dtype=torch.uint8, device=src.device)
    total = outer * n_in * inner
    if total:
        with on_device(src):
            _UNPACK((triton.cdiv(total, BLOCK),), (src, out, total, n_in, inner), dict(BITS=bits, BLOCK=BLOCK),
                    (bits, BLOCK))
    return out
