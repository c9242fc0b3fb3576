"""mmkv kernels: Triton decode attention over packed KV segments, pack/unpack, and their torch references.

``decode_attention`` runs the fused Triton kernels when ``q`` is on CUDA or ``TRITON_INTERPRET=1`` is set
(Triton's CPU interpreter, used by the tests); otherwise it falls back to ``reference.decode_attention_ref``
(cast to ``q.dtype``). ``pack``/``unpack`` follow the same rule.
"""

from __future__ import annotations

import os

import torch

from . import decode_attention as _decode_mod  # the package attribute is rebound to the function below
from . import reference
from .alignedkv_attention import aligned_decode  # importing it registers the AlignedKV bit-plane layout
from .pack import pack, unpack
from .reference import ChannelSeg, DenseSeg, KiviSeg

# New segment layouts (their own modules) plug into decode_attention through these.
Layout, LaunchContext, register_layout = _decode_mod.Layout, _decode_mod.LaunchContext, _decode_mod.register_layout

__all__ = ["decode_attention", "pack", "unpack", "DenseSeg", "ChannelSeg", "KiviSeg", "reference", "use_triton",
           "Layout", "LaunchContext", "register_layout", "aligned_decode"]


def use_triton(q: torch.Tensor) -> bool:
    return q.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def decode_attention(q: torch.Tensor, segments: list, sm_scale: float | None = None, return_lse: bool = False,
                     out: torch.Tensor | None = None, **kw):
    """``q [B, Hq, D]`` over ``segments`` -> ``out [B, Hq, D]`` in q.dtype (and ``lse [B, Hq]`` fp32 if asked).

    See ``kernels/decode_attention.py`` for the launches; on a CPU tensor without TRITON_INTERPRET=1 this is the
    torch reference.
    """
    if use_triton(q):
        return _decode_mod.decode_attention(q, segments, sm_scale, return_lse=return_lse, out=out, **kw)
    res, lse = reference.decode_reference(q, segments, sm_scale)
    res = res.to(q.dtype)
    if out is not None:
        out.copy_(res)
        res = out
    if return_lse:
        return res, lse
    return res
