"""Which side of a 1-bit CalibQuant visual cache costs the demo VLMs' answers: keys, values or both (issue 28).

    python -m eval.studies.calibquant_sides --side k --model demo-llava --n 12 --tasks caption --device cpu \\
        --spec "visual=calibquant:bits=1" --out results/cq_sides_k.json

Runs ``eval.studies.demo_quality`` with CalibQuant's 1-bit quantizer replaced for the run: ``--side k`` keeps the
keys at 1 bit (the spec's clip) and the values near exact, ``v`` the reverse, ``kv`` both at 1 bit, ``none`` neither
(the control: it must score as fp16). Both sides are stored in one 8-bit ``ChannelSeg``; a 1-bit side is re-encoded
from its dequantized values, which take two levels per channel, the 8-bit range's two ends, so the re-encoding
changes nothing but fp16 rounding. The 1-bit calibration stays on the logits where the keys are 1-bit (it
corrects their range) and is off where they are near exact. Other bit-widths run unchanged.
"""

from __future__ import annotations

import argparse

import torch

from kernels.layouts import ChannelSeg, pack
from kernels.reference import dequantize_segment
from mmkv.methods import calibquant
from mmkv.methods.quant import channel_quantize, pad_tokens

SIDES = ("k", "v", "kv", "none")
_QUANTIZE = calibquant.CalibQuant.quantize  # the real quantizer, whatever main() puts in its place for a run


def one_side(method, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, side: str) -> ChannelSeg:
    """The visual segment with only ``side`` at ``method``'s 1-bit codes, the rest at 8 bits (module docstring)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    kd, vd = dequantize_segment(_QUANTIZE(method, k, v, lens))
    span = kd.shape[2]
    lens32 = lens.to(torch.int32)
    k8 = kd if "k" in side else k[:, :, :span].float()
    v8 = vd if "v" in side else v[:, :, :span].float()
    kc, ks, kz = channel_quantize(pad_tokens(k8, span), lens32, 8, span)
    vc, vs, vz = channel_quantize(pad_tokens(v8, span), lens32, 8, span)
    return ChannelSeg(pack(kc, 8, dim=2), ks, kz, pack(vc, 8, dim=2), vs, vz, 8, span, lens32,
                      method.calib if "k" in side else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.studies.calibquant_sides", description=__doc__.split("\n\n")[0],
                                 epilog="Every other argument goes to python -m eval.studies.demo_quality (its --help "
                                        "lists them).")
    ap.add_argument("--side", required=True, choices=SIDES,
                    help="which side stays at 1 bit: k, v, kv (both) or none (the control)")
    args, rest = ap.parse_known_args(argv)
    side = args.side

    def quantize(self, k, v, lens):
        return one_side(self, k, v, lens, side) if self.bits == 1 else _QUANTIZE(self, k, v, lens)

    from .demo_quality import main as quality

    calibquant.CalibQuant.quantize = quantize
    try:
        return quality(rest)
    finally:
        calibquant.CalibQuant.quantize = _QUANTIZE


if __name__ == "__main__":
    raise SystemExit(main())
