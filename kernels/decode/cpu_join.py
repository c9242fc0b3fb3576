"""The CPU decode path, one row: the dense segments' tokens (sinks, window) read in the same fused call as
another segment's tokens, instead of one call each and a log-sum-exp merge (``cpu.py``).

Two ways: the dense tokens go after the last block of the longest segment read in blocks (its buffer has room for
them; :func:`join_host`), or, with only dense segments, into the longest one's capacity past its tokens, or,
short ones, all copied into one buffer (:func:`joined_dense`).
"""

from __future__ import annotations

import torch

from ..layouts import ChannelSeg, DenseSeg, KiviSeg, SkvqSeg


def longer(x: torch.Tensor, extra: int) -> torch.Tensor:
    """The first tokens of a buffer, viewed ``extra`` tokens longer (the buffer holds them)."""
    b, h, n, d = x.shape
    return x.as_strided((b, h, n + extra, d), x.stride(), x.storage_offset())


def slack(seg: DenseSeg, n: int, dtype) -> bool:
    """May a one-row dense segment's capacity past its tokens hold ``n`` tokens written by this read? Its tokens
    are masked by ``lens`` everywhere, so what lies past them is never read; it must be the compute dtype with
    dense token rows, and writable here (a tensor made under ``torch.inference_mode`` is not outside it)."""
    k, v = seg.k, seg.v
    return (k.shape[0] == 1 and k.shape[2] >= n and k.dtype == v.dtype == dtype and not k.requires_grad
            and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v))
            and (torch.is_inference_mode_enabled() or not (k.is_inference() or v.is_inference())))


def join_host(q, segments: list):
    """``(host, tails)``: for a single row, the segment whose last block also takes the tokens of the dense
    segments ``tails`` (sinks, window) into one fused call: a quantized segment read in blocks (the dense tokens
    go after its last block in the buffer), else the longest dense one (into its own capacity past its tokens).
    One call and no merge instead of two or three: SmolLM2 heads, one row, a 165-token window beside 2048
    tokens, 2 threads: KIVI-2 460 vs 621 us a layer, dense 226 vs 332 us. ``(None, [])`` where that does not
    apply (batches, no dense tokens)."""
    if q.shape[0] != 1:
        return None, []
    dense = [s for s in segments if type(s) is DenseSeg and int(s.lens[0]) > 0]
    blocked = [s for s in segments if isinstance(s, (KiviSeg, ChannelSeg, SkvqSeg))
               and getattr(s, "calib", None) is None and int(s.lens[0]) > 0]
    host = max(blocked or dense, key=lambda s: int(s.lens[0]), default=None)
    tails = [s for s in dense if s is not host]
    return (host, tails) if tails else (None, [])


def fill_tail(k, v, tails: list, qmap, unlane) -> None:
    """Write the ``tails``' tokens into the last ``sum(lens)`` tokens of ``k, v``, in the host block's channel
    positions: keys as ``qmap`` orders the query, values as ``unlane`` inverts. Copied as they are, then the tail
    permuted once: a few operations in all (each costs ~5 us of dispatch on this path)."""
    n = sum(int(s.lens[0]) for s in tails)
    t = t0 = k.shape[2] - n
    for seg in tails:
        m = int(seg.lens[0])
        k[:, :, t:t + m].copy_(seg.k[:, :, :m])
        v[:, :, t:t + m].copy_(seg.v[:, :, :m])
        t += m
    if qmap is not None:
        kt = k[:, :, t0:]
        kt.copy_(kt.gather(-1, qmap[None, :, None, :].expand(kt.shape)))
    if unlane is not None:
        vt = v[:, :, t0:]
        vmap = _inverse(unlane)
        vt.copy_(vt.index_select(-1, vmap) if vmap.dim() == 1 else vt.gather(-1, vmap[None, :, None, :].expand(vt.shape)))


_INVERSE: dict = {}


def _inverse(index: torch.Tensor) -> torch.Tensor:
    """``argsort`` of a permutation (per head where 2-D), memoized by the index tensor (held by the caches)."""
    key = id(index)
    hit = _INVERSE.get(key)
    if hit is None or hit[0] is not index:
        if len(_INVERSE) > 1024:
            _INVERSE.clear()
        hit = _INVERSE[key] = (index, torch.argsort(index, dim=-1))
    return hit[1]


JOIN_TOKENS = 1024  # a single row's dense segments up to this many tokens in all are attended as one


def joined_dense(q, segments: list, dtype, buffers):
    """``((k, v, n), rest)``: a single row's dense segments (sinks, fp16 window, fp16 store) copied into the thread's
    buffer as one of ``n`` tokens, and the other segments; ``(None, segments)`` where that does not apply. One
    fused call instead of two or three plus a merge: at a few hundred tokens the calls cost more than the copy
    (SmolLM2 heads, 161 + 96 tokens, 2 threads: 156 vs 226 us a layer; at 1900 + 96 the copy ate the gain, 470
    vs 461 us)."""
    if q.shape[0] != 1:
        return None, segments
    dense = [s for s in segments if type(s) is DenseSeg and int(s.lens[0]) > 0]
    ns = [int(s.lens[0]) for s in dense]
    if len(dense) < 2 or sum(ns) > JOIN_TOKENS:
        return None, segments
    _, h, _, d = dense[0].k.shape
    k, v = buffers((1, h, sum(ns), d))
    t = 0
    for seg, m in zip(dense, ns):
        k[:, :, t:t + m].copy_(seg.k[:, :, :m])
        v[:, :, t:t + m].copy_(seg.v[:, :, :m])
        t += m
    return (k, v, t), [s for s in segments if not any(s is x for x in dense)]
