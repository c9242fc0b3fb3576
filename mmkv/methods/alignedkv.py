"""AlignedKV (arXiv:2409.16546): an exact fp16 cache read at the precision each addend needs.

Storage ("Dynamic Quantization", Fig. 6 and 8): K and V stay fp16, split into a high-byte plane (sign, 5 exponent
bits, 2 mantissa bits) and two mantissa-nibble planes, channel-major inside blocks of ``block`` tokens, plus per
(block, channel) the largest exponent (K_colmax, "Quantization of K-Cache"; the same statistic is kept for V so that
a V block's width is known before its bytes are read). Nothing is lost in storage: ``min_bits=16`` reads it back
bit for bit.

Reading (decode attention, ``kernels/decode/alignedkv.py``): per (block, channel) 8, 12 or 16 bits, the rest
filled with 100...:

* keys, Rule 1 (addend precision alignment): the addends q_d k_td of a logit are aligned to the coarsest one,
  estimated from |q_d| and K_colmax;
* values, Rule 2 (result precision alignment): the addends p_t v_td of an output channel are aligned to the
  precision of the result, estimated from an approximate top-k of the scores (the top token of every block; its V
  read at 8 bits). ``values=paper`` (default): the authors' binade thresholds (their value kernel: a block whose
  largest p lies one binade below the alignment point reads 12 bits, two or more below 8; the estimate is of
  sum p|v|); ``values=conservative``: every bit the fp16 result can see (``10 - gap`` mantissa bits for an addend
  ``gap`` binades below it; output error ~1e-3 of fp16 rounding, more bits read); ``values=full`` reads V at 16 bits;
* GQA: the query heads of a KV head read the same bytes, so each block reads the widest width any of them needs.

``block`` is the token granularity of the decision and of the layout (one channel of a 64-token block is one
32-byte memory sector per nibble plane, the unit a GPU can skip). ``min_bits`` floors every decision (16: the
paper's control group, exact reads).

Memory: 16 bits per element plus 8 bits per (block, channel) for K_colmax and V_colmax = ``16 + 8/block`` bits
(16.125 at block 64): **no memory saving**; the method reduces the bytes a decode step reads (paper: ~12 of 16 bits,
Fig. 9). Values beyond the fp16 range (|x| > 65504, e.g. from a bf16 model) cannot be stored and raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.layouts import AlignedSeg, split_planes

from .base import Method
from .quant import pad_tokens


@dataclass
class AlignedKV(Method):
    """AlignedKV: exact fp16 cache in bit planes; decode reads 8/12/16 bits per block by precision alignment."""

    name = "alignedkv"
    modalities = ("visual", "text")
    choices = {"block": (32, 64, 128), "keys": ("rule1", "full"), "values": ("paper", "conservative", "full"),
               "min_bits": (8, 12, 16)}
    block: int = 64
    keys: str = "rule1"
    values: str = "paper"
    min_bits: int = 8

    @property
    def flush_block(self) -> int:
        return self.block

    def check(self, head_dim: int, num_layers: int) -> None:
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"alignedkv: the kernel needs a power-of-two head_dim >= 16, got {head_dim}")

    def quantize(self, k, v, lens):
        lens = lens.to(torch.int32)
        planes = []
        for name, x in (("K", k), ("V", v)):
            x16 = pad_tokens(x, self.block).to(torch.float16)
            if not bool(torch.isfinite(x16).all()):
                raise ValueError(f"alignedkv: {name} has values outside the fp16 range (|x| > 65504) or non-finite; "
                                 "the cache stores exact fp16")
            planes += split_planes(x16, self.block, lens)
        return AlignedSeg(*planes, block=self.block, lens=lens, keys=self.keys, values=self.values,
                          min_bits=self.min_bits)
