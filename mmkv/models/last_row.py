"""A prefill's last decoder layer for the last position only.

A prefill keeps one position's logits (``logits_to_keep=1``), and the cache takes every layer's keys and values
from that layer's input. So the last layer's attention output, its output projection and its MLP are needed for
the last position alone; transformers computes them for every position and drops all rows but one at the LM head.
Inside :class:`LastRow` the last layer still projects and caches every position's keys and values, but its
attention (``mmkv.attention``: the query's last row against every key, the mask's last row), ``o_proj`` and MLP run
on one row. The residual adds then broadcast that row over the prompt's rows; only the last one is read, and it
holds the same value as the whole computation's up to fp32 rounding (a one-row SDPA sums in another order than the
causal kernel's blocks). SmolLM2 at 8k tokens: one layer's attention over the prompt (~0.57 s on 2 cores) and MLP
(~0.25 s) of a ~29 s prefill (docs/BENCHMARKS.md, "CPU generation"). Used by ``mmkv.engine.prefill`` as
``MMKV_LAST_ROW`` says (:func:`last_row`); never for ``score``, which reads every position's logits.
"""

from __future__ import annotations

import contextlib

import torch

from kernels.switches import switch
from mmkv.attention import LAST_ROW as MARK

from .sharding import decoder_layers


def _last(x: torch.Tensor) -> torch.Tensor:
    return x[..., -1:, :]


def _parts(model):
    """``(attention, o_proj, mlp)`` of the last decoder layer, or None where it is not laid out that way."""
    try:
        layer = decoder_layers(model)[1][-1]
    except ValueError:
        return None
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    o_proj = getattr(attn, "o_proj", None)
    if attn is None or mlp is None or not isinstance(o_proj, torch.nn.Linear):
        return None
    return attn, o_proj, mlp


class LastRow:
    """``with LastRow(model):`` the last layer as above; a no-op for a model without ``self_attn``, ``o_proj`` and
    ``mlp`` in its last decoder layer. Enter it inside any context that sets these modules' forwards (it wraps
    whatever forward they have then and puts it back on exit)."""

    def __init__(self, model):
        self.parts = _parts(model)
        self.saved: list = []

    def __enter__(self):
        if self.parts is None:
            return self
        attn, o_proj, mlp = self.parts
        setattr(attn, MARK, True)
        for mod in (o_proj, mlp):
            had = mod.__dict__.get("forward")
            self.saved.append((mod, had))
            inner = mod.forward

            def forward(x, inner=inner):
                return inner(_last(x))

            mod.__dict__["forward"] = forward
        return self

    def __exit__(self, *exc):
        if self.parts is None:
            return False
        for mod, had in reversed(self.saved):
            if had is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.__dict__["forward"] = had
        self.saved.clear()
        setattr(self.parts[0], MARK, False)
        return False


def last_row(model, devices):
    """The context for a prefill of ``model`` on ``devices``: :class:`LastRow` where ``MMKV_LAST_ROW`` takes that
    device kind (``cpu``: the CPU only; ``1``: every device; ``0``: none), else a no-op. Enter it after
    ``cpu_forward``, whose forwards it wraps."""
    mode = switch("MMKV_LAST_ROW")
    on = mode == "1" or (mode == "cpu" and devices[0].type == "cpu")
    return LastRow(model) if on else contextlib.nullcontext()
