"""Where mmkv reads and writes files outside the package: its cache folder and WikiText-2.

``cache_dir()``: ``$MMKV_CACHE_DIR`` (``~/.cache/mmkv`` when unset); converted models and calibration artifacts
live under it. ``wikitext(split)``: the tokenized WikiText-2 release (calibration uses ``valid``, perplexity
reports ``test``), in order from the folder named by ``$MMKV_WIKITEXT``; a ``shared/data/wikitext-2`` folder
beside the checkout (the full splits); the excerpt shipped in ``assets/text/wikitext-2`` (the first ~64 kB of
each split, enough for tests and smoke runs; a warning says so, because numbers measured on it are not
comparable with the full split's).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from kernels.switches import cache_dir, switch  # noqa: F401  (cache_dir: mmkv.paths is where callers find it)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "wikitext-2"
EXCERPT = REPO / "assets" / "text" / "wikitext-2"
SPLITS = ("test", "valid")


def wikitext(split: str = "test") -> Path:
    """The ``split`` file (``test`` or ``valid``) from the first place that has it."""
    if split not in SPLITS:
        raise ValueError(f"wikitext-2 split must be one of {SPLITS}, got {split!r}")
    env = switch("MMKV_WIKITEXT")
    if env:
        p = Path(env) / f"{split}.txt"
        if not p.is_file():
            raise FileNotFoundError(f"$MMKV_WIKITEXT={env} has no {split}.txt")
        return p
    if (SHARED / f"{split}.txt").is_file():
        return SHARED / f"{split}.txt"
    warnings.warn(f"full WikiText-2 not found at {SHARED} (set $MMKV_WIKITEXT to its folder); using the "
                  f"{split} excerpt shipped in {EXCERPT} (first ~64 kB)", stacklevel=2)
    return EXCERPT / f"{split}.txt"
