"""Several new query tokens over a layer's stored segments, read as stored (the GPU's quantized extend path).

A later chat turn, chunked prefill or scoring attends ``Tq`` new tokens to the whole stored history (no causal mask
inside it: every stored token precedes them; the new tokens among themselves are the caller's causal part). The
``Tq`` tokens of the ``G`` query heads of one KV head are ``G * Tq`` query rows of that head, exactly as GQA's
heads are, so the decode kernels serve them unchanged: ``q [B, H * G * Tq, D]`` over the segments, in chunks of at
most ``ROWS`` rows per KV head (the kernels hold a program's rows in registers). Every chunk reads the codes once,
with post-scaling and calibration per query row as in decoding; nothing dequantizes a segment to memory.

From ``TILE_ROWS`` query rows per KV head on (``_use_tile``), dense and KIVI/XQuant segments go through the
flash-style tile kernel of ``extend_tile.py`` instead (KIVI codes dequantized once per call into a bounded, reused
scratch buffer, both products on tensor cores); ``ChannelSeg`` keeps the decode kernels, and the results merge by
log-sum-exp. ``extend_attention`` adds the new tokens' causal part (the tile kernel, ``causal=True``).

Layouts whose decode step reads less than full precision for speed (AlignedKV) or that have no kernel of their own
here (AQUA-KV's codes) keep the reference read (``extend_kernel_ok``), as the CPU path does for calibrated spans.
"""

from __future__ import annotations

import torch

from .._launch import on_device
from ..layouts import ChannelSeg, DenseSeg, KiviSeg
from . import dispatch
from .extend_tile import TILE_LAYOUTS, kivi_attention, merge_splits, tile_attention
from .plan import _kv_heads
from .registry import LOG2E

# query rows per KV head and launch: G' = G * tokens per chunk (the Triton kernels pad to a power of two). H100,
# history part alone, InternVL heads over 32k KIVI-2 tokens, 512 new tokens: 32 rows 5099 us, 64 2400, 128 2121
# (docs/BENCHMARKS.md)
ROWS = 128
_KERNEL_LAYOUTS = (DenseSeg, ChannelSeg, KiviSeg)
# query rows per KV head (G * new tokens) from which the tile kernel reads dense and KIVI segments; twice that where
# the batch's (row, KV head) pairs alone fill the GPU. H100, InternVL heads over 32k KIVI-2 (docs/BENCHMARKS.md):
# B1 64 tokens (256 rows) tile 281 us, folded 330; B16 64 tokens folded 2836, tile 3472; B16 128 tile 4679, folded 5598
TILE_ROWS = 256


def _use_tile(B: int, H: int, rows: int, tile: bool | None) -> bool:
    if tile is not None:
        return tile
    return rows >= TILE_ROWS * (2 if B * H >= 64 else 1)


def extend_kernel_ok(segments: list) -> bool:
    """Do the decode kernels read every one of ``segments`` exactly as the reference does for extension?"""
    return all(isinstance(s, _KERNEL_LAYOUTS) for s in segments if s is not None)


def history_attention(q: torch.Tensor, segments: list, sm_scale: float | None = None, rows: int = ROWS,
                      tile: bool | None = None, **kw):
    """``q [B, Hq, Tq, D]`` over every valid token of ``segments`` -> ``(out [B, Hq, Tq, D], lse [B, Hq, Tq])`` fp32
    (natural-log ``lse``; ``-inf`` and out 0 for rows without any stored token), as
    ``reference.attention_over_segments`` returns them. CUDA tensors or ``TRITON_INTERPRET=1``; ``kw`` go to
    ``decode_attention`` (tiles and warps of the text kernel). ``tile``: read dense and KIVI segments with the tile
    kernel (``None``: from ``TILE_ROWS`` rows per KV head on, twice that from 64 (row, KV head) pairs)."""
    B, HQ, TQ, D = q.shape
    segs = [s for s in segments if s is not None]
    if not segs or TQ == 0:
        return (q.new_zeros((B, HQ, TQ, D), dtype=torch.float32),
                q.new_full((B, HQ, TQ), float("-inf"), dtype=torch.float32))
    H = _kv_heads(segs[0])
    if HQ % H:
        raise ValueError(f"{HQ} query heads is not a multiple of {H} KV heads")
    G = HQ // H
    if _use_tile(B, H, G * TQ, tile):
        scale = 1.0 / D ** 0.5 if sm_scale is None else sm_scale
        with on_device(q):
            return merge_splits(_tiled(q, segs, scale, sm_scale, G, dict(kw, rows=rows)))
    return _folded(q, segs, sm_scale, rows, H, G, kw)


def extend_attention(q: torch.Tensor, segments: list, k_new: torch.Tensor, v_new: torch.Tensor,
                     sm_scale: float | None = None, tile: bool | None = None, **kw) -> torch.Tensor:
    """The new tokens ``q [B, Hq, Tq, D]`` over the stored ``segments`` and, causally, over their own keys and
    values ``k_new, v_new [B, H, Tq, D]`` -> ``out [B, Hq, Tq, D]`` fp32: :func:`history_attention` plus the new
    tokens' part through the tile kernel, merged once."""
    with on_device(q):  # a layer of a sharded model: launch on its GPU (docs/MULTIGPU.md)
        return _extend(q, segments, k_new, v_new, sm_scale, tile, kw)


def _extend(q, segments, k_new, v_new, sm_scale, tile, kw):
    B, HQ, TQ, D = q.shape
    scale = 1.0 / D ** 0.5 if sm_scale is None else sm_scale
    lens = torch.full((B,), TQ, dtype=torch.int32, device=q.device)
    own = tile_attention(q, DenseSeg(k_new, v_new, lens), scale, causal=True)
    segs = [s for s in segments if s is not None]
    if not segs:
        return merge_splits([own])[0]
    H = _kv_heads(segs[0])
    G = HQ // H
    if _use_tile(B, H, G * TQ, tile):
        return merge_splits([*_tiled(q, segs, scale, sm_scale, G, kw), own])[0]
    o, lse = history_attention(q, segs, sm_scale, tile=False, **kw)
    return merge_splits([(o.unsqueeze(0), (lse * LOG2E).unsqueeze(0)), own])[0]


def _tiled(q, segs, scale, sm_scale, G, kw):
    """Split partials of every segment: dense and KIVI ones through the tile kernel, the rest folded."""
    parts = [(tile_attention if isinstance(s, DenseSeg) else kivi_attention)(q, s, scale)
             for s in segs if isinstance(s, TILE_LAYOUTS)]
    rest = [s for s in segs if not isinstance(s, TILE_LAYOUTS)]
    if rest:
        o, lse = _folded(q, rest, sm_scale, kw.pop("rows", ROWS), _kv_heads(rest[0]), G, kw)
        parts.append((o.unsqueeze(0), (lse * LOG2E).unsqueeze(0)))
    return parts


def _folded(q, segs, sm_scale, rows, H, G, kw):
    """The decode kernels over ``segs``, query tokens folded into rows, ``rows`` rows per KV head a launch."""
    B, HQ, TQ, D = q.shape
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
