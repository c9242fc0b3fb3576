"""AQUA-KV's backbone quantizers (Sec. 3.3 "Backbone quantization", Sec. 4.1 "Alternative quantizers").

* ``uniform``  — per-token, round-to-nearest, min/max over groups of ``group`` consecutive channels (fp16 scale and
  zero per group, ``x = code * scale + zero``): the paper's "Quant" (per-token, group 64);
* ``hadamard`` — each group of ``group`` channels is first rotated by a random-sign Hadamard transform
  ``y = H_g diag(s) x / sqrt(g)`` (the QuaRot idea: an orthogonal rotation spreads outliers over the group so the
  min/max range is set by the bulk of the values), quantized as ``uniform``, rotated back after dequantization.
  The signs come from ``seed``; the matrix is never stored (``H_g`` is Sylvester's, the signs are regenerated);
* ``higgs``    — HIGGS (arXiv:2411.17525) as AQUA-KV's reference code runs it (``aquakv/quantizers.py``,
  ``HiggsQuantizer``): a token's row of ``C`` channels is cut into Hadamard groups of ``g = min(1024, largest
  power of two dividing C)``; each group is scaled by its L2 norm ``n`` (stored fp16) and rotated by Sylvester's
  unnormalized ``H_g``, ``y = H_g x / n``, so its coordinates have mean square 1; consecutive pairs of ``y`` are
  rounded to the nearest point of an EDEN 2-D grid fitted to N(0, 1) pairs (``eden_grids``: 16 points at 2 bits
  a value, 64 at 3, 256 at 4); dequantization is ``x = H_g (n * grid[idx]) / g``. No signs (the reference
  applies ``hadamard_transform`` without a random diagonal). A pair's grid index of ``2b`` bits is stored as two
  ``b``-bit codes (low bits on the pair's first channel), so the codes pack like the other quantizers' and the
  ``group`` knob plays no part; the reference pads ``C`` up to 1024 instead of taking a smaller group (192
  channels would cost 1024 stored values a token on SmolLM2).

``uniform``/``hadamard`` codes of a token are packed along channels (``kernels.layouts.pack_planes``: 2 and 4 bits
one plane, 3 bits a 2-bit plane plus a 1-bit plane), so ``C`` channels take ``C * bits / 8`` bytes plus
``4 * C / group`` for the fp16 scale and zero: ``bits + 32 / group`` bits per element (2.5 at 2 bits, group 64).
``higgs`` stores no zero and one fp16 norm per Hadamard group: ``bits + 16 / g`` (2.25 at 2 bits, ``g = 64``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kernels.layouts import pack_planes, unpack_planes

from .eden_grids import GRIDS
from .quant import minmax_codes

QUANTIZERS = ("uniform", "hadamard", "higgs")
HIGGS_MAX_GROUP = 1024  # the paper's and the reference code's Hadamard group (Sec. 4.1)
PAIRS_PER_CHUNK = 1 << 16  # nearest-point search in chunks: [pairs, 256] scores stay at 64 MiB


def higgs_group(channels: int) -> int:
    """The Hadamard group for a row of ``channels``: 1024, or the largest power of two dividing the row."""
    return min(HIGGS_MAX_GROUP, channels & -channels)


@functools.lru_cache(maxsize=32)
def _sylvester(group: int, device: str) -> torch.Tensor:
    """Sylvester's Hadamard matrix of +-1 entries (symmetric, ``H @ H = group * I``), fp32."""
    if group & (group - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two group, got {group}")
    h = torch.ones(1, 1)
    while h.shape[0] < group:  # H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


@functools.lru_cache(maxsize=8)
def _grid(bits: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The EDEN 2-D grid for ``bits`` per value, ``[2^(2 bits), 2]`` fp32, and its squared norms."""
    g = torch.tensor(GRIDS[bits], dtype=torch.float32, device=device)
    return g, g.square().sum(-1)


def nearest_points(pairs: torch.Tensor, bits: int, points: bool = False):
    """Index of the grid point nearest each row of ``pairs [N, 2]`` (argmax of ``2 p.g - |g|^2``), uint8;
    ``points=True``: ``(index, the chosen points [N, 2] fp32)``."""
    grid, norms = _grid(bits, str(pairs.device))
    if pairs.device.type == "cpu":  # one compiled loop (kernels/ops/nearest_c.py); this torch code is its reference
        from kernels.decode.cpu_native import library
        from kernels.ops.nearest_c import nearest2

        fast = nearest2(library(), pairs, grid, points)
        if fast is not None:
            return fast
    out = torch.empty(pairs.shape[0], dtype=torch.uint8, device=pairs.device)
    for i in range(0, pairs.shape[0], PAIRS_PER_CHUNK):
        chunk = pairs[i : i + PAIRS_PER_CHUNK]
        out[i : i + PAIRS_PER_CHUNK] = torch.addmm(norms, chunk, grid.T, beta=-1, alpha=2).argmax(-1)
    return (out, grid[out.long()]) if points else out


def _pack_pairs(idx: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """The planes ``pack_planes`` makes of each pair's two codes ``(idx & mask, idx >> bits)``, from the pair
    indices ``idx [..., P]`` (uint8). At 2 and 4 bits a byte holds whole pairs, so the packing is the index itself
    (4 bits) or two indices a byte (2 bits): the same bytes without the codes' interleaved copy."""
    if bits == 4:
        return (idx.contiguous(),)
    if bits == 2 and idx.shape[-1] % 2 == 0:
        return (idx[..., 0::2] | (idx[..., 1::2] << 4),)
    mask = (1 << bits) - 1
    return pack_planes(torch.stack([idx & mask, idx >> bits], -1).flatten(-2), bits, dim=-1)


@functools.lru_cache(maxsize=32)
def _rotation(group: int, seed: int, device: str) -> torch.Tensor:
    """``diag(s) H_g / sqrt(g)`` in fp32: ``x @ R`` rotates, ``y @ R.T`` undoes it (R is orthogonal)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (group,), generator=g).float() * 2 - 1
    return (signs[:, None] * _sylvester(group, "cpu") / math.sqrt(group)).to(device)


@dataclass
class Codes:
    """One tensor's quantized form: packed code planes ``[..., C * b / 8]`` and fp16 ``scale, zero [..., C / g]``
    (``higgs``: ``scale`` the group norms, ``zero`` None)."""

    planes: tuple[torch.Tensor, ...]
    scale: torch.Tensor
    zero: torch.Tensor | None


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
        """``x [..., C]`` -> codes (min/max per token and group, round to nearest; ``higgs``: nearest grid point)."""
        if self.kind == "higgs":
            return self._higgs_encode(x)
        xg = self._groups(x)
        if self.kind == "hadamard":
            xg = xg @ _rotation(self.group, self.seed, str(x.device))
        codes, scale, zero = minmax_codes(xg, xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True), self.bits)
        return Codes(pack_planes(codes.flatten(-2), self.bits, dim=-1), scale.squeeze(-1), zero.squeeze(-1))

    def decode(self, c: Codes) -> torch.Tensor:
        """Codes -> fp32 ``[..., C]``."""
        if self.kind == "higgs":
            return self._higgs_decode(c)
        codes = unpack_planes(c.planes, self.bits, dim=-1).float()
        xg = torch.addcmul(c.zero.float()[..., None], codes.reshape(*codes.shape[:-1], -1, self.group),
                           c.scale.float()[..., None])
        if self.kind == "hadamard":
            xg = xg @ _rotation(self.group, self.seed, str(xg.device)).T
        return xg.flatten(-2)

    def encode_decode(self, x: torch.Tensor) -> tuple[Codes, torch.Tensor]:
        """``(encode(x), decode(encode(x)))``: Alg. 2's flush needs both. ``higgs`` rebuilds from the grid indices it
        just chose instead of unpacking the planes it just packed (the same indices, so the same values)."""
        if self.kind != "higgs":
            codes = self.encode(x)
            return codes, self.decode(codes)
        codes, points = self._higgs_encode(x, with_points=True)
        return codes, self._higgs_unrotate(points, codes.scale)

    def _higgs_encode(self, x: torch.Tensor, with_points: bool = False):
        c = x.shape[-1]
        g = higgs_group(c)
        if g < 2:
            raise ValueError(f"higgs quantizes pairs of values: {c} channels are odd")
        xg = x.float().reshape(*x.shape[:-1], c // g, g)
        scale = xg.norm(dim=-1).to(torch.float16)  # stored; the codes are taken against the stored value
        s = scale.float()[..., None]
        y = (xg @ _sylvester(g, str(x.device))) / torch.where(s > 0, s, torch.ones_like(s))
        found = nearest_points(y.reshape(-1, 2), self.bits, points=with_points)
        idx = (found[0] if with_points else found).view(*x.shape[:-1], c // 2)
        out = Codes(_pack_pairs(idx, self.bits), scale, None)
        return (out, found[1].view(*x.shape[:-1], c // 2, 2)) if with_points else out

    def _higgs_decode(self, c: Codes) -> torch.Tensor:
        codes = unpack_planes(c.planes, self.bits, dim=-1).long()
        return self._higgs_rebuild(codes[..., 0::2] | (codes[..., 1::2] << self.bits), c.scale)

    def _higgs_rebuild(self, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Grid indices ``[..., C / 2]`` (int64) and group norms -> fp32 ``[..., C]``."""
        return self._higgs_unrotate(_grid(self.bits, str(idx.device))[0][idx], scale)

    def _higgs_unrotate(self, points: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Grid points ``[..., C / 2, 2]`` and group norms -> fp32 ``[..., C]``."""
        n = 2 * points.shape[-2]
        g = higgs_group(n)
        y = points.reshape(*points.shape[:-2], n // g, g) * scale.float()[..., None]
        return (y @ _sylvester(g, str(y.device)) / g).flatten(-2)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def bits_per_element(self, channels: int | None = None) -> float:
        """Stored bits per value; ``higgs`` needs the row width ``channels`` (its norms are per Hadamard group)."""
        if self.kind == "higgs":
            if channels is None:
                raise ValueError("higgs: bits per element depend on the row width; pass channels")
            return self.bits + 16 / higgs_group(channels)
        return self.bits + 32 / self.group
