"""``silu(gate) * up``, the gated MLP's activation, in one launch (spec: ``reference.silu_mul``).

transformers runs it as two elementwise kernels over the gate and up halves of the MLP's projections (strided views
of one output where mmkv/models/projections.py groups them): on the H100 at batch 139 (InternVL2.5-8B's language
model, CUDA-graph replay) they took 6.6 us each per layer. The arithmetic is torch's CUDA rule, operation for
operation: ``g / (1 + exp(-g))`` in fp32 (libdevice ``expf`` and an IEEE division, as nvcc compiles torch's kernel),
rounded to the input dtype, times ``up`` rounded once (``mul.rn``: not fused with anything). Under Triton's CPU
interpreter the fp32 ``exp`` is numpy's, which may differ from torch's by an ulp before the 16-bit rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._launch import Launcher, on_device
from ..switches import interpreted

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, N, sg, su, so, BLOCK: tl.constexpr, RN: tl.constexpr):
    # rows on grid axis 0 (up to 2**31 - 1): axis 1 holds at most 65535, fewer than the tokens of a batch of video
    # prompts (16 clips x 4608 tokens failed with "invalid argument" on the H100)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(g_ptr + row * sg + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + offs, mask=ok, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    if RN:
        s = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)).to(dt).to(tl.float32)
        h = libdevice.mul_rn(s, u)
    else:
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        h = s * u
    tl.store(o_ptr + row * so + offs, h.to(dt), mask=ok)


_SILU_MUL = Launcher(_silu_mul_kernel)
DTYPES = (torch.float16, torch.bfloat16)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """fp16/bf16 ``gate`` and ``up`` of one shape, last axis contiguous, rows at a constant stride."""
    if gate.shape != up.shape or gate.dtype not in DTYPES or up.dtype != gate.dtype or gate.dim() < 1:
        return False
    try:
        g2, u2 = gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])  # no copy: rows must be evenly strided
    except RuntimeError:
        return False
    return g2.stride(-1) == 1 and u2.stride(-1) == 1


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
             check: bool = True) -> torch.Tensor:
    """``reference.silu_mul(gate, up)`` -> ``out`` (a contiguous tensor of their shape and dtype) or a new one.
    ``check=False``: the caller has checked ``supports`` (a few us of host time per call)."""
    if check and not supports(gate, up):
        raise ValueError(f"silu_mul: unsupported gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} "
                         f"{up.dtype} (fp16/bf16, same shape, evenly strided rows, last axis contiguous)")
    N = gate.shape[-1]
    g2, u2 = gate.view(-1, N), up.view(-1, N)
    if out is None:
        out = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    elif out.shape != gate.shape or out.dtype != gate.dtype or not out.is_contiguous():
        raise ValueError("silu_mul: out must be a contiguous tensor of gate's shape and dtype")
    if g2.shape[0] and N:
        consts = {"BLOCK": BLOCK, "RN": not interpreted()}  # interpreter: no libdevice
        with on_device(gate):
            _SILU_MUL((g2.shape[0], triton.cdiv(N, BLOCK)),
                      (g2, u2, out.view(-1, N), N, g2.stride(0), u2.stride(0), N),
                      consts, tuple(consts.values()), num_warps=4)
    return out
