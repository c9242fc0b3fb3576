"""Rotary position embedding of q and k in one launch (spec: ``reference.rotary``, transformers' Llama rule).

transformers runs ``q * cos + rotate_half(q) * sin`` (and the same for k) as ten kernels per layer: four
multiplies, two negations, two concatenations, two adds. In a decode step of InternVL2.5-8B's language model on the
H100 (CUDA-graph replay, docs/BENCHMARKS.md) those took ~34 us per layer at batch 139 and ~24 at batch 11; this
kernel takes 2.6 and 2.2 us. One program per (row, token) rotates every head of q and k. Each product and the sum
are rounded to the input dtype exactly where torch rounds them (an fp16/bf16 product of two values of that dtype
is exact in fp32, so rounding it once gives torch's value; the sum is taken in fp32 and rounded, as torch's fp16
add does; compiled, the products are ``mul.rn`` so that nothing fuses them with the add): the result is bitwise
torch's. fp16 and bf16 only (the dtypes mmkv loads on a GPU; fp32 inputs keep transformers' own function).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._launch import Launcher, on_device
from ..switches import interpreted


@triton.jit
def _mul(a, b, RN: tl.constexpr):
    # compiled, a plain product whose rounding to 16 bits is followed by an add gets fused with it (one rounding,
    # ``fma.rn.f16``: a quarter of the values 1 ulp off torch's on the H100); ``mul.rn`` is never fused
    if RN:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _rotate(x_ptr, o_ptr, sx_h, so_h, c1, c2, s1, s2, NH, HP: tl.constexpr, HALF: tl.constexpr, RN: tl.constexpr):
    offs_h = tl.arange(0, HP)[:, None]
    offs_d = tl.arange(0, HALF)[None, :]
    ok = offs_h < NH
    x1 = tl.load(x_ptr + offs_h * sx_h + offs_d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs_h * sx_h + HALF + offs_d, mask=ok, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    lo = _mul(x1, c1, RN).to(dt).to(tl.float32) + _mul(-x2, s1, RN).to(dt).to(tl.float32)
    hi = _mul(x2, c2, RN).to(dt).to(tl.float32) + _mul(x1, s2, RN).to(dt).to(tl.float32)
    tl.store(o_ptr + offs_h * so_h + offs_d, lo.to(dt), mask=ok)
    tl.store(o_ptr + offs_h * so_h + HALF + offs_d, hi.to(dt), mask=ok)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, c_ptr, s_ptr, qo_ptr, ko_ptr, T, HQ, HK,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sc_b, sc_t, sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
                   HALF: tl.constexpr, HPQ: tl.constexpr, HPK: tl.constexpr, RN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    offs_d = tl.arange(0, HALF)[None, :]
    cb = b * sc_b + t * sc_t
    c1 = tl.load(c_ptr + cb + offs_d).to(tl.float32)
    c2 = tl.load(c_ptr + cb + HALF + offs_d).to(tl.float32)
    s1 = tl.load(s_ptr + cb + offs_d).to(tl.float32)
    s2 = tl.load(s_ptr + cb + HALF + offs_d).to(tl.float32)
    _rotate(q_ptr + b * sq_b + t * sq_t, qo_ptr + b * sqo_b + t * sqo_t, sq_h, sqo_h, c1, c2, s1, s2, HQ, HPQ, HALF, RN)
    _rotate(k_ptr + b * sk_b + t * sk_t, ko_ptr + b * sko_b + t * sko_t, sk_h, sko_h, c1, c2, s1, s2, HK, HPK, HALF, RN)


_ROPE = Launcher(_rotary_kernel)
DTYPES = (torch.float16, torch.bfloat16)


def supports(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotary`` takes these inputs: fp16/bf16 ``q [B, Hq, T, D]``, ``k [B, Hk, T, D]``, ``cos``/``sin``
    ``[B or 1, T, D]`` of the same dtype, D a power of two >= 16, the last axis of each contiguous."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    B, _, T, D = q.shape
    return (q.dtype in DTYPES and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype
            and k.shape[0] == B and k.shape[2:] == (T, D) and cos.shape[0] in (1, B) and cos.shape[1:] == (T, D)
            and D >= 16 and D & (D - 1) == 0 and sin.stride() == cos.stride()
            and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           out: tuple | None = None, check: bool = True) -> tuple:
    """``reference.rotary(q, k, cos, sin)`` in one launch; ``out``: (q_out, k_out) to write into (shapes and dtype
    of q and k, last axis contiguous), else new tensors laid out like q and k. ``check=False``: the caller has
    checked ``supports`` (a few us of host time per call)."""
    if check and not supports(q, k, cos, sin):
        raise ValueError(f"rotary: unsupported q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}")
    qo, ko = out if out is not None else (torch.empty_like(q), torch.empty_like(k))
    if qo.shape != q.shape or ko.shape != k.shape or qo.dtype != q.dtype or ko.dtype != k.dtype or \
            qo.stride(-1) != 1 or ko.stride(-1) != 1:
        raise ValueError("rotary: out must match q and k in shape and dtype, last axis contiguous")
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    if B * T:
        sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
        consts = {"HALF": D // 2, "HPQ": triton.next_power_of_2(HQ), "HPK": triton.next_power_of_2(HK),
                  "RN": not interpreted()}  # the interpreter has no mul_rn
        with on_device(q):
            _ROPE((B * T,), (q, k, cos, sin, qo, ko, T, HQ, HK,
                             q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                             sc_b, cos.stride(1), qo.stride(0), qo.stride(1), qo.stride(2),
                             ko.stride(0), ko.stride(1), ko.stride(2)),
                  consts, tuple(consts.values()), num_warps=4)
    return qo, ko
