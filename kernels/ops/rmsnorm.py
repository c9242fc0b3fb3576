"""RMSNorm (the Llama-family norm) in one launch: transformers' ``LlamaRMSNorm`` runs it as ~8 kernels (cast, square,
mean, add, rsqrt, multiply, cast, weight); in a decode step of a 32-layer model at batch 139 on the H100 its mean
alone took 9.1 us per call, 65 calls per step (docs/results/h100_budget_step.txt), and the one-kernel norm took that
step from 13.17 to 11.61 ms (mmkv/models/norms.py swaps it in). Same arithmetic as the reference
(``kernels/reference.py::rms_norm``): fp32 mean of squares, ``rsqrt``, rounded to ``x``'s dtype, times the weight
rounded once; only the summation order differs (one fp32 tree per row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import Launcher, on_device


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, sx, sy, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * sx + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    h = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sy + offs, (w * h).to(y_ptr.dtype.element_ty), mask=ok)


_NORM = Launcher(_rms_norm_kernel)
MAX_N = 16384  # one row per program in registers: 32 fp32 values per thread at 16 warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.rms_norm(x, weight, eps)`` over the last axis, one program per row. ``x``: fp16/bf16/fp32, last
    axis of at most ``MAX_N`` (16384) values; ``weight``: ``x``'s dtype, one value per channel; ``out``: a
    contiguous tensor of ``x``'s shape and dtype to write into (else a new one)."""
    N = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (N,) or N > MAX_N:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} {weight.dtype} for x [..., {N}] {x.dtype}")
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError("rms_norm: out must be a contiguous tensor of x's shape and dtype")
    y = out.view(-1, N)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        with on_device(x):
            _NORM((x2.shape[0],), (x2, weight, y, N, x2.stride(0), y.stride(0), float(eps)), {"BLOCK": block},
                  block, num_warps=min(16, max(1, block // 512)))
    return out
