"""Generated images and clips with captions and question/answer pairs, deterministic by seed, CPU only, nothing
downloaded: the training and held-out data for demo vision towers that can see (issue 28).

    from eval.synth import generate
    items = generate("scene", n=100, seed=0)      # or "text", "document", "chart", "clip"

Each ``Item`` has an image (or frames), a caption, QA pairs and ``meta`` (what was drawn, in numbers), so answers
are checked against the drawing, not against a model. Kinds: ``scenes.py`` (shapes: colour, shape, count,
position, size, relations), ``cards.py`` (rendered words, numbers, short lines), ``documents.py`` (forms, receipts,
tables: DocVQA-style key/value questions), ``charts.py`` (bar and line charts), ``clips.py`` (8-16 frames:
moving, appearing, disappearing objects).
"""

from __future__ import annotations

from .common import Item
from .make import KINDS, generate

__all__ = ["KINDS", "Item", "generate"]
