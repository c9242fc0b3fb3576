"""Demo VLMs whose language model is SmolLM2 cut to its first decoder layers (its own embeddings, final norm and
head), for tests of training and eval plumbing that never judge an answer: packing, resuming, exporting, the eval
CLI's tables. Two of SmolLM2's thirty layers make such a test's forwards and backwards ~10x cheaper; the code paths
are the whole model's. Tests of what the demos answer, and every quality measurement, load the whole model."""

from __future__ import annotations

from contextlib import contextmanager

LAYERS = 2


@contextmanager
def first_lm_layers(n: int = LAYERS):
    """While open, ``load_demo`` (and everything that builds a demo through it) keeps SmolLM2's first ``n`` layers."""
    from mmkv.models import demo

    whole = demo.assemble

    def cut(cls, config, source_lm):
        source_lm.model.layers = source_lm.model.layers[:n]
        text = source_lm.config
        text.num_hidden_layers = n
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[:n]
        return whole(cls, config, source_lm)

    demo.assemble = cut
    try:
        yield
    finally:
        demo.assemble = whole
