"""Rows in and out of a running cache: what continuous batching needs (mmkv/batching/).

``merge_rows(cache, other)`` appends the rows of ``other`` (requests prefilled alone with the same spec) after the
rows of ``cache``; ``keep_rows(cache, rows)`` keeps a subset (finished or cancelled requests leave). Both work on
any layout through its ``token_fields()`` (kernels/layouts.py): every segment holds per-row ``lens``, so rows of
different lengths sit in one segment, padded to the longest. A row's tokens, codes, scales and per-row state
are copied, never requantized, so a row decodes in a batch exactly as it would alone.

Rows pad to the longest row of each segment (the ``[B, H, T, ...]`` layouts): held bytes (``nbytes()``) can
exceed the rows' sum, used bytes (``nbytes(used=True)``) are exactly the sum. A visual segment one side lacks
(a text-only request next to one with an image) gets empty rows (``lens`` 0) there. Stride-0 axes (CalibQuant's
``value_axis=global`` scales) stay stride 0.
"""

from __future__ import annotations

import dataclasses

import torch

from . import segments as S


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its broadcast axes (stride 0, size > 1) other than rows and tokens: the memory it holds."""
    idx = tuple(slice(0, 1) if (d > 2 and s == 0 and n > 1) else slice(None)
                for d, (n, s) in enumerate(zip(t.shape, t.stride())))
    return t[idx]


def _expand_like(base: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    shape = [base.shape[d] if d <= 2 else like.shape[d] for d in range(like.dim())]
    return base.expand(*shape)


def _fixed(seg) -> dict:
    """The segment's non-tensor fields (bits, blocks, calibration): rows of one segment must agree on them."""
    skip = {n for n, _ in S.token_fields(seg)} | {"lens"} | set(getattr(seg, "layer_fields", lambda: [])())
    return {f.name: getattr(seg, f.name) for f in dataclasses.fields(seg) if f.name not in skip}


def _single_block(seg) -> bool:
    """A ChannelSeg quantized as one block per row (CalibQuant ``block=0``): its block is the span it covers."""
    return hasattr(seg, "block") and all(getattr(seg, n).shape[2] == 1 for n, per in S.token_fields(seg)
                                         if per == seg.block)


def cat_plan(segs: list, example) -> tuple[int, dict]:
    """The token capacity a segment holding the rows of ``segs`` gets, and the fields ``example`` changes for it
    (``block`` of one-block-per-row segments); ValueError where the rows cannot share a segment. ``cat_rows``
    builds that segment; the scheduler's byte accounting (mmkv/batching/held.py) sizes it before it exists."""
    fixed = _fixed(example)
    single = "block" in fixed and all(_single_block(s) for s in segs)
    for s in segs:
        if type(s) is not type(example):
            raise ValueError(f"cannot put {type(s).__name__} rows into a {type(example).__name__} segment")
        other = _fixed(s)
        if single:  # one block per row: the block only says how far that row's span reaches
            other["block"] = fixed["block"]
        if other != fixed:
            raise ValueError(f"{type(s).__name__} rows of different configurations cannot share a segment: "
                             f"{other} vs {fixed}")
    cap = max(S.capacity(s) for s in segs)
    extra = {}
    if single:
        cap = max([cap] + [s.block for s in segs])
        extra["block"] = cap
    return cap, extra


def cat_rows(parts: list[tuple[object | None, int]], example):
    """One segment holding the rows of ``parts`` in order: ``(segment, rows)``, or ``(None, rows)`` for that many
    empty rows. ``example`` is any of the segments (the layout, dtypes and per-row shapes)."""
    cap, extra = cat_plan([s for s, _ in parts if s is not None], example)
    updates = {}
    for name, per in S.token_fields(dataclasses.replace(example, **extra)):
        like = getattr(example, name)
        base = _compact(like)
        rows = -(-cap // per)
        pieces = []
        for s, n in parts:
            t = torch.zeros(n, base.shape[1], rows, *base.shape[3:], dtype=base.dtype, device=base.device)
            if s is not None:
                src = _compact(getattr(s, name))
                t[:, :, : src.shape[2]] = src
            pieces.append(t)
        updates[name] = _expand_like(torch.cat(pieces), like)
    lens = torch.cat([s.lens.to(torch.int32) if s is not None else
                      torch.zeros(n, dtype=torch.int32, device=example.lens.device) for s, n in parts])
    return dataclasses.replace(example, lens=lens, **updates, **extra)


def take_rows(seg, rows: torch.Tensor):
    """The segment restricted to ``rows`` (a LongTensor of row indices, in the order given)."""
    updates = {}
    for name, _ in S.token_fields(seg):
        like = getattr(seg, name)
        updates[name] = _expand_like(_compact(like).index_select(0, rows.to(like.device)), like)
    return dataclasses.replace(seg, lens=seg.lens.index_select(0, rows.to(seg.lens.device)), **updates)


def _ready(cache) -> None:
    """Both operations need a cache between forwards: nothing pending, nothing a method holds for the next layer."""
    if cache._valid is not None or cache._visual is not None:
        raise RuntimeError("rows can only move between forwards: the cache has inputs set for a forward")
    for layer in cache.layers:
        if layer.pending is not None:
            raise RuntimeError("rows can only move between forwards: call cache.finalize() after a prefill")
        if layer.dense is None:
            raise ValueError("a cache must hold a prefilled prompt before its rows can move")
        held = getattr(layer.text_method, "blocks", None) or getattr(layer.text_method, "recon", None)
        if held:
            raise RuntimeError(f"layer {layer.layer_idx}'s method holds state for the next layer mid-forward")


def rows_of(cache) -> int:
    return len(cache.layers[0].dense_len) if cache.layers and cache.layers[0].dense is not None else 0


def merge_rows(cache, other) -> None:
    """Append the rows of ``other`` (same spec, e.g. a request prefilled alone) after those of ``cache``, in place:
    the cache object stays the one the model's forward and a ``DecodeStepper`` hold."""
    if str(cache.spec) != str(other.spec):
        raise ValueError(f"rows of a cache with spec {other.spec} cannot join a batch with spec {cache.spec}")
    if len(cache.layers) != len(other.layers):
        raise ValueError(f"caches of {len(other.layers)} and {len(cache.layers)} layers cannot merge")
    _ready(cache)
    _ready(other)
    na, nb = rows_of(cache), rows_of(other)
    for a, b in zip(cache.layers, other.layers):
        a.dense = cat_rows([(a.dense, na), (b.dense, nb)], a.dense)
        a.dense_len = a.dense_len + b.dense_len
        if a.is_sliding:  # its next slot and spare of evicted tokens are per row too (cache/sliding.py)
            a.merge_ring_rows(b, na, nb)
        n_vis = max(len(a.visual), len(b.visual))
        vis, vis_lens = [], []
        for i in range(n_vis):
            sa = a.visual[i] if i < len(a.visual) else None
            sb = b.visual[i] if i < len(b.visual) else None
            vis.append(cat_rows([(sa, na), (sb, nb)], sa if sa is not None else sb))
            vis_lens.append((a.visual_lens[i] if sa is not None else [0] * na)
                            + (b.visual_lens[i] if sb is not None else [0] * nb))
        a.visual, a.visual_lens = vis, vis_lens
        if a.text is not None or b.text is not None:
            a.text = cat_rows([(a.text, na), (b.text, nb)], a.text if a.text is not None else b.text)
            a.text_len = (a.text_len or [0] * na) + (b.text_len or [0] * nb)
        if hasattr(a.text_method, "merge_rows"):  # per-row state a method keeps beside its segment (AQUA-KV's read)
            a.text_method.merge_rows(b.text_method, na, nb)
        a.seen = max(a.seen, b.seen)
    if cache.positions is not None:
        _merge_positions(cache.positions, other.positions)


def keep_rows(cache, rows: list[int], repeat: bool = False) -> None:
    """Keep only ``rows`` (indices into the current rows, in the order given), in place. An empty list leaves a
    cache of zero rows, which a later ``merge_rows`` fills. ``repeat`` allows a row more than once (copies)."""
    _ready(cache)
    n = rows_of(cache)
    if any(not 0 <= r < n for r in rows) or (not repeat and len(set(rows)) != len(rows)):
        raise ValueError(f"rows {rows} are not distinct rows of a cache of {n}")
    idx = torch.tensor(rows, dtype=torch.long)
    for layer in cache.layers:
        layer.dense = take_rows(layer.dense, idx)
        layer.dense_len = [layer.dense_len[r] for r in rows]
        if layer.is_sliding:
            layer.take_ring_rows(idx)
        vis, vis_lens = [], []
        for seg, lens in zip(layer.visual, layer.visual_lens):
            kept = [lens[r] for r in rows]
            if any(kept):  # a visual segment none of the kept rows uses leaves with its rows
                vis.append(take_rows(seg, idx))
                vis_lens.append(kept)
        layer.visual, layer.visual_lens = vis, vis_lens
        if layer.text is not None:
            layer.text = take_rows(layer.text, idx)
            layer.text_len = [layer.text_len[r] for r in rows]
        if hasattr(layer.text_method, "keep_rows"):
            layer.text_method.keep_rows(idx)
    if cache.positions is not None and cache.positions.pos is not None:
        tp = cache.positions
        tp.pos = tp.pos.index_select(0, idx.to(tp.pos.device))
        tp.lens, tp.next = [tp.lens[r] for r in rows], [tp.next[r] for r in rows]
        tp.version += 1


def _merge_positions(a, b) -> None:
    if b.pos is None:
        raise ValueError("the joining cache has no recorded positions")
    width = max(a.pos.shape[1], b.pos.shape[1])
    pad = lambda p: torch.cat([p, p.new_zeros(p.shape[0], width - p.shape[1])], 1)  # noqa: E731
    a.pos = torch.cat([pad(a.pos), pad(b.pos.to(a.pos.device))])
    a.lens, a.next = a.lens + b.lens, a.next + b.next
    a.version += 1
