"""The decoder's q|k|v and gate|up projections as one GEMM each on CUDA (and q|k|v on the CPU, in mmkv's own
forwards only: ``cpu_groups``, ``share_cpu_storage``).

Why: transformers' Llama-type layers (Llama, Mistral, Qwen2, InternLM2 as Llama) run q, k and v, and gate and up,
as separate GEMMs over the same input. On the H100 (cuBLAS, InternVL2.5-8B's language model, CUDA-graph replay)
one layer's seven GEMMs took 200.7 us at 139 rows and 165.6 at 11; with q|k|v and gate|up concatenated, 188.0 and
159.9 (docs/results/h100_budget_step.txt). The k|v GEMMs are too small to fill the GPU on their own. From a few
hundred rows on, cuBLAS runs the wide gate|up GEMM worse than the two halves, so inputs of more than ``MAX_ROWS``
rows take separate GEMMs (the weights' row blocks).

How, without touching transformers' forward code: ``q_proj`` (``gate_proj``) becomes the first slice of a group that
holds the concatenated weight as its parameter; its call runs the one GEMM and returns its own columns, and keeps
the output until its siblings ``k_proj``/``v_proj`` (``up_proj``) are called with the very same input tensor, which
take their columns of it (views: ``.view(heads)`` on them works, their last axis is contiguous). A sibling called
with any other input computes its own GEMM from its rows of the weight, so a caller that orders the calls
differently gets the same values, only not faster. Not for sharded models (accelerate's hooks sit on the modules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
# one GEMM only up to this many rows: cuBLAS picks worse kernels for the wide gate|up GEMM from a few hundred rows
# (H100, per layer, separate vs grouped: 278 rows 252.4 vs 240.1 us; 556 rows 418.4 vs 502.7; 835 rows 617.3 vs 638.7)
MAX_ROWS = 320


class _Group:
    """Concatenated weight (and bias) of sibling projections, and the output waiting for the siblings."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, bounds: list[tuple[int, int]]):
        self.weight, self.bias, self.bounds = weight, bias, bounds
        self.pending: tuple | None = None  # (input, output, sibling indices still to take their columns)


class GroupedLinear(nn.Module):
    """Projection ``i`` of a group: ``nn.Linear``-compatible (``weight``/``bias`` are its rows of the group's
    tensors). The group's parameters are registered on projection 0 only, so ``parameters()`` counts them once."""

    def __init__(self, group: _Group, i: int):
        super().__init__()
        lo, hi = group.bounds[i]
        self.group, self.i, self.lo, self.hi = group, i, lo, hi
        if i == 0:
            self.fused_weight = group.weight
            self.fused_bias = group.bias
        self.in_features, self.out_features = group.weight.shape[1], hi - lo

    @property
    def weight(self) -> torch.Tensor:
        return self.group.weight[self.lo:self.hi]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.group.bias is None else self.group.bias[self.lo:self.hi]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        if x.numel() > MAX_ROWS * x.shape[-1]:  # many rows (prefill, large batches): separate GEMMs
            if self.i == 0:
                g.pending = None
            return F.linear(x, self.weight, self.bias)
        if self.i == 0:
            y = F.linear(x, g.weight, g.bias)
            g.pending = (x, y, set(range(1, len(g.bounds))))
            return y[..., self.lo:self.hi]
        p = g.pending
        if p is not None and p[0] is x and self.i in p[2]:
            p[2].discard(self.i)
            if not p[2]:
                g.pending = None  # the last sibling: release the output
            return p[1][..., self.lo:self.hi]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.i} of one GEMM"


def _mergeable(linears: list) -> bool:
    first = linears[0]
    return (all(type(m) is nn.Linear for m in linears)
            and all(m.weight.device == first.weight.device and m.weight.dtype == first.weight.dtype
                    and m.in_features == first.in_features and (m.bias is None) == (first.bias is None)
                    for m in linears))


def _candidates(model: nn.Module, device_type: str, groups=GROUPS):
    """``(holder, names, linears)`` of every decoder layer's q|k|v and gate|up ``nn.Linear`` projections on
    ``device_type`` that could run as one GEMM; nothing for a sharded model or another layer layout (fused
    ``qkv_proj``, bias on some projections only)."""
    if getattr(model, "hf_device_map", None):
        return
    from .sharding import decoder_layers

    try:
        _, layers = decoder_layers(model)
    except ValueError:
        return
    for layer in layers:
        for holder_name, names in groups:
            holder = getattr(layer, holder_name, None)
            linears = [getattr(holder, n, None) for n in names] if holder is not None else []
            if (linears and all(m is not None for m in linears) and _mergeable(linears)
                    and linears[0].weight.device.type == device_type):
                yield holder, names, linears


def fuse_projections(model: nn.Module, device_type: str = "cuda") -> int:
    """Group every decoder layer's q|k|v and gate|up ``nn.Linear`` projections on ``device_type`` into one GEMM each;
    returns the number of groups made. Leaves a sharded model, other layer layouts and already grouped layers
    alone."""
    made = 0
    for holder, names, linears in list(_candidates(model, device_type)):
        with torch.no_grad():
            weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
            bias = (None if linears[0].bias is None
                    else nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False))
        edges = [0]
        for m in linears:
            edges.append(edges[-1] + m.out_features)
        group = _Group(weight, bias, list(zip(edges[:-1], edges[1:])))
        for i, n in enumerate(names):
            setattr(holder, n, GroupedLinear(group, i))
        made += 1
    return made


def cpu_groups(model: nn.Module) -> list[list[nn.Linear]]:
    """Each decoder layer's q|k|v projections on the CPU, in call order (see :func:`_candidates`). Only attention's:
    on a 2-core CPU one q|k|v GEMM beat three at every prompt length measured (one SmolLM2 layer: 4.0 -> 3.9 ms at
    512 tokens, 16.2 -> 14.1 at 2k, 66.2 -> 57.6 at 8k), where one gate|up GEMM was slower at 512 tokens (18.7 ->
    19.5 ms) and no faster than the in-place MLP (``mmkv.models.cpu_forward``) at 8k."""
    return [linears for _, _, linears in _candidates(model, "cpu", GROUPS[:1])]


def share_cpu_storage(model: nn.Module) -> int:
    """Lay each CPU group's weights (and biases) back to back in one storage, in place: the modules stay the same
    ``nn.Linear`` objects holding the same values (their parameters become row slices of the joined tensor), so
    transformers' own forward is unchanged, and mmkv's forwards can run each group as one GEMM
    (``kernels.ops.row_linear.SplitLinears``). Returns the groups joined."""
    made = 0
    with torch.no_grad():
        for linears in cpu_groups(model):
            for name in ("weight", "bias"):
                parts = [getattr(m, name) for m in linears]
                if parts[0] is None:
                    continue
                joined = torch.cat([p.detach() for p in parts])
                at = 0
                for p in parts:
                    p.data = joined[at:at + p.shape[0]]
                    at += p.shape[0]
            made += 1
    return made
