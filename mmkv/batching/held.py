"""The bytes a cache's tensors hold, and what they will hold after the next event, before the scheduler commits.

Used bytes (kvbytes.py) are what a request's tokens occupy. A batch's tensors hold more: every row at the
batch's capacities (rows pad to the longest row of each segment, and segments grow ahead of their tokens), the
spare rows a request left behind and the pad rows of a bucket (batch.py). The scheduler's budget counts these held
bytes. A cache's tensors all have rows on their first axis, apart from a few per-layer tables (SKVQ's channel
order), so what it holds is ``fixed + rows * per_row`` (``Held``), and every event that changes it is one of:

* ``after_keep(cache, rows)``: ``keep_rows`` (a request leaves a compacted batch, spare rows are dropped, a batch
  is padded to its bucket with copies of a row): the kept rows' segments at the same capacities, less the visual
  segments none of them uses;
* ``after_merge(cache, other, keep)``: ``merge_rows`` of a prefilled request after the rows ``keep``, sized by the
  plan ``cat_rows`` itself follows (``rows.cat_plan``);
* ``after_decode(cache, templates)``: the decode step that grows the fp16 window or flushes a block into the text
  segment (``MMKVCache.decode_steps_free() == 0``), following the layers' growth rules (cache/layer.py,
  cache/sliding.py, cache/positions.py). Steps between two such events change no tensor.

Joins and leaves in place (cache/slots.py) change no tensor either. Each function walks the layers once, so the
scheduler calls them on events only. tests/test_budget_held.py checks each against the tensors' storage after the
event, for every text layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from ..cache import segments as S
from ..cache.rows import _compact, cat_plan, rows_of


class Held(NamedTuple):
    """``fixed`` bytes whatever the rows (per-layer tables) plus ``per_row`` bytes for each of ``rows`` rows."""

    fixed: int
    per_row: int
    rows: int

    @property
    def total(self) -> int:
        return self.fixed + self.rows * self.per_row


def _index_bytes(t) -> int:
    """Bytes one row holds per index along the token axis, as stored (broadcast axes hold one element)."""
    base = _compact(t)
    return base.element_size() * base.shape[1] * math.prod(base.shape[3:])


def _full_index_bytes(t) -> int:
    """The same for a copy made with ``new_zeros`` of the full shape (``S.grow``, ``S.empty_like_layout``)."""
    return t.element_size() * t.shape[1] * math.prod(t.shape[3:])


def _layer_tables(seg) -> int:
    names = getattr(seg, "layer_fields", lambda: [])()
    return sum(getattr(seg, n).numel() * getattr(seg, n).element_size() for n in names)


def seg_held(seg) -> tuple[int, int]:
    """``(fixed, per_row)`` bytes of one segment as it is."""
    per_row = sum(getattr(seg, n).shape[2] * _index_bytes(getattr(seg, n)) for n, _ in S.token_fields(seg))
    return _layer_tables(seg), per_row + seg.lens.element_size()


def held(cache) -> Held:
    """What the cache's tensors hold now (equals ``cache.nbytes()``)."""
    fixed = per_row = 0
    for layer in cache.layers:
        for _, seg, _ in layer.parts():
            f, r = seg_held(seg)
            fixed += f
            per_row += r
        fixed += layer.pending_nbytes()  # only between a prefill's layers: never in a batch
    if cache.positions is not None and cache.positions.pos is not None:
        per_row += cache.positions.pos.shape[1] * cache.positions.pos.element_size()
    return Held(fixed, per_row, rows_of(cache))


def _kept_visual(layer, keep) -> list:
    """The visual segments ``keep_rows(keep)`` leaves (those some kept row uses)."""
    return [s for s, lens in zip(layer.visual, layer.visual_lens) if any(lens[r] for r in keep)]


def after_keep(cache, keep: list[int], rows: int | None = None) -> Held:
    """What the cache holds after ``keep_rows(cache, keep)``, then (``rows``) padded with copies of kept rows."""
    fixed = per_row = 0
    for layer in cache.layers:
        segs = [seg for m, seg, _ in layer.parts() if m != "visual"] + _kept_visual(layer, keep)
        for seg in segs:
            f, r = seg_held(seg)
            fixed += f
            per_row += r
    if cache.positions is not None and cache.positions.pos is not None:
        per_row += cache.positions.pos.shape[1] * cache.positions.pos.element_size()
    return Held(fixed, per_row, len(keep) if rows is None else rows)


def _cat_held(segs: list, example) -> tuple[int, int]:
    """``(fixed, per_row)`` of ``cat_rows`` over segments ``segs`` (None: empty rows) with ``example``'s layout."""
    cap, extra = cat_plan([s for s in segs if s is not None], example)
    per_row = sum(-(-cap // per) * _index_bytes(getattr(example, n))
                  for n, per in S.token_fields(dataclasses.replace(example, **extra)))
    return _layer_tables(example), per_row + 4  # lens: int32


def after_merge(cache, other, keep: list[int] | None = None) -> Held:
    """What the cache holds after ``keep_rows(cache, keep)`` (None: every row) and ``merge_rows(cache, other)``."""
    keep = list(range(rows_of(cache))) if keep is None else keep
    fixed = per_row = 0
    for a, b in zip(cache.layers, other.layers):
        vis = _kept_visual(a, keep)
        pairs = [(a.dense, b.dense)]
        pairs += [(vis[i] if i < len(vis) else None, b.visual[i] if i < len(b.visual) else None)
                  for i in range(max(len(vis), len(b.visual)))]
        if a.text is not None or b.text is not None:
            pairs.append((a.text, b.text))
        if getattr(a, "spare", None) is not None or getattr(b, "spare", None) is not None:
            pairs.append((a.spare, b.spare))  # a sliding layer's evicted tokens (merge_ring_rows)
        for x, y in pairs:
            f, r = _cat_held([x, y], x if x is not None else y)
            fixed += f
            per_row += r
    pa, pb = cache.positions, other.positions
    if pa is not None and pa.pos is not None:
        per_row += max(pa.pos.shape[1], pb.pos.shape[1]) * pa.pos.element_size()
    return Held(fixed, per_row, len(keep) + rows_of(other))


# --- one decode step ----------------------------------------------------------------------------------------------
class _Seg:
    """A segment's shape as the growth rules see it: per field, tokens per index, indices, bytes per index."""

    def __init__(self, seg, full: bool = False):
        idx = _full_index_bytes if full else _index_bytes
        self.fields = [[per, getattr(seg, n).shape[2], idx(getattr(seg, n))] for n, per in S.token_fields(seg)]
        self.tables = _layer_tables(seg)
        self.full = [_full_index_bytes(getattr(seg, n)) for n, _ in S.token_fields(seg)]

    @property
    def capacity(self) -> int:
        per, n, _ = self.fields[0]
        return n * per

    def grow(self, capacity: int) -> None:
        """``S.grow``: every field to ``capacity`` in zeros of the full shape, unless one already holds it."""
        if any(-(-capacity // per) <= n for per, n, _ in self.fields):
            return  # S.grow returns the segment as it is at the first field that holds the capacity
        self.fields = [[per, -(-capacity // per), full] for (per, _, _), full in zip(self.fields, self.full)]

    def resize(self, capacity: int) -> None:
        """``S.shrink`` and ``S.empty_like_layout``: every field at ``capacity``, stored in full."""
        self.fields = [[per, -(-capacity // per), full] for (per, _, _), full in zip(self.fields, self.full)]

    @property
    def per_row(self) -> int:
        return sum(n * b for _, n, b in self.fields) + 4


def _decode_layer(layer, template) -> tuple[int, int]:
    """``(fixed, per_row)`` of a layer's segments after one decode append (``MMKVLayer._append_decode`` and
    ``_flush``, ``SlidingLayer._append_decode``)."""
    fixed = per_row = 0
    for m, seg, _ in layer.parts():
        if m == "visual":  # visual spans never change after their prefill
            f, r = seg_held(seg)
            fixed += f
            per_row += r
    dense = _Seg(layer.dense)
    lens = [n + 1 for n in layer.dense_len]
    need = max(lens)
    if layer.is_sliding:
        w = layer.sliding_window
        spare = _Seg(layer.spare) if layer.spare is not None else None
        if need > dense.capacity and dense.capacity < w:
            dense.grow(min(w, max(need, 2 * dense.capacity)))
            if dense.capacity == w and spare is None:
                spare = _Seg(layer.dense)
                spare.resize(layer.spare_size)
        segs = [dense] + ([spare] if spare is not None else [])
        return fixed, per_row + sum(s.per_row for s in segs)
    spec, blk = layer.spec, layer.text_method.flush_block
    steady = layer._steady_capacity()
    if need > dense.capacity:
        dense.grow(max(need, min(2 * dense.capacity, steady)))
    text = _Seg(layer.text) if layer.text is not None else None
    if need - min(spec.sinks, need) >= spec.window + blk:
        text_len = list(layer.text_len) if layer.text is not None else [0] * len(lens)
        moved = False
        for row, n in enumerate(lens):
            k = max(n - min(spec.sinks, n) - spec.window, 0) // blk * blk
            if not k:
                continue
            if text is None:  # _text_append: the first flush makes the segment, of the template's layout
                text = _Seg(template, full=True)
                text.resize(max(k, 4 * blk))
            if text_len[row] + k > text.capacity:
                cap = text.capacity
                text.grow(-(-max(text_len[row] + k, cap + cap // 2) // blk) * blk)
            text_len[row] += k
            lens[row] = n - k
            moved = True
        if moved and dense.capacity > 2 * steady >= 2 * max(lens):
            dense.resize(steady)
    fixed += text.tables if text is not None else 0
    return fixed, per_row + dense.per_row + (text.per_row if text is not None else 0)


def after_decode(cache, templates: list) -> Held:
    """What the cache holds after its next decode step. ``templates``: per layer, a text segment of the layout
    that layer's text method makes (``KVBytes.layers[i].text``), for a layer whose first flush is this step."""
    fixed = per_row = 0
    for layer, template in zip(cache.layers, templates, strict=True):
        f, r = _decode_layer(layer, template)
        fixed += f
        per_row += r
    tp = cache.positions
    if tp is not None and tp.pos is not None:
        need = max(tp.lens) + 1
        width = tp.pos.shape[1] if need <= tp.pos.shape[1] else max(need, tp.pos.shape[1] * 3 // 2)
        per_row += width * tp.pos.element_size()
    return Held(fixed, per_row, rows_of(cache))


def steps_free(cache) -> int:
    """Decode steps that change no tensor of the cache (``after_decode`` is then what it holds now)."""
    free = cache.decode_steps_free()
    tp = cache.positions
    if tp is not None and tp.pos is not None:
        free = min(free, tp.pos.shape[1] - max(tp.lens))
    return free
