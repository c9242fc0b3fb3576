"""How a segment layout plugs into ``decode_attention``: its kind, and for layouts with their own kernel a
``Layout`` entry (split-K plan questions and a launch). ``kernels/decode/__init__.py`` imports every module
that registers one, so every layout is registered in one place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

KIND_DENSE, KIND_CHANNEL, KIND_KIVI = 1, 2, 3
KIND_PLUGIN = 0  # a layout registered in LAYOUTS; its own module launches its own kernel


@dataclass(frozen=True)
class Layout:
    """How a segment type defined outside this file plugs into the split-K plan and the shared merge.

    ``capacity(seg)``: token capacity; ``kv_heads(seg)``: H; ``tile(seg, D)``: tokens one program iteration
    covers; ``tile_bytes(seg, tt, D)``: bytes such a tile moves (balances splits across segments);
    ``launch(ctx, it)``: writes partials for the global splits ``[it["s_off"], it["s_off"] + it["nsplit"])`` of
    every (row, query head) into ``ctx.part_o [B, Hq, S, D]`` (un-normalized fp32 accumulator) and
    ``ctx.part_ml [B, Hq, S, 2]`` (running max in log2 units, i.e. of ``logit * ctx.qk_scale``, and the sum of
    ``exp2(x - max)``), exactly as ``_segment_kernel`` does; ``it`` holds ``seg, T, lens (int32 on q's device),
    tt, tiles, tps (tiles per split), nsplit, s_off``. ``wave_tiles(seg, it, B, H, G, D, nsm)`` (optional): tiles per
    split that fill whole waves of the layout's kernel on CUDA (0: the byte rule above). ``split(seg, it, B, H, D,
    tps)`` (optional, any device): the final tiles per split and where the layout's kernel lets the merge launch
    start (0 never, 1 past its loop, 2 at its start; the plan keeps it only where programmatic dependent launch
    works and ``launch`` sets ``it["pdl"]`` to 0 where the kernel that ran did not trigger). ``dependent``: ``launch``
    honours ``it["dep"]`` (its kernel launched as the previous kernel's programmatic dependent, which it waits for
    before it ends: ``window_rules.window_overlap``).
    """

    capacity: Callable
    kv_heads: Callable
    tile: Callable
    tile_bytes: Callable
    launch: Callable
    wave_tiles: Callable | None = None
    split: Callable | None = None
    dependent: bool = False


LAYOUTS: dict[type, Layout] = {}


def register_layout(seg_type: type, layout: Layout) -> None:
    LAYOUTS[seg_type] = layout


@dataclass
class LaunchContext:
    """What a plug-in launch needs from the call (see ``Layout.launch``)."""

    q: torch.Tensor
    B: int
    H: int
    G: int
    GP: int
    D: int
    HQ: int
    S: int
    part_o: torch.Tensor
    part_ml: torch.Tensor
    qk_scale: float
    nsm: int
