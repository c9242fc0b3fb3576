"""What the one-off studies share: the WikiText-2 test split, looked up when a study runs (not at import)."""

from __future__ import annotations

from pathlib import Path

from mmkv.paths import wikitext


def wikitext_test() -> Path:
    """WikiText-2 test (``mmkv.paths.wikitext``: ``$MMKV_WIKITEXT``, the full split, else the shipped excerpt)."""
    return wikitext("test")
