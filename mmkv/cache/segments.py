"""Layout-generic operations on segments: growing capacity, writing one row's tokens, exact byte counts.

Every tensor of a segment has the token axis at dim 2; each layout's ``token_fields()`` (``kernels/layouts.py``)
says how many tokens one index along that axis covers (a packed byte holds ``8 // bits`` tokens, a scale row
covers a block of tokens), which is all these operations need to know about a layout.
"""

from __future__ import annotations

import dataclasses

import torch


def token_fields(seg) -> list[tuple[str, int]]:
    fields = getattr(seg, "token_fields", None)
    if fields is None:
        raise TypeError(f"segment type {type(seg).__name__} does not declare its token fields")
    return fields()


def capacity(seg) -> int:
    name, per = token_fields(seg)[0]
    return getattr(seg, name).shape[2] * per


def _storage_elems(t: torch.Tensor) -> int:
    """Elements actually held: an expanded (stride-0) axis holds one element, not ``size``."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n


def nbytes(seg) -> int:
    """Bytes of every tensor the segment holds (capacity included: that memory is taken)."""
    total = sum(_storage_elems(getattr(seg, n)) * getattr(seg, n).element_size() for n, _ in token_fields(seg))
    # per-layer tables a layout holds once (SKVQ's channel permutation and group ids), not per token
    layer = getattr(seg, "layer_fields", None)
    total += sum(getattr(seg, n).numel() * getattr(seg, n).element_size() for n in (layer() if layer else ()))
    return total + seg.lens.numel() * seg.lens.element_size()


def used_nbytes(seg, lens: list[int]) -> int:
    """Bytes that the valid tokens occupy (the formula of docs/CACHE.md; no capacity slack, no length vector)."""
    total = 0
    for name, per in token_fields(seg):
        t = getattr(seg, name)
        total += sum(-(-n // per) for n in lens) * _index_nbytes(t)
    return total


def _index_nbytes(t: torch.Tensor) -> int:
    """Bytes one index along the token axis (dim 2) of one row holds: ``_storage_elems(t[:1, :, :1])`` times the
    element size, without making the view (a live stats count runs this for every field of every layer)."""
    n = t.element_size()
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if dim not in (0, 2) and stride != 0:
            n *= size
    return n


def grow(seg, new_capacity: int):
    """A copy of ``seg`` whose token capacity is at least ``new_capacity`` (contents and lens kept)."""
    updates = {}
    for name, per in token_fields(seg):
        t = getattr(seg, name)
        rows = -(-new_capacity // per)
        if rows <= t.shape[2]:
            return seg
        bigger = t.new_zeros(*t.shape[:2], rows, *t.shape[3:])
        bigger[:, :, : t.shape[2]] = t
        updates[name] = bigger
    return dataclasses.replace(seg, **updates)


def shrink(seg, new_capacity: int):
    """A compact copy holding ``new_capacity`` tokens (frees the slack after a long prefill)."""
    updates = {}
    for name, per in token_fields(seg):
        t = getattr(seg, name)
        rows = -(-new_capacity // per)
        updates[name] = t[:, :, :rows].clone()
    return dataclasses.replace(seg, **updates)


def write_row(dst, row: int, offset: int, src, src_row: int, n_tokens: int) -> None:
    """Copy the first ``n_tokens`` tokens of ``src[src_row]`` into ``dst[row]`` at token ``offset``.

    ``offset`` and ``n_tokens`` must be whole units of every field (blocks for block-scaled layouts); the text
    methods flush in whole blocks, which is what makes this hold.
    """
    for name, per in token_fields(dst):
        if offset % per:
            raise ValueError(f"write at token {offset} is not aligned to {per} tokens for {name}")
        a, n = offset // per, -(-n_tokens // per)
        getattr(dst, name)[row, :, a : a + n] = getattr(src, name)[src_row, :, :n]


def move_tokens(seg, row: int, src: int, dst: int, n: int) -> None:
    """Move ``n`` tokens of a dense segment row from ``src`` to ``dst`` (dst < src; overlapping is fine)."""
    for name in ("k", "v"):
        t = getattr(seg, name)
        t[row, :, dst : dst + n] = t[row, :, src : src + n].clone()


def empty_like_layout(example, batch: int, capacity_tokens: int):
    """An all-zero segment with the layout, dtypes and per-row shapes of ``example`` and a given capacity."""
    updates = {}
    for name, per in token_fields(example):
        t = getattr(example, name)
        if _storage_elems(t) != t.numel():
            t = t.contiguous()
        updates[name] = t.new_zeros(batch, t.shape[1], -(-capacity_tokens // per), *t.shape[3:])
    lens = torch.zeros(batch, dtype=torch.int32, device=example.lens.device)
    return dataclasses.replace(example, lens=lens, **updates)
