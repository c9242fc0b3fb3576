"""``generate``: n items of one kind (the generators' single entry point)."""

from __future__ import annotations

from . import cards, charts, clips, documents, scenes
from .common import Item, rng_for

KINDS = ("scene", "text", "document", "chart", "clip")
_MAKERS = {"scene": scenes.scene, "text": cards.card, "document": documents.document, "chart": charts.chart,
           "clip": clips.clip}


def make(kind: str, rng, **kw) -> Item:
    """One item of ``kind`` drawn from ``rng`` (a ``random.Random``): the trainer's entry point, which seeds its own
    streams so that they can never be those of ``generate``'s held-out seeds."""
    if kind not in _MAKERS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {sorted(_MAKERS)}")
    return _MAKERS[kind](rng, **kw)


def generate(kind: str, n: int, seed: int = 0, **kw) -> list[Item]:
    return [make(kind, rng_for(seed, kind, i), **kw) for i in range(n)]
