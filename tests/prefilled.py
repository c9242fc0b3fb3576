"""A one-row cache filled by the engine's own prefill, as the scheduler's prefill leaves it (tests of row moves)."""

from __future__ import annotations

import torch

from mmkv.cache import MMKVCache
from mmkv.engine import first_positions, prefill


def prefilled(eng, ids: torch.Tensor, spec) -> tuple[MMKVCache, int, int]:
    """``(cache, greedy first token, prompt length)`` of the text prompt ``ids [1, T]`` under ``spec``."""
    mask = torch.ones_like(ids)
    positions, _ = first_positions(eng, ids, mask, {})
    cache = MMKVCache.for_model(spec, eng.adapter)
    logits = prefill(eng, cache, ids, mask, mask, torch.zeros_like(ids, dtype=torch.bool), positions, {})
    return cache, int(logits.argmax(-1)), ids.shape[1]
