"""What the one-off studies (and the CPU bench) share: the WikiText-2 test split, looked up when a study runs (not
at import), and prompts cut from it."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkv.paths import wikitext


def wikitext_test() -> Path:
    """WikiText-2 test (``mmkv.paths.wikitext``: ``$MMKV_WIKITEXT``, the full split, else the shipped excerpt)."""
    return wikitext("test")


def prompts(tok, n: int, length: int, path: Path | None = None) -> torch.Tensor:
    """``n`` prompts of ``length`` consecutive WikiText-2 test tokens, ``[n, length]``."""
    path = path or wikitext_test()
    ids = tok(path.read_text(encoding="utf-8")[: 12 * n * length], return_tensors="pt").input_ids[0]
    if len(ids) < n * length:
        raise ValueError(f"{path} gives {len(ids)} tokens, fewer than {n} x {length}")
    return ids[: n * length].view(n, length)
