"""XQuant ("Pushing Low-Bit KV Cache Quantization to the Limit with Cross-Layer Compression"): KIVI at 1-2 bits with data-free calibration and cross-layer codes.

* Base (Sec. 4.1): KIVI layout — keys per channel in blocks of ``group`` tokens, values per token in groups of
  ``group`` channels, the recent window in fp16.
* Per-layer bit-widths: key layers ``[0, kq)`` at 2 bits, ``[kq, L)`` at 1 bit; values likewise with ``vq``.
* Data-free calibration (Eq. 9-13): codes come from the ordinary min/max quantizer; dequantization uses
  ``z' = z + eta*s*(2^B-1)`` and ``s' = (1-2*eta)*s`` with ``eta1`` for 1-bit and ``eta2`` for 2-bit layers. It is
  folded into the stored scale and zero when a block is flushed; the codes are untouched.
* Cross-layer compression (Sec. 3.3.3-3.3.4, G = 2, dominant layer k = 0): from layer ``km`` (keys) / ``vm``
  (values) on, an odd layer stores only its own scale and zero-point and reads the codes of the layer before it
  (Algorithm 1's ``l mod 2 == 0`` test; the odd layer quantizes at its dominant layer's bit-width). The paper's
  Algorithm 1 indexes the tuples so that the odd layer would take the other layer's scale/zero: the text and
  Fig. 1 are the intended method, implemented here. ``share=average`` is the weighted-average variant of
  Sec. 3.3.3 (``X_Q = round(gamma0 * codes_even + (1 - gamma0) * codes_odd)``, both layers then read X_Q with
  their own scale/zero), kept for the ablation of Table 5.

On SmolLM2 and Qwen2.5-Coder-0.5B adjacent layers' codes agree only at chance, so a layer that shares its
partner's codes reconstructs worse than its group means; at ~1.4 bits not sharing beats sharing there
(docs/BENCHMARKS.md, "Why XQuant trails KIVI-2"). The defaults stay the paper's classic configuration.

``XQuant.equivalent_bits`` follows App. A (shared layers count 0 bits, scales/zeros not counted): 1.375 for the paper's
classic 32-layer config ``kq=30, vq=2, km=32, vm=16``. The cache's ``effective_bits`` reports the true figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.decode.plan import kivi_value_order
from kernels.layouts import KiviSeg, pack, per_byte, reorder_values, unpack

from .base import Method
from .quant import channel_quantize, token_group_quantize


def calibrate(scale: torch.Tensor, zero: torch.Tensor, eta: float, bits: int):
    """Eq. 12-13: fold the data-free calibration into scale and zero."""
    if eta == 0:
        return scale, zero
    s = scale.float()
    return ((1 - 2 * eta) * s).to(scale.dtype), (zero.float() + eta * s * ((1 << bits) - 1)).to(zero.dtype)


@dataclass
class XQuant(Method):
    """XQuant: 1-2 bit KIVI layout, data-free endpoint calibration, cross-layer code sharing (< 1.4 bits)."""

    name = "xquant"
    modalities = ("text",)
    choices = {"group": (16, 32, 64, 128), "share": ("dominant", "average")}
    kq: int = 30
    vq: int = 2
    km: int = 32
    vm: int = 16
    eta1: float = 1 / 6
    eta2: float = 0.045
    group: int = 32
    share: str = "dominant"
    gamma0: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        for name in ("eta1", "eta2"):
            if not 0.0 <= getattr(self, name) < 0.5:
                raise ValueError(f"xquant: {name}={getattr(self, name)} must be in [0, 0.5)")
        if not 0.0 <= self.gamma0 <= 1.0:
            raise ValueError(f"xquant: gamma0={self.gamma0} must be in [0, 1]")

    @property
    def flush_block(self) -> int:
        return self.group

    def check(self, head_dim: int, num_layers: int) -> None:
        if head_dim % self.group:
            raise ValueError(f"xquant: group={self.group} must divide the model's head_dim={head_dim}")
        self.check_layers(num_layers)

    def check_layers(self, num_layers: int) -> None:
        for name in ("kq", "vq", "km", "vm"):
            v = getattr(self, name)
            if not 0 <= v <= num_layers:
                raise ValueError(f"xquant: {name}={v} does not fit a model with {num_layers} layers "
                                 f"(use 0..{num_layers})")

    def plan(self, num_layers: int) -> list[dict]:
        """Per layer: bits of K and V, and whether each reads the previous layer's codes."""
        rows = []
        for l in range(num_layers):
            row = {}
            for kind, q, m in (("k", self.kq, self.km), ("v", self.vq, self.vm)):
                shared = l >= m and l % 2 == 1
                bits = 2 if (l - 1 if shared else l) < q else 1
                row[f"{kind}_bits"], row[f"{kind}_shared"] = bits, shared
            rows.append(row)
        return rows

    def equivalent_bits(self, n_layers: int) -> float:
        """App. A: average bits per element over K and V, shared layers counting 0 (scales and zeros not counted)."""
        self.check_layers(n_layers)
        plan = self.plan(n_layers)
        total = sum((0 if p["k_shared"] else p["k_bits"]) + (0 if p["v_shared"] else p["v_bits"]) for p in plan)
        return total / (2 * n_layers)

    def for_layer(self, layer_idx: int, num_layers: int) -> Method:
        self.check_layers(num_layers)
        return XQuantLayer(parent=self, **self.plan(num_layers)[layer_idx], layer_idx=layer_idx)

    def quantize(self, k, v, lens):
        raise TypeError("xquant quantizes per layer: the cache calls for_layer() first")


@dataclass
class XQuantLayer(XQuant):
    """One layer's share of an XQuant config (never registered; made by ``XQuant.for_layer``)."""

    parent: XQuant | None = None
    layer_idx: int = 0
    k_bits: int = 2
    v_bits: int = 2
    k_shared: bool = False
    v_shared: bool = False

    def __post_init__(self):
        p = self.parent
        for f in dataclasses.fields(XQuant):
            setattr(self, f.name, getattr(p, f.name))

    @property
    def share_from(self) -> int | None:
        return self.layer_idx - 1 if (self.k_shared or self.v_shared) else None

    def without_partner(self, partner) -> Method:
        # same bit-widths as planned, but its own codes: cross-layer sharing needs both layers to hold codes
        return dataclasses.replace(self, k_shared=False, v_shared=False)

    def for_layer(self, layer_idx: int, num_layers: int) -> Method:
        return self

    def _eta(self, bits: int) -> float:
        return self.eta1 if bits == 1 else self.eta2

    def quantize(self, k, v, lens):
        lens = lens.to(torch.int32)
        kc, ks, kz = channel_quantize(k, lens, self.k_bits, self.group)
        vc, vs, vz = token_group_quantize(v, self.v_bits, self.group)
        ks, kz = calibrate(ks, kz, self._eta(self.k_bits), self.k_bits)
        vs, vz = calibrate(vs, vz, self._eta(self.v_bits), self.v_bits)
        order = kivi_value_order(self.k_bits, self.v_bits, self.group, self.group, v.shape[-1], v.device)
        v_codes = pack(reorder_values(vc, "natural", order), self.v_bits, dim=3)
        return KiviSeg(pack(kc, self.k_bits, dim=2), ks, kz, v_codes, vs, vz, self.k_bits, self.v_bits, self.group,
                       self.group, lens, order)

    def quantize_block(self, layer, row: int, offset: int, k, v):
        seg = self.quantize(k, v, torch.tensor([k.shape[2]], dtype=torch.int32, device=k.device))
        for kind, dim in (("k", 2), ("v", 3)):
            if not getattr(self, f"{kind}_shared"):
                continue
            if self.share == "average":
                self._average_into_partner(layer, row, offset, seg, kind, dim)
            seg = dataclasses.replace(seg, **{f"{kind}_codes": None})
        return seg

    def _average_into_partner(self, layer, row: int, offset: int, seg: KiviSeg, kind: str, dim: int) -> None:
        """Sec. 3.3.3 weighted average: both layers of the pair then read round(g0*c_even + (1-g0)*c_odd)."""
        bits = getattr(self, f"{kind}_bits")
        n = seg.lens[0].item()
        per = per_byte(bits) if kind == "k" else 1
        dst = getattr(layer.partner.text, f"{kind}_codes")[row : row + 1, :, offset // per : (offset + n) // per]
        odd = unpack(getattr(seg, f"{kind}_codes"), bits, dim)
        if kind == "v":  # both layers' codes position by position: the partner's value order
            odd = reorder_values(odd, seg.v_order, layer.partner.text.v_order)
        odd = odd.float()
        even = unpack(dst, bits, dim).to(odd.device).float()  # the partner may sit on another GPU
        avg = torch.round(self.gamma0 * even + (1 - self.gamma0) * odd).clamp_(0, (1 << bits) - 1)
        dst.copy_(pack(avg.to(torch.uint8), bits, dim))

    def resolve(self, seg, layer):
        if seg.k_codes is not None and seg.v_codes is not None:
            return seg
        src = layer.partner.text
        if seg.v_codes is None:  # the partner's codes, in the partner's value order
            seg = dataclasses.replace(seg, v_codes=src.v_codes, v_order=src.v_order)
        return dataclasses.replace(seg, k_codes=seg.k_codes if seg.k_codes is not None else src.k_codes)
