"""AQUA-KV's backbone quantizers (Sec. 3.3 "Backbone quantization", Sec. 4.1 "Alternative quantizers").

Both are per-token, round-to-nearest, min/max uniform quantizers over groups of ``group`` consecutive channels
(fp16 scale and zero per group, ``x = code * scale + zero``), applied to the *residual* the predictors leave:

* ``uniform``  — groups of the channels as they are (the paper's "Quant", per-token, group 64);
* ``hadamard`` — each group is first rotated by a random-sign Hadamard transform ``y = H_g diag(s) x / sqrt(g)``
  (the QuaRot/HIGGS idea: an orthogonal rotation spreads outliers over the group so the min/max range is set by
  the bulk of the values, not by one channel), quantized, and rotated back after dequantization. The signs come
  from ``seed``; the matrix is never stored (``H_g`` is Sylvester's, the signs are regenerated).

The paper's HIGGS also replaces the uniform grid by a lattice fitted to Gaussian data and QuaRot/HIGGS use groups
of 1024; here the rotation group equals the quantization group and the grid stays uniform (docs/AQUAKV.md).

Codes of a token are packed along channels (``kernels.layouts.pack_planes``: 2 and 4 bits one plane, 3 bits a
2-bit plane plus a 1-bit plane), so ``C`` channels take ``C * bits / 8`` bytes plus ``4 * C / group`` for the
fp16 scale and zero: ``bits + 32 / group`` bits per element (2.5 at 2 bits, group 64).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kernels.layouts import pack_planes, unpack_planes

from .quant import minmax_codes

QUANTIZERS = ("uniform", "hadamard")


@functools.lru_cache(maxsize=32)
def _rotation(group: int, seed: int, device: str) -> torch.Tensor:
    """``diag(s) H_g / sqrt(g)`` in fp32: ``x @ R`` rotates, ``y @ R.T`` undoes it (R is orthogonal)."""
    if group & (group - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two group, got {group}")
    h = torch.ones(1, 1)
    while h.shape[0] < group:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (group,), generator=g).float() * 2 - 1
    return (signs[:, None] * h / math.sqrt(group)).to(device)


@dataclass
class Codes:
    """One tensor's quantized form: packed code planes ``[..., C * b / 8]`` and fp16 ``scale, zero [..., C / g]``."""

    planes: tuple[torch.Tensor, ...]
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(frozen=True)
class Quantizer:
    bits: int
    group: int = 64
    kind: str = "uniform"
    seed: int = 0

    def __post_init__(self):
        if self.bits not in (2, 3, 4):
            raise ValueError(f"aquakv: bits={self.bits} is not supported; allowed values: [2, 3, 4]")
        if self.kind not in QUANTIZERS:
            raise ValueError(f"aquakv: quantizer={self.kind!r} is not supported; allowed values: {list(QUANTIZERS)}")

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[-1]
        if c % self.group:
            raise ValueError(f"{c} channels are not a multiple of the group {self.group}")
        return x.float().reshape(*x.shape[:-1], c // self.group, self.group)

    def encode(self, x: torch.Tensor) -> Codes:
        """``x [..., C]`` -> codes (min/max per token and group, round to nearest)."""
        xg = self._groups(x)
        if self.kind == "hadamard":
            xg = xg @ _rotation(self.group, self.seed, str(x.device))
        codes, scale, zero = minmax_codes(xg, xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True), self.bits)
        return Codes(pack_planes(codes.flatten(-2), self.bits, dim=-1), scale.squeeze(-1), zero.squeeze(-1))

    def decode(self, c: Codes) -> torch.Tensor:
        """Codes -> fp32 ``[..., C]``."""
        codes = unpack_planes(c.planes, self.bits, dim=-1).float()
        xg = torch.addcmul(c.zero.float()[..., None], codes.reshape(*codes.shape[:-1], -1, self.group),
                           c.scale.float()[..., None])
        if self.kind == "hadamard":
            xg = xg @ _rotation(self.group, self.seed, str(xg.device)).T
        return xg.flatten(-2)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def bits_per_element(self) -> float:
        return self.bits + 32 / self.group
