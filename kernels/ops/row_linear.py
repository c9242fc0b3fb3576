"""A linear layer over a few rows on the CPU with its output rows shared among torch's threads.

For one decode token (``x`` of 1-4 rows) torch's CPU ``F.linear`` is a matrix-vector product that runs on one
thread (MKL's gemv; measured on a 2-core box with ``torch.set_num_threads(2)``: a 49152 x 576 fp32 LM head 10.0 ms
on one thread or two). A decode step is that product over every weight of the model, read from DRAM, so one
thread's bandwidth sets its pace. Cutting the weight into ``parts`` blocks of output rows and multiplying them as
one batched product (``torch.bmm``, whose batch torch spreads over its threads) reads the blocks in parallel: the
same LM head in 5.3 ms, a SmolLM2 step's 210 layer weights in 26-39 ms instead of 44-46 (docs/BENCHMARKS.md).

Each output element is still one dot product of a weight row with ``x`` computed by the same BLAS: at SmolLM2's
widths (576, 1536) the result equalled ``F.linear``'s bit for bit on the box measured, and where MKL blocks the
two products differently (an odd width) it moves by fp32 rounding (tests/test_row_linear.py). ``SplitLinears``
installs this forward on a model's ``nn.Linear`` modules for the span of a ``with`` block only: the model object is
unchanged outside it (so transformers' ``generate`` on the same object runs as before).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 4  # from 8 rows on, MKL's own product already uses the threads (and split was slower at 8)


def parts_for(out_features: int, threads: int) -> int:
    """Blocks to cut ``out_features`` output rows into: the most of ``threads`` that divides them evenly (1: no
    split)."""
    for p in range(max(threads, 1), 1, -1):
        if out_features % p == 0:
            return p
    return 1


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``parts`` blocks of output rows in one ``bmm`` (``weight``
    contiguous, ``out_features % parts == 0``)."""
    o, i = weight.shape
    if parts < 2 or o % parts or not weight.is_contiguous():
        raise ValueError(f"row_linear needs a contiguous weight whose {o} output rows split into {parts} >= 2 "
                         "equal blocks")
    m = x.numel() // i
    w = weight.view(parts, o // parts, i).transpose(1, 2)  # [parts, i, o / parts]: a transposed view, no copy
    xs = x.reshape(1, m, i).expand(parts, m, i)
    y = torch.bmm(xs, w) if bias is None else torch.baddbmm(bias.view(parts, 1, o // parts), xs, w)
    return y.transpose(0, 1).reshape(*x.shape[:-1], o)


class SplitLinears:
    """``with SplitLinears(model):`` every ``nn.Linear`` of ``model`` on the CPU computes inputs of at most
    ``MAX_ROWS`` rows with :func:`row_linear`; larger inputs (a prefill) and everything after the block take
    ``F.linear`` as before. Inactive (a no-op) with fewer than two torch threads. The weights are taken when it is
    made: make one per generation, not one per model for good."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.forwards = model, {}
        threads = torch.get_num_threads()
        for mod in model.modules():
            if type(mod) is not torch.nn.Linear or mod.weight.device.type != "cpu":
                continue
            parts = parts_for(mod.out_features, threads)
            if parts > 1 and mod.weight.is_contiguous():
                self.forwards[mod] = _forward(mod, parts)
        self.threads = threads

    def __enter__(self):
        if torch.get_num_threads() != self.threads:  # threads changed since: the blocks no longer match them
            self.__init__(self.model)
        for mod, fwd in self.forwards.items():
            mod.__dict__["forward"] = fwd  # an instance attribute shadows the class's forward; no nn.Module hooks
        return self

    def __exit__(self, *exc):
        for mod in self.forwards:
            mod.__dict__.pop("forward", None)
        return False


def _forward(mod: torch.nn.Linear, parts: int):
    weight, bias, i = mod.weight, mod.bias, mod.in_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() > MAX_ROWS * i or x.dtype != weight.dtype or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        return row_linear(x, weight, bias, parts)

    return forward
