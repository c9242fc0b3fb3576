"""Rows of a running batch reused in place: what lets a captured decode graph survive requests joining and leaving.

A CUDA graph reads the cache's tensors at the addresses it was captured with (``MMKVCache.layout_signature``).
``merge_rows``/``keep_rows`` (rows.py) build new tensors, so after them the graph must be captured again. Here:

* ``clear_row(cache, r)`` turns row ``r`` into a spare: every segment's ``lens`` for that row becomes 0 (its
  stale codes stay where they are; attention reads ``lens`` tokens), so a decode step of the batch costs the spare
  the few pad tokens it decoded since it was last emptied;
* ``write_row(cache, r, other)`` writes a request prefilled alone (a one-row cache of the same spec) into spare row
  ``r``: each segment's storage for that row, its ``lens`` and the layer's host counters, the same values
  ``merge_rows`` would give that row, into the tensors that exist. It needs each of the row's segments to fit
  (``misfit`` says why not: then the batch merges as before and captures a new graph).

Both keep every tensor (``data_ptr``, shape, stride) of the cache, so its layout signature holds. Capacities are
the batch's: a segment's kernels read per-row ``lens`` and size their grids by capacity, never by a row's length.

Not for caches with per-row state beside the segments (sliding-window rings, AQUA-KV's positions and memo):
``unsupported`` names it and the scheduler keeps merging those.
"""

from __future__ import annotations

import torch

from . import segments as S
from .rows import _compact, _fixed, _ready, _single_block, rows_of


def unsupported(cache) -> str | None:
    """Why rows of ``cache`` cannot be reused in place (None: they can)."""
    if cache.positions is not None:
        return f"{cache.spec.text.name} records per-row text positions"
    for layer in cache.layers:
        if layer.is_sliding:
            return f"layer {layer.layer_idx} is a sliding-window ring"
        if hasattr(layer.text_method, "merge_rows"):
            return f"{cache.spec.text.name} keeps per-row state beside its segment"
    return None


def _seg_misfit(dst, src) -> str | None:
    if type(src) is not type(dst):
        return f"a {type(src).__name__} segment cannot go into a {type(dst).__name__} one"
    want, got = _fixed(dst), _fixed(src)
    if "block" in want and _single_block(dst) and _single_block(src):
        # one block per row (CalibQuant block=0): the batch's block is the longest span it holds
        if src.block > dst.block:
            return f"a span of {src.block} tokens does not fit a segment of {dst.block}"
        got["block"] = want["block"]
    if got != want:
        return f"configurations differ: {got} vs {want}"
    for name, _ in S.token_fields(dst):
        d, s = _compact(getattr(dst, name)), _compact(getattr(src, name))
        if s.shape[2] > d.shape[2]:
            return f"{name} holds {s.shape[2]} along tokens, the batch's {d.shape[2]}"
        if s.shape[1] != d.shape[1] or any(a != b and a != 1 for a, b in zip(s.shape[3:], d.shape[3:])):
            return f"{name} has per-row shape {tuple(s.shape[1:])}, the batch's {tuple(d.shape[1:])}"
    return None


def misfit(cache, other) -> str | None:
    """Why the one-row cache ``other`` cannot be written into a spare row of ``cache`` (None: it can)."""
    reason = unsupported(cache)
    if reason is not None:
        return reason
    if str(cache.spec) != str(other.spec):
        return f"spec {other.spec} is not the batch's {cache.spec}"
    if len(cache.layers) != len(other.layers):
        return f"{len(other.layers)} layers, the batch has {len(cache.layers)}"
    if rows_of(other) != 1:
        return f"a request is one row, got {rows_of(other)}"
    for a, b in zip(cache.layers, other.layers):
        if len(b.visual) > len(a.visual):
            return f"layer {a.layer_idx}: {len(b.visual)} visual segments, the batch has {len(a.visual)}"
        if b.text is not None and a.text is None:
            return f"layer {a.layer_idx}: the batch holds no text segment yet"
        pairs = [(a.dense, b.dense), *zip(a.visual, b.visual)] + ([(a.text, b.text)] if b.text is not None else [])
        for dst, src in pairs:
            reason = _seg_misfit(dst, src)
            if reason is not None:
                return f"layer {a.layer_idx}: {reason}"
    return None


def _check_row(cache, row: int) -> None:
    _ready(cache)
    n = rows_of(cache)
    if not 0 <= row < n:
        raise ValueError(f"row {row} is not a row of a cache of {n}")


def _write_seg(dst, row: int, src) -> None:
    for name, _ in S.token_fields(dst):
        d, s = _compact(getattr(dst, name)), _compact(getattr(src, name))
        n = s.shape[2]
        d[row, :, :n] = s[0]
        d[row, :, n:] = 0  # what merge_rows pads with: the row's storage equals a merged row's
    dst.lens[row] = src.lens[0].to(dst.lens.device)


@torch.inference_mode()  # a prefilled cache's tensors are inference tensors: written in place only in this mode
def write_row(cache, row: int, other) -> None:
    """Write the one-row cache ``other`` into row ``row`` of ``cache`` in place (ValueError when it does not fit)."""
    _check_row(cache, row)
    _ready(other)
    reason = misfit(cache, other)
    if reason is not None:
        raise ValueError(f"the request cannot take row {row} in place: {reason}")
    for a, b in zip(cache.layers, other.layers):
        _write_seg(a.dense, row, b.dense)
        a.dense_len[row] = b.dense_len[0]
        for i, seg in enumerate(a.visual):
            if i < len(b.visual):
                _write_seg(seg, row, b.visual[i])
                a.visual_lens[i][row] = b.visual_lens[i][0]
            else:
                seg.lens[row] = 0
                a.visual_lens[i][row] = 0
        if a.text is not None:
            if b.text is not None:
                _write_seg(a.text, row, b.text)
                a.text_len[row] = b.text_len[0]
            else:
                a.text.lens[row] = 0
                a.text_len[row] = 0
        a.seen = max(a.seen, b.seen)


def clear_row(cache, row: int) -> None:
    """Make row ``row`` a spare: no tokens in any segment (its storage is left as it is, and never read)."""
    clear_rows(cache, [row])


@torch.inference_mode()
def clear_rows(cache, rows: list[int]) -> None:
    """``clear_row`` for several rows: one write per segment (a batch of 64 rows may free tens at a time)."""
    for row in rows:
        _check_row(cache, row)
    if unsupported(cache) is not None:
        raise ValueError(f"rows of this cache cannot be cleared in place: {unsupported(cache)}")
    if not rows:
        return
    idx = torch.tensor(rows, dtype=torch.long, device=cache.layers[0].dense.lens.device)
    for layer in cache.layers:
        for _, seg, lens in layer.parts():
            seg.lens.index_fill_(0, idx if idx.device == seg.lens.device else idx.to(seg.lens.device), 0)
            for row in rows:
                lens[row] = 0


def spare_rows_used(cache, rows: list[int]) -> bool:
    """Whether any of ``rows`` holds tokens (a spare decodes a pad token each step, and grows by one)."""
    layer = cache.layers[0]
    return any(layer.dense_len[r] for r in rows)

