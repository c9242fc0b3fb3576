"""CalibQuant (arXiv 2502.14882): 1-8 bit channel-wise quantization of the *visual* KV cache.

* Sec. 2.1: keys **and** values are quantized channel-wise: per (sequence, KV head, channel) min/max over the
  visual span, rounding per Eq. (3), dequantization per Eq. (4): ``x = code * (beta-alpha)/(2^b-1) + alpha``.
* Sec. 2.2 post-scaling: the decode kernel computes ``(q * s) . code + q . z`` and ``(p @ code) * s + sum(p) * z``,
  so codes are never dequantized on the decode path (``kernels/decode/``).
* Sec. 2.3 pre-softmax calibration: the visual logits ``x = q k_deq / sqrt(d)`` of each query in [gamma, delta] are
  mapped by ``g(x) = (delta-gamma+tau1-tau2)/(delta-gamma) * (x-gamma) + gamma - tau1``. Defaults tau1=0, tau2=3
  (the authors' released setting maps [min, max] to [min, max-3]); on for b <= ``calib_max_bits`` (2).
  Text, sink and window logits are not calibrated. Beyond the paper, the slope is floored at 1/4
  (``kernels.reference.CALIB_MIN_RATIO``): for a range under tau2 - tau1 the paper's slope is <= 0 and the softmax
  would rank the tokens backwards; the paper's map is kept for ranges >= 4 (tau2 - tau1) / 3.

Beyond the paper: ``block`` splits long spans (video) into token blocks with their own min/max (0 = one block for
the whole span of each sequence, as in the paper). Range clipping, as the authors' released ``quant`` does (the
paper does not mention it): both ends of each min/max range move toward zero, ``[lo * c, hi * c]``.
``clip=authors`` (the default) takes the released code's constants, ``c_K = 0.5, c_V = 0.3`` at 1 bit and none at
any other bit-width (``AUTHORS_CLIP``); ``clip=off`` is the paper's text (no clipping); ``clip=manual`` reads
``clip_k``/``clip_v``. Why the default: unclipped, a 1-bit range spent on a few outlier channels' extremes rounds
most values to the wrong end; on SmolLM2 the authors' clip cuts the attention output's error 5.5 -> 1.2 and keeps
the fp16 next token 66% of the time instead of 5% (docs/BENCHMARKS.md, CalibQuant clipping), and on the trained
demo VLMs it is the difference between losing and keeping the fp16 answers. Ablations of App. B.3:
``calibrate=false`` and ``value_axis=global`` (one range per head shared by all channels of V).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.layouts import ChannelSeg, pack, per_byte

from .base import Method
from .quant import channel_quantize, pad_tokens

# The released code's (SCALE_K, SCALE_V) per bit-width (calibquant.py / patch_internvl.py: 0.5 and 0.3 when
# BITS_KV == 1, else 1); a bit-width missing here is unclipped there.
AUTHORS_CLIP = {1: (0.5, 0.3)}


@dataclass
class CalibQuant(Method):
    """CalibQuant: channel-wise 1-8 bit K/V with post-scaling and pre-softmax calibration (visual tokens)."""

    name = "calibquant"
    modalities = ("visual",)
    choices = {"bits": (1, 2, 4, 8), "tau1": (0.0, 1.0, 2.0, 3.0), "tau2": (0.0, 1.0, 2.0, 3.0),
               "value_axis": ("channel", "global"), "tau_fit": ("off", "model", "layer"),
               "clip": ("authors", "off", "manual")}
    bits: int = 1
    calibrate: bool = True
    tau1: float = 0.0
    tau2: float = 3.0
    calib_max_bits: int = 2
    block: int = 0
    clip: str = "authors"
    clip_k: float = 1.0
    clip_v: float = 1.0
    value_axis: str = "channel"
    tau_fit: str = "off"  # "model" / "layer": tau1, tau2 from ``mmkv-calibrate calibquant`` (per model / per layer)
    artifact: str = ""  # its folder; empty: the default one for the model

    def __post_init__(self):
        super().__post_init__()
        if self.block < 0 or (self.block and self.block % 8):
            raise ValueError(f"calibquant: block={self.block} must be 0 (whole span) or a positive multiple of 8")
        for name in ("clip_k", "clip_v"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"calibquant: {name} must be in (0, 1]")
        if self.clip != "manual" and (self.clip_k, self.clip_v) != (1.0, 1.0):
            raise ValueError(f"calibquant: clip_k/clip_v are read with clip=manual only (clip={self.clip} sets the "
                             "factors itself; the default, clip=authors, takes the released code's 0.5/0.3 at 1 bit)")

    @property
    def clips(self) -> tuple[float, float]:
        """The (K, V) clip factors this configuration quantizes with."""
        if self.clip == "authors":
            return AUTHORS_CLIP.get(self.bits, (1.0, 1.0))
        if self.clip == "off":
            return 1.0, 1.0
        return self.clip_k, self.clip_v

    def bind(self, adapter) -> CalibQuant:
        """With ``tau_fit``, the fitted tau of the model's artifact replace the spec's (a missing or foreign
        artifact raises, naming the command that makes it)."""
        if self.tau_fit == "off":
            return self
        from .artifacts import load

        art = load(self.artifact or None, self.name, adapter)
        bound = replace(self, tau1=float(art.meta["tau1"]), tau2=float(art.meta["tau2"]))
        if self.tau_fit == "layer":  # read by for_layer; not a parameter, so not in the spec string
            bound._layer_tau = [tuple(map(float, row)) for row in art.tensors["layer_tau"].tolist()]
        return bound

    def for_layer(self, layer_idx: int, num_layers: int) -> CalibQuant:
        table = getattr(self, "_layer_tau", None)
        if table is None:
            return self
        return replace(self, tau1=table[layer_idx][0], tau2=table[layer_idx][1])

    @property
    def calib(self) -> tuple[float, float] | None:
        if self.calibrate and self.bits <= self.calib_max_bits:
            return (self.tau1, self.tau2)
        return None

    def quantize(self, k, v, lens):
        lens = lens.to(torch.int32)
        per = per_byte(self.bits)
        span = max(int(lens.max().item()), 1)
        block = self.block or -(-span // per) * per
        k = pad_tokens(k[:, :, :span], block)
        v = pad_tokens(v[:, :, :span], block)
        clip_k, clip_v = self.clips
        kc, ks, kz = channel_quantize(k, lens, self.bits, block, clip_k)
        vc, vs, vz = channel_quantize(v, lens, self.bits, block, clip_v, self.value_axis == "global")
        return ChannelSeg(pack(kc, self.bits, dim=2), ks, kz, pack(vc, self.bits, dim=2), vs, vz,
                          self.bits, block, lens, self.calib)
