"""Several new query tokens over a layer's stored segments, read as stored (the GPU's quantized extend path).

A later chat turn, chunked prefill or scoring attends ``Tq`` new tokens to the whole stored history (no causal mask
inside it: every stored token precedes them; the new tokens among themselves are the caller's causal part). The
``Tq`` tokens of the ``G`` query heads of one KV head are ``G * Tq`` query rows of that head, exactly as GQA's
heads are, so the decode kernels serve them unchanged: ``q [B, H * G * Tq, D]`` over the segments, in chunks of at
most ``ROWS`` rows per KV head (the kernels hold a program's rows in registers). Every chunk reads the codes once,
with post-scaling and calibration per query row as in decoding; nothing dequantizes a segment to memory.

Layouts whose decode step reads less than full precision for speed (AlignedKV) or that have no kernel of their own
here (AQUA-KV's codes) keep the reference read (``extend_kernel_ok``), as the CPU path does for calibrated spans.
"""

from __future__ import annotations

import torch

from ..layouts import ChannelSeg, DenseSeg, KiviSeg
from . import dispatch
from .plan import _kv_heads

# query rows per KV head and launch: G' = G * tokens per chunk (the Triton kernels pad to a power of two). H100,
# history part alone, InternVL heads over 32k KIVI-2 tokens, 512 new tokens: 32 rows 5099 us, 64 2400, 128 2121
# (docs/BENCHMARKS.md)
ROWS = 128
_KERNEL_LAYOUTS = (DenseSeg, ChannelSeg, KiviSeg)


def extend_kernel_ok(segments: list) -> bool:
    """Do the decode kernels read every one of ``segments`` exactly as the reference does for extension?"""
    return all(isinstance(s, _KERNEL_LAYOUTS) for s in segments if s is not None)


def history_attention(q: torch.Tensor, segments: list, sm_scale: float | None = None, rows: int = ROWS, **kw):
    """``q [B, Hq, Tq, D]`` over every valid token of ``segments`` -> ``(out [B, Hq, Tq, D], lse [B, Hq, Tq])`` fp32
    (natural-log ``lse``; ``-inf`` and out 0 for rows without any stored token), as
    ``reference.attention_over_segments`` returns them. CUDA tensors or ``TRITON_INTERPRET=1``; ``kw`` go to
    ``decode_attention`` (tiles and warps of the text kernel)."""
    B, HQ, TQ, D = q.shape
    segs = [s for s in segments if s is not None]
    if not segs or TQ == 0:
        return (q.new_zeros((B, HQ, TQ, D), dtype=torch.float32),
                q.new_full((B, HQ, TQ), float("-inf"), dtype=torch.float32))
    H = _kv_heads(segs[0])
    if HQ % H:
        raise ValueError(f"{HQ} query heads is not a multiple of {H} KV heads")
    G = HQ // H
    tc = max(1, rows // G)
    outs, lses = [], []
    for t0 in range(0, TQ, tc):
        n = min(tc, TQ - t0)
        # row h * (G * n) + g * n + t of the folded query is head h * G + g, new token t0 + t
        qc = q[:, :, t0:t0 + n].reshape(B, H * G * n, D).contiguous()
        o, lse = dispatch.decode_attention(qc, segs, sm_scale, return_lse=True, **kw)
        outs.append(o.float().reshape(B, HQ, n, D))
        lses.append(lse.reshape(B, HQ, n))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
