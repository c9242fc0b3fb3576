"""KIVI (Liu et al., 2024): keys quantized per channel in blocks of ``group`` tokens, values per token in groups of
``group`` channels, the most recent tokens kept in fp16 (the residual R; mmkv's window). Paper defaults g=32, R=128.

Bytes per token per KV head: keys ``D*bits/8 + 2*2*D/group`` (codes, plus an fp16 scale and zero per channel per
block of ``group`` tokens), values ``D*bits/8 + 2*2*D/group``. With fp16 scale/zero that is ``bits + 32/group``
bits per element: 3.0 for 2-bit g=32 (``docs/CACHE.md`` gives the whole formula with sinks and window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.decode.plan import kivi_value_order
from kernels.layouts import KiviSeg, pack, reorder_values

from .base import Method
from .quant import channel_quantize, pad_tokens, token_group_quantize


@dataclass
class KIVI(Method):
    """KIVI: per-channel keys, per-token values, fp16 residual window (Liu et al., 2024)."""

    name = "kivi"
    modalities = ("visual", "text")
    choices = {"bits": (1, 2, 4, 8), "group": (16, 32, 64, 128)}
    bits: int = 2
    group: int = 32

    @property
    def flush_block(self) -> int:
        return self.group

    def check(self, head_dim: int, num_layers: int) -> None:
        if head_dim % self.group:
            raise ValueError(f"kivi: group={self.group} must divide the model's head_dim={head_dim}")

    def quantize(self, k, v, lens):
        lens = lens.to(torch.int32)
        k = pad_tokens(k, self.group)
        v = pad_tokens(v, self.group)
        kc, ks, kz = channel_quantize(k, lens, self.bits, self.group)
        vc, vs, vz = token_group_quantize(v, self.bits, self.group)
        # values in the order the GPU kernel post-scales from (flush is off the hot path); same bytes either way
        order = kivi_value_order(self.bits, self.bits, self.group, self.group, v.shape[-1], v.device)
        return KiviSeg(pack(kc, self.bits, dim=2), ks, kz, pack(reorder_values(vc, "natural", order), self.bits, dim=3),
                       vs, vz, self.bits, self.bits, self.group, self.group, lens, order)
