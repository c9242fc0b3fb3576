"""SKVQ (arXiv:2405.06219): channel reorder + clipped dynamic group quantization, sliding fp16 window,
attention sinks, optional FP8 scales.

* Clipped dynamic quantization with channel reorder (Sec. 3.1, Eq. 1-3): every token's K and V are quantized per
  group of channels (min/max per token and group, Eq. 2) after a per-head channel permutation that puts channels
  with similar statistics into the same group (KMeans on calibration data, ``mmkv-calibrate skvq``); each group's
  range is shrunk by a clipping ratio alpha chosen offline to minimize the attention output's MSE (Eq. 3). Groups
  have variable sizes whose average is ``group`` (Table 1: 128; Table 3/4: 32, 64). The calibration and the
  layout keep every permutation inside one KV head (the paper's code reorders across the whole hidden size),
  so a group never exceeds ``head_dim``: with head_dim 64, ``group=128`` is one group of 64 channels per head
  (the reorder then changes nothing and the metadata costs what group 64 costs).
* Sliding window (Sec. 3.2): the spec's ``window=`` (SKVQ uses 128) most recent tokens stay fp16; ``sinks=``
  (SKVQ: 5, i.e. ``sinks=5`` in the spec) first tokens stay fp16 for good (the "attention sink" filter rule).
  Tokens leave the window ``block`` at a time (1 = exactly per token as in Algorithm 1; 32 by default so that
  quantizing costs one small batch of launches per 32 decode steps).
* ``k_bits`` in 1/2/3/4/8, ``v_bits`` in 1/1.5/2/3/4/8: 1.5 is three levels {0, 1, 2} packed 5 per byte
  (``ceil(D/5)`` bytes per token and head: 1.625 bits per element at D=64, counted as stored).
* ``fp8``: scale and zero stored as FP8 E4M3 (Table 3), 1 byte each instead of 2.
* Ablation switches (Table 3): ``reorder=off`` uses natural-order groups of exactly ``group`` channels,
  ``clip=off`` uses alpha = 1. With both off nothing is calibrated and no artifact is read: that is the RTN
  baseline (per-token groups, asymmetric).
* ``groups=fixed``: after the reorder, every group holds exactly ``group`` channels (the kernel then needs no
  per-channel group id); ``variable`` (default) keeps KMeans' cluster sizes.

Bits per element of the quantized tokens (per token and head, D = head_dim, ng = D / min(group, D) groups):
``k_bits + v_bits(stored) + 2 * ng * (16 or 8) * 2 / (2 * D)`` averaged over K and V, e.g. K2V2 g64 fp16
scales: 2 + 32/64 = 2.5; K2V1.5 g64 FP8: (2 + 1.625)/2 + 16/64 = 2.0625. The per-layer permutation and group
ids (4 x H x D bytes) are held once per layer and counted in ``cache.nbytes()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.layouts import SkvqSeg

from . import artifacts
from .base import Method
from .skvq_quant import quantize_side

METHOD = "skvq"


def bits_key(bits: float) -> str:
    return "1.5" if bits == 1.5 else str(int(bits))


def table_names(kind: str, group: int, variant: str, bits: float) -> dict[str, str]:
    """Artifact tensor names. ``variant``: ``nat`` (natural order), ``var`` (reorder, KMeans sizes), ``fix``
    (reorder, equal sizes). Permutation and group ids are per (kind, group); alpha also per variant and bits."""
    return {"perm": f"{kind}.perm.g{group}", "gid": f"{kind}.gid.g{group}",
            "alpha": f"{kind}.alpha.{variant}.g{group}.b{bits_key(bits)}"}


@dataclass
class SKVQ(Method):
    """SKVQ: reordered, clipped per-token group quantization of K and V, fp16 window and sinks (Duanmu et al., 2024)."""

    name = METHOD
    modalities = ("text",)
    needs_artifact = True
    choices = {"k_bits": (1, 2, 3, 4, 8), "v_bits": (1, 1.5, 2, 3, 4, 8), "group": (16, 32, 64, 128),
               "groups": ("variable", "fixed"), "block": (1, 8, 16, 32, 64)}
    k_bits: int = 2
    v_bits: float = 2.0
    group: int = 128
    clip: bool = True
    reorder: bool = True
    fp8: bool = False
    groups: str = "variable"
    block: int = 32
    artifact: str = ""

    def __post_init__(self):
        super().__post_init__()
        self.v_bits = float(self.v_bits)

    @property
    def flush_block(self) -> int:
        return self.block

    @property
    def calibrated(self) -> bool:
        """Whether this configuration reads an artifact (RTN = reorder off and clip off reads none)."""
        return self.clip or self.reorder

    def variant(self) -> str:
        if not self.reorder:
            return "nat"
        return "fix" if self.groups == "fixed" else "var"

    def check(self, head_dim: int, num_layers: int) -> None:
        g = min(self.group, head_dim)
        if head_dim % g or head_dim % 8:
            raise ValueError(f"skvq: group={self.group} needs a head_dim that is a multiple of it and of 8 "
                             f"(head_dim={head_dim})")

    def bind(self, adapter) -> Method:
        bound = dataclasses.replace(self)
        bound._shape = (adapter.num_kv_heads, adapter.head_dim)
        bound._tables = None
        if not self.calibrated:
            return bound
        art = artifacts.load(self.artifact or None, METHOD, adapter)
        g = min(self.group, adapter.head_dim)
        want = {}
        for kind, bits in (("k", self.k_bits), ("v", self.v_bits)):
            names = table_names(kind, g, self.variant(), bits)
            for role, key in names.items():
                if role == "alpha" and not self.clip:
                    continue
                if role in ("perm", "gid") and not self.reorder:
                    continue
                if key not in art.tensors:
                    have = sorted({k.split(".", 2)[2] for k in art.tensors if ".alpha." in k})
                    raise ValueError(
                        f"skvq: the artifact for {adapter.name!r} has no {key!r} (it holds {have}); make one with: "
                        f"{artifacts.calibrate_command(METHOD, adapter.name)} --group {g} "
                        f"--k-bits {bits_key(self.k_bits)} --v-bits {bits_key(self.v_bits)}")
                want[f"{kind}_{role}"] = art.tensors[key]
        bound._tables = want
        return bound

    def for_layer(self, layer_idx: int, num_layers: int) -> Method:
        tables = getattr(self, "_tables", None)
        if self.calibrated and tables is None:
            raise ValueError("skvq: reorder/clip read a calibration artifact: build the cache with "
                             "MMKVCache.for_model(spec, adapter) (or use skvq:reorder=off,clip=off for RTN)")
        lay = SKVQLayer(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SKVQ)})
        lay.layer_idx = layer_idx
        lay.tables = {k: t[layer_idx] for k, t in (tables or {}).items()}
        return lay

    def quantize(self, k, v, lens):
        lay = self.for_layer(0, 1)
        return lay.quantize(k, v, lens)


@dataclass
class SKVQLayer(SKVQ):
    """One layer's SKVQ tables (never registered; made by ``SKVQ.for_layer``)."""

    def for_layer(self, layer_idx: int, num_layers: int) -> Method:
        return self

    def _side(self, kind: str, d: int, h: int, device):
        """(perm or None, gid uint8 [H, D], fixed group size or 0, ng, alpha or None) on ``device``."""
        cache = self.__dict__.setdefault("_dev", {})
        key = (kind, str(device))
        if key in cache:
            return cache[key]
        g = min(self.group, d)
        ng = d // g
        t = self.tables
        perm = t.get(f"{kind}_perm") if self.reorder and ng > 1 else None  # one group: order changes nothing
        fixed = g if (not self.reorder or self.groups == "fixed" or ng == 1) else 0
        if fixed:
            gid = (torch.arange(d) // g).to(torch.uint8).expand(h, d).contiguous()
        else:
            gid = t[f"{kind}_gid"].to(torch.uint8)
        alpha = t.get(f"{kind}_alpha") if self.clip else None
        out = (None if perm is None else perm.to(device, torch.uint8), gid.to(device), fixed, ng,
               None if alpha is None else alpha.to(device, torch.float32))
        cache[key] = out
        return out

    def quantize(self, k, v, lens):
        b, h, t, d = k.shape
        kp, kg, kf, ng, ka = self._side("k", d, h, k.device)
        vp, vg, vf, _, va = self._side("v", d, h, k.device)
        kc, kh, ks, kz = quantize_side(k, self.k_bits, kp, kg, ng, kf, ka, self.fp8)
        vc, vh, vs, vz = quantize_side(v, self.v_bits, vp, vg, ng, vf, va, self.fp8)
        return SkvqSeg(kc, kh, ks, kz, vc, vh, vs, vz, self.k_bits, self.v_bits,
                       kp, kg, kf, vp, vg, vf, lens.to(torch.int32))
