"""FP16: tokens stay as the model computed them (the baseline every other method is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.layouts import DenseSeg

from .base import Method


@dataclass
class FP16(Method):
    """No quantization: K and V are kept in the model's 16-bit dtype."""

    name = "fp16"
    modalities = ("visual", "text")

    def quantize(self, k, v, lens):
        return DenseSeg(k.contiguous(), v.contiguous(), lens.to(torch.int32))


