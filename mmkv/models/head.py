"""The output projection padded to a multiple of 64 rows on CUDA.

A vocabulary whose size is not a multiple of 8 (InternLM2, the language model of InternVL2.5: 92,553) leaves the
logits' row stride unaligned, and cuBLAS then falls back to an old, slow GEMM for the LM head. Measured on the H100
(``random:internvl2.5-8b``, one decode step, eager under the profiler): ``cutlass_75_tensorop_f16_s1688gemm`` took
1.75 ms at batch 139 and 0.48 ms at batch 11, where reading the 758 MB weight takes ~0.25 ms. Padded with zero
rows, cuBLAS picks a Hopper kernel (``nvjet_sm90``, 0.29 ms at batch 139; docs/BENCHMARKS.md). The logits are
returned as a view of the first ``V`` columns, so the values and the shape are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MULTIPLE = 64


class PaddedHead(nn.Module):
    """``nn.Linear``-compatible LM head whose weight holds ``pad`` extra zero rows (``out_features`` is the real
    vocabulary)."""

    def __init__(self, head: nn.Linear, multiple: int = MULTIPLE):
        super().__init__()
        V, E = head.weight.shape
        pad = -V % multiple
        w = head.weight.detach()
        self.weight = nn.Parameter(torch.cat([w, w.new_zeros(pad, E)]), requires_grad=False)
        b = head.bias
        self.bias = None if b is None else nn.Parameter(torch.cat([b.detach(), b.new_zeros(pad)]),
                                                         requires_grad=False)
        self.in_features, self.out_features = E, V

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)[..., : self.out_features]


def pad_lm_head(model, multiple: int = MULTIPLE) -> bool:
    """Swap ``model``'s output projection for a ``PaddedHead`` where that pays: a CUDA ``nn.Linear`` whose row count
    is not a multiple of ``multiple`` and whose weight is not tied to the input embedding (padding a tied weight
    would hold a second copy of the table), on one device (a sharded model's head carries accelerate's device hook,
    which a swap would drop). Returns whether it did."""
    if getattr(model, "hf_device_map", None):
        return False
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.weight.device.type != "cuda" or head.out_features % multiple == 0:
        return False
    emb = model.get_input_embeddings()
    if emb is not None and emb.weight.data_ptr() == head.weight.data_ptr():
        return False
    model.set_output_embeddings(PaddedHead(head, multiple))
    return True
