"""mmkv kernels: Triton decode attention over packed KV segments, pack/unpack, and their torch references.

``decode_attention`` runs the fused Triton kernels when ``q`` is on CUDA or ``TRITON_INTERPRET=1`` is set
(Triton's CPU interpreter, used by the tests); otherwise PyTorch's fused CPU attention per segment
(``decode/cpu.py``; ``MMKV_CPU_REFERENCE=1``: ``reference.decode_reference``), cast to ``q.dtype``.
``pack``/``unpack`` follow the same rule. Rooms: ``layouts.py`` (the segment contract),
``reference.py`` (torch math), ``decode/`` (decode attention), ``ops/`` (model ops), ``switches.py``.
"""

from __future__ import annotations

import torch

from . import decode as _decode
from . import reference
from .decode.alignedkv import aligned_decode
from .decode.cpu import decode_attention_cpu
from .decode.registry import LaunchContext, Layout, register_layout
from .layouts import ChannelSeg, DenseSeg, KiviSeg
from .ops.pack import pack, unpack
from .switches import interpreted, switch

__all__ = ["decode_attention", "pack", "unpack", "DenseSeg", "ChannelSeg", "KiviSeg", "reference", "use_triton",
           "use_cpu_path", "Layout", "LaunchContext", "register_layout", "aligned_decode"]


def use_triton(q: torch.Tensor) -> bool:
    return q.is_cuda or interpreted()


def use_cpu_path(q: torch.Tensor) -> bool:
    """``decode/cpu.py`` serves ``q``: a CPU tensor, no Triton interpreter, ``MMKV_CPU_REFERENCE`` not set."""
    return not use_triton(q) and q.device.type == "cpu" and switch("MMKV_CPU_REFERENCE") != "1"


def decode_attention(q: torch.Tensor, segments: list, sm_scale: float | None = None, return_lse: bool = False,
                     out: torch.Tensor | None = None, **kw):
    """``q [B, Hq, D]`` over ``segments`` -> ``out [B, Hq, D]`` in q.dtype (and ``lse [B, Hq]`` fp32 if asked).

    See ``kernels/decode/dispatch.py`` for the launches; on a CPU tensor without TRITON_INTERPRET=1 this is
    ``decode/cpu.py`` (the torch reference with ``MMKV_CPU_REFERENCE=1``).
    """
    if use_triton(q):
        return _decode.decode_attention(q, segments, sm_scale, return_lse=return_lse, out=out, **kw)
    if use_cpu_path(q):
        res, lse = decode_attention_cpu(q, segments, sm_scale)
    else:
        res, lse = reference.decode_reference(q, segments, sm_scale)
    res = res.to(q.dtype)
    if out is not None:
        out.copy_(res)
        res = out
    if return_lse:
        return res, lse
    return res
