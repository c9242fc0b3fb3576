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
    """``with SplitLinears(model, groups):`` every ``nn.Linear`` of ``model`` on the CPU computes inputs of at most
    ``MAX_ROWS`` rows with :func:`row_linear`; larger inputs (a prefill) take ``F.linear`` as before. The row split
    is inactive with fewer than two torch threads (or ``split=False``).

    ``groups``: lists of linears that read the same input and whose weights (and biases) lie back to back in one
    storage (q|k|v: ``mmkv.models.projections.share_cpu_storage``). The first of a group computes the
    whole group's product in one GEMM (``F.linear``, or :func:`row_linear` for a few rows) and returns its columns;
    a sibling called with the very same input tensor takes its columns of that output (a view). A sibling called
    with any other input computes its own product, so a caller ordering the calls differently gets the same values.
    Each output element is the same dot product either way (the same greedy tokens on SmolLM2, tests/test_cpu_forward.py).

    Everything is installed for the span of the ``with`` block only: the model object is unchanged outside it (so
    transformers' ``generate`` on the same object runs as before). The weights are taken when it is made: make one
    per generation, not one per model for good."""

    def __init__(self, model: torch.nn.Module, groups=(), split: bool = True):
        self.model, self.groups, self.split, self.forwards = model, [list(g) for g in groups], split, {}
        threads = torch.get_num_threads() if split else 1
        self.stashes = []
        for members in self.groups:
            fwds = _group_forwards(members, threads)
            if fwds:
                self.forwards.update(fwds[0])
                self.stashes.append(fwds[1])
        for mod in model.modules():
            if type(mod) is not torch.nn.Linear or mod.weight.device.type != "cpu" or mod in self.forwards:
                continue
            parts = parts_for(mod.out_features, threads)
            if parts > 1 and mod.weight.is_contiguous():
                self.forwards[mod] = _forward(mod, parts)
        self.threads = threads

    def __enter__(self):
        if self.split and torch.get_num_threads() != self.threads:  # threads changed: the blocks no longer match
            self.__init__(self.model, self.groups, self.split)
        for mod, fwd in self.forwards.items():
            mod.__dict__["forward"] = fwd  # an instance attribute shadows the class's forward; no nn.Module hooks
        return self

    def __exit__(self, *exc):
        for mod in self.forwards:
            mod.__dict__.pop("forward", None)
        for stash in self.stashes:
            stash.clear()  # an output no sibling took (an exception mid-layer) is not kept alive
        return False


def _product(x, weight, bias, parts):
    if parts > 1 and x.numel() <= MAX_ROWS * weight.shape[1]:
        return row_linear(x, weight, bias, parts)
    return F.linear(x, weight, bias)


def _forward(mod: torch.nn.Linear, parts: int):
    weight, bias = mod.weight, mod.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != weight.dtype or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        return _product(x, weight, bias, parts)

    return forward


def joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one contiguous tensor whose consecutive slices along dim 0 ``tensors`` are (weights ``[o_i, in]`` or
    biases ``[o_i]``, in order), or None where they are not laid out so."""
    first = tensors[0]
    storage = first.untyped_storage()
    at = first.storage_offset()
    for t in tensors:
        if (t.dim() != first.dim() or t.dim() not in (1, 2) or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype
                or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.storage_offset() != at):
            return None
        at += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    shape, stride = ((rows,), (1,)) if first.dim() == 1 else ((rows, first.shape[1]), (first.shape[1], 1))
    return first.new_empty(0).set_(storage, first.storage_offset(), shape, stride)


def _group_forwards(members: list, threads: int):
    """``({linear: forward}, stash)`` for one group, or None where its weights or biases are not one storage."""
    if any(type(m) is not torch.nn.Linear or m.weight.device.type != "cpu" for m in members):
        return None
    weight = joined([m.weight for m in members])
    has_bias = [m.bias is not None for m in members]
    bias = joined([m.bias for m in members]) if all(has_bias) else None
    if weight is None or (any(has_bias) and bias is None):
        return None
    parts = parts_for(weight.shape[0], threads)
    stash: dict = {}  # the group's last input and output, and the siblings that have not taken their columns
    edges = [0]
    for m in members:
        edges.append(edges[-1] + m.out_features)
    fwds = {}
    for i, m in enumerate(members):
        lo, hi = edges[i], edges[i + 1]
        own = _forward(m, parts_for(m.out_features, threads))
        if i == 0:
            def first(x, lo=lo, hi=hi, own=own):
                if x.dtype != weight.dtype or x.device.type != "cpu":
                    return own(x)
                y = _product(x, weight, bias, parts)
                stash.update(x=x, y=y, left=set(range(1, len(members))))
                return y[..., lo:hi]

            fwds[m] = first
        else:
            def sibling(x, i=i, lo=lo, hi=hi, own=own):
                if stash.get("x") is x and i in stash["left"]:
                    y = stash["y"]
                    stash["left"].discard(i)
                    if not stash["left"]:
                        stash.clear()  # the last sibling: release the output
                    return y[..., lo:hi]
                return own(x)

            fwds[m] = sibling
    return fwds, stash
