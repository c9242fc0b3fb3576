"""The segment layouts: the contract between the methods that fill a layer's KV cache and the kernels that read it.

Segment layouts (one layer; B batch rows, H KV heads, D head_dim, T tokens of capacity):

* ``DenseSeg``     fp16/bf16/fp32 ``k, v: [B, H, T, D]``; sinks, the recent window, the fp16 baseline.
* ``ChannelSeg``   CalibQuant (Sec. 2.1-2.3): K and V both channel-wise. Codes are packed along tokens:
  ``codes: uint8 [B, H, T // per, D]`` with ``per = 8 // bits``; byte ``j`` of channel ``d`` holds token
  ``j * per + i`` in bits ``[i * bits, (i + 1) * bits)``. Scale/zero ``[B, H, NB, D]`` (fp16 or fp32) for token
  blocks of ``block`` tokens (token ``t`` uses block ``t // block``; ``block`` is a multiple of ``per``).
  A scale/zero may have stride 0 on D (the ``value_axis="global"`` ablation). ``calib=(tau1, tau2)`` turns on
  pre-softmax calibration of this segment's logits; ``None`` leaves them alone.
* ``KiviSeg``      KIVI / XQuant: keys channel-wise exactly as above (``block`` = the group of tokens, 32),
  values token-wise: ``v_codes: uint8 [B, H, T, D // per_v]`` packed along channels the same way (byte ``j``
  holds channel ``j * per_v + i``), ``v_scale, v_zero: [B, H, T, D // group]`` (channel group ``c // group``).
  ``v_order`` says which channel order the value codes are packed in: ``"natural"`` (as above) or ``"tiles"``, a
  fixed permutation of each token's channels (:func:`tile_channels`) that puts every 16-channel tensor-core tile of
  the GPU text kernel inside one value group, so the kernel can post-scale (docs/KERNELS.md). Same bytes; readers
  that want the natural order take :func:`natural_values`.

* ``AlignedSeg``   AlignedKV: exact fp16 K/V as bit planes (high byte + two mantissa nibbles) with per-block
  exponent maxima; a decode step reads 8/12/16 bits per (block, channel). Layout in the delimited section at the
  end of this file; the rules and the torch reference of that read (``aligned_attention``) in ``reference.py``.

* ``SkvqSeg``      SKVQ: token-wise channel groups in a per-head reordered channel order (see the class).

Every segment has ``lens: int32 [B]``: row ``b`` holds valid tokens ``[0, lens[b])``; the rest is padding that
must never contribute. Token order inside a segment is irrelevant to attention (keys are cached after RoPE), which
is what lets the cache keep each row's tokens compacted.

Dequantization everywhere is ``x = code * scale + zero`` (CalibQuant Eq. 4); calibration constants (XQuant eta,
SKVQ clipping) are already folded into scale and zero by the method, so kernels never see them.

Every segment class answers ``token_fields()``: its tensors with the token axis at dim 2 and how many tokens one
index along that axis covers; the cache grows, shrinks, copies and counts bytes of any layout through it
(``mmkv/cache/segments.py``). A new layout is a dataclass here plus, for the GPU, a ``kernels.decode.registry``
entry (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

VALID_PACK_BITS = (1, 2, 4, 8)


def per_byte(bits: int) -> int:
    if bits not in VALID_PACK_BITS:
        raise ValueError(f"packable bit-widths are {VALID_PACK_BITS}, got {bits}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along ``dim`` (its size must be a multiple of ``8 // bits``)."""
    per = per_byte(bits)
    dim = dim % codes.dim()
    n = codes.shape[dim]
    if n % per:
        raise ValueError(f"size {n} along dim {dim} is not a multiple of {per} (bits={bits})")
    c = codes.to(torch.uint8).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], n // per, per)
    shifts = torch.arange(per, device=c.device, dtype=torch.uint8) * bits
    packed = (c << shifts).sum(-1, dtype=torch.int32).to(torch.uint8)
    return packed.movedim(-1, dim).contiguous()


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 codes, ``8 // bits`` times longer along ``dim``."""
    per = per_byte(bits)
    dim = dim % packed.dim()
    p = packed.movedim(dim, -1).unsqueeze(-1)
    shifts = torch.arange(per, device=p.device, dtype=torch.uint8) * bits
    mask = (1 << bits) - 1
    c = (p >> shifts) & mask
    c = c.reshape(*c.shape[:-2], c.shape[-2] * per)
    return c.movedim(-1, dim)


def plane_bits(bits: int) -> tuple[int, ...]:
    """Bit-widths of the packed planes that hold ``bits``-bit codes, low bits first: 3-bit codes are a 2-bit plane
    of the low bits plus a 1-bit plane of the high bit (both packable; a kernel ORs them back), the rest one plane."""
    if bits == 3:
        return (2, 1)
    per_byte(bits)
    return (bits,)


def pack_planes(codes: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, ...]:
    """:func:`pack` generalized to :func:`plane_bits` (3-bit codes -> two packed planes)."""
    out, shift = [], 0
    for b in plane_bits(bits):
        out.append(pack((codes.to(torch.uint8) >> shift) & ((1 << b) - 1), b, dim))
        shift += b
    return tuple(out)


def unpack_planes(planes: tuple[torch.Tensor, ...], bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_planes`."""
    codes, shift = None, 0
    for p, b in zip(planes, plane_bits(bits), strict=True):
        c = unpack(p, b, dim) << shift
        codes = c if codes is None else codes | c
        shift += b
    return codes


@dataclass
class DenseSeg:
    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor

    def token_fields(self) -> list[tuple[str, int]]:
        return [("k", 1), ("v", 1)]


@dataclass
class ChannelSeg:
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    bits: int
    block: int
    lens: torch.Tensor
    calib: tuple[float, float] | None = None

    def token_fields(self) -> list[tuple[str, int]]:
        p = per_byte(self.bits)
        return [("k_codes", p), ("k_scale", self.block), ("k_zero", self.block),
                ("v_codes", p), ("v_scale", self.block), ("v_zero", self.block)]


V_ORDERS = ("natural", "tiles")


def tile_channels(d: int) -> torch.Tensor:
    """The value channel order ``"tiles"`` of ``KiviSeg``: stored slot ``(d/8) r + c`` (lane row ``r`` of the GPU text
    kernel, its ``c``-th code) holds natural channel ``16 (c // 2) + 8 (c % 2) + r``, so that the channels the kernel
    puts in one tensor-core tile (16 consecutive logical rows) are 16 consecutive natural channels: inside one group
    for any group that is a multiple of 16. ``int64 [d]``; ``d`` a multiple of 16."""
    if d % 16:
        raise ValueError(f"tile order needs a head_dim that is a multiple of 16, got {d}")
    r = torch.arange(8).repeat_interleave(d // 8)
    c = torch.arange(d // 8).repeat(8)
    return 16 * (c // 2) + 8 * (c % 2) + r


_ORDER_INDEX: dict = {}


def order_index(d: int, device, inverse: bool = False) -> torch.Tensor:
    """``tile_channels(d)`` (or its inverse permutation) on ``device``, made once per (d, device): a decode step
    captured into a CUDA graph that un-permutes values (``natural_values``, the Triton fallback of the text kernel)
    may not copy an index from the host inside the capture; the step's first, eager run leaves it here."""
    key = (d, str(torch.device(device)), inverse)
    idx = _ORDER_INDEX.get(key)
    if idx is None:
        t = tile_channels(d)
        idx = _ORDER_INDEX[key] = (torch.argsort(t) if inverse else t).to(device)
    return idx


def to_tile_order(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked value codes ``[..., D]`` in natural channel order -> tile order (pack them afterwards)."""
    return codes[..., order_index(codes.shape[-1], codes.device)]


def reorder_values(codes: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Unpacked value codes ``[..., D]`` in order ``src`` -> order ``dst`` (``V_ORDERS``)."""
    if src == dst:
        return codes
    if src == "natural":
        return to_tile_order(codes)
    return codes[..., order_index(codes.shape[-1], codes.device, inverse=True)]


def natural_values(seg: KiviSeg) -> KiviSeg:
    """``seg`` with its value codes in the natural channel order: itself if they are, else a repacked copy (a
    reader that does not know the tile order pays one unpack/permute/pack of the codes per call)."""
    if seg.v_order == "natural" or seg.v_codes is None:
        return seg
    codes = reorder_values(unpack(seg.v_codes, seg.v_bits, dim=3), seg.v_order, "natural")
    return dataclasses.replace(seg, v_codes=pack(codes, seg.v_bits, dim=3), v_order="natural")


@dataclass
class KiviSeg:
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_bits: int
    v_bits: int
    block: int
    group: int
    lens: torch.Tensor
    v_order: str = "natural"

    def __post_init__(self):
        if self.v_order not in V_ORDERS:
            raise ValueError(f"KiviSeg.v_order must be one of {V_ORDERS}, got {self.v_order!r}")

    def token_fields(self) -> list[tuple[str, int]]:
        # codes may be absent: a layer that reads another layer's codes (XQuant)
        fields = [("k_codes", per_byte(self.k_bits)), ("k_scale", self.block), ("k_zero", self.block),
                  ("v_codes", 1), ("v_scale", 1), ("v_zero", 1)]
        return [(n, p) for n, p in fields if getattr(self, n) is not None]


# ----------------------------------------------------------------------------------------------------------------
# SKVQ (arXiv:2405.06219 Sec. 3.1): token-wise groups for K and V in reordered channel order.
# The Triton kernel is kernels/decode/skvq.py; the method that fills the layout is mmkv/methods/skvq.py.
# ----------------------------------------------------------------------------------------------------------------

TERNARY = 1.5  # SKVQ's "1.5-bit" values: three levels {0, 1, 2}, stored 5 per byte (log2(3) ~ 1.58, stored 1.6)


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """Codes in {0, 1, 2} along the last axis (``D``) -> uint8 ``[..., ceil(D / 5)]``: byte ``j`` holds channels
    ``5j .. 5j+4`` as base-3 digits, ``byte = sum_i c[5j+i] * 3**i`` (at most 242); the last byte is padded with 0."""
    d = codes.shape[-1]
    nb = -(-d // 5)
    c = codes.to(torch.int32)
    if nb * 5 != d:
        c = torch.cat([c, c.new_zeros(*c.shape[:-1], nb * 5 - d)], -1)
    w = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=c.device)
    return (c.reshape(*c.shape[:-1], nb, 5) * w).sum(-1).to(torch.uint8)


def unpack_ternary(packed: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: uint8 codes ``[..., d]``."""
    p = packed.to(torch.int32).unsqueeze(-1)
    w = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=p.device)
    c = (p // w) % 3
    return c.reshape(*c.shape[:-2], -1)[..., :d].to(torch.uint8)


@dataclass
class SkvqSeg:
    """K and V both per-token quantized in channel groups, channels stored in a per-head reordered order.

    Per token (tensors ``[B, H, T, ...]``, token axis 2, one index per token):

    * ``k_codes``: codes packed along the stored channel order with :func:`pack_planes` (``k_bits`` in 1/2/3/4/8;
      3-bit: ``k_codes`` is the 2-bit plane of the low bits, ``k_hi`` the 1-bit plane, else ``k_hi`` is None).
    * ``v_codes`` / ``v_hi``: the same with ``v_bits``; ``v_bits == 1.5`` is ternary, :func:`pack_ternary`.
    * ``k_scale, k_zero, v_scale, v_zero``: ``[B, H, T, NG]``, one per (token, group), fp16/fp32 or
      ``torch.float8_e4m3fn`` (SKVQ's FP8 option). Clipping is already folded in: ``x = code * scale + zero``.

    Per layer (stored once, not per token; ``[H, D]`` uint8 or int):

    * ``k_perm``/``v_perm``: stored channel ``j`` of head ``h`` holds natural channel ``perm[h, j]``
      (``None``: natural order, i.e. the identity);
    * ``k_gid``/``v_gid``: the group of stored channel ``j``, non-decreasing along ``j`` (groups are contiguous
      runs of variable size after the reorder). ``k_group``/``v_group`` > 0 says every group has exactly that many
      channels (``gid = j // group``: the fixed-size variant, a kernel need not read ``gid``); 0 = variable.

    Dequantization gives ``[B, H, T, D]`` in the natural channel order, which is what attention must see.
    """

    k_codes: torch.Tensor
    k_hi: torch.Tensor | None
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_hi: torch.Tensor | None
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_bits: int
    v_bits: float
    k_perm: torch.Tensor | None
    k_gid: torch.Tensor
    k_group: int
    v_perm: torch.Tensor | None
    v_gid: torch.Tensor
    v_group: int
    lens: torch.Tensor

    def token_fields(self) -> list[tuple[str, int]]:
        names = ("k_codes", "k_hi", "k_scale", "k_zero", "v_codes", "v_hi", "v_scale", "v_zero")
        return [(n, 1) for n in names if getattr(self, n) is not None]

    def layer_fields(self) -> list[str]:
        """Tensors held once per layer (counted once by the cache's byte accounting, never per token)."""
        return [n for n in ("k_perm", "k_gid", "v_perm", "v_gid") if getattr(self, n) is not None]


# =================================================================================================================
# AlignedKV: fp16 K/V stored as bit planes, read with precision alignment (arXiv:2409.16546)
# =================================================================================================================
#
# Layout (``AlignedSeg``; NB = T // block token blocks, all planes channel-major inside a block so that one
# channel's bits of one block are contiguous and can be skipped as a whole):
#   ``k_hi   uint8 [B, H, NB, D, block]``      bits 15..8 of the fp16 word: sign, 5 exponent bits, mantissa 9..8
#   ``k_mid  uint8 [B, H, NB, D, block // 2]`` mantissa bits 7..4; byte i holds token 2i (low nibble), 2i+1 (high)
#   ``k_low  uint8 [B, H, NB, D, block // 2]`` mantissa bits 3..0, packed like ``k_mid``
#   ``k_colmax uint8 [B, H, NB, D]``           largest biased exponent field of the block's valid tokens (K_colmax)
#   ``v_*`` the same for V (``v_colmax``: the same statistic for V; see docs/ALIGNEDKV.md).
# A read of a (block, channel) takes 8 bits (hi), 12 (hi + mid) or 16 (all); the bits not read are filled with
# 100... ("Dynamic Quantization": the midpoint of the truncated interval). Full precision is exact fp16.

ALIGNED_LEVELS = (8, 12, 16)
ALIGNED_RULES = {"keys": ("rule1", "full"), "values": ("paper", "conservative", "full")}


@dataclass
class AlignedSeg:
    k_hi: torch.Tensor
    k_mid: torch.Tensor
    k_low: torch.Tensor
    k_colmax: torch.Tensor
    v_hi: torch.Tensor
    v_mid: torch.Tensor
    v_low: torch.Tensor
    v_colmax: torch.Tensor
    block: int
    lens: torch.Tensor
    keys: str = "rule1"      # "rule1": Rule 1 from q and K_colmax; "full": 16 bits
    values: str = "paper"    # Rule 2 from an approximate top-k estimate of the output: "paper" (the authors' binade
    #                          thresholds), "conservative" (every bit the fp16 result can see); "full": 16 bits
    min_bits: int = 8        # floor on every decision (16: exact reads, the paper's control group)
    force_bits: int = 0      # 8/12/16: read every block at that width (uniform truncation; ablation/benchmark)

    def token_fields(self) -> list[tuple[str, int]]:
        return [(n, self.block) for n in ("k_hi", "k_mid", "k_low", "k_colmax", "v_hi", "v_mid", "v_low", "v_colmax")]


def fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit pattern of fp16 ``x`` as int32 in [0, 65536)."""
    return x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF


def bits_fp16(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp16_bits` (int32 -> int16 narrowing keeps the low 16 bits)."""
    return bits.to(torch.int32).to(torch.int16).view(torch.float16)


def split_planes(x: torch.Tensor, block: int, lens: torch.Tensor | None = None):
    """fp16 ``x [B, H, T, D]`` (T a multiple of ``block``) -> ``(hi, mid, low, colmax)`` of the layout above;
    ``colmax`` is taken over the valid tokens ``[0, lens[b])`` only."""
    b, h, t, d = x.shape
    if t % block or block % 2:
        raise ValueError(f"token count {t} must be a multiple of the (even) block {block}")
    bits = fp16_bits(x).reshape(b, h, t // block, block, d).transpose(-1, -2)  # [B, H, NB, D, block]
    hi = (bits >> 8).to(torch.uint8)
    nib = lambda s: ((bits >> s) & 0xF).reshape(b, h, t // block, d, block // 2, 2)  # noqa: E731
    pack2 = lambda n: (n[..., 0] | (n[..., 1] << 4)).to(torch.uint8)  # noqa: E731
    exp = (bits >> 10) & 31
    if lens is not None:
        valid = torch.arange(t, device=x.device)[None, :] < lens.to(x.device).long()[:, None]
        exp = exp * valid.reshape(b, 1, t // block, 1, block)
    # contiguous: the planes come out of a transposed view, and a kernel reading a strided byte plane would have to
    # copy it first on every call (that copy was 90% of the GPU kernel's time in docs/BENCHMARKS.md's first tables)
    return (hi.contiguous(), pack2(nib(4)).contiguous(), pack2(nib(0)).contiguous(),
            exp.amax(-1).to(torch.uint8).contiguous())


def _unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """``[..., block // 2]`` packed nibbles -> ``[..., block]`` int32 (token 2i low nibble, 2i+1 high)."""
    p = p.to(torch.int32)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def join_planes(hi, mid, low, levels: torch.Tensor | None = None) -> torch.Tensor:
    """Planes -> fp16 ``[B, H, T, D]`` in token order. ``levels [B, H, NB, D]`` (8/12/16, or 0 = not read, taken
    as 16) says how many bits each (block, channel) reads; the rest are filled with 100..."""
    bits = (hi.to(torch.int32) << 8) | (_unpack_nibbles(mid) << 4) | _unpack_nibbles(low)
    if levels is not None:  # keep the planes read, set the first bit not read
        lv = levels.to(torch.int32)[..., None]
        keep = torch.where(lv == 8, 0xFF00, torch.where(lv == 12, 0xFFF0, 0xFFFF))
        fill = torch.where(lv == 8, 0x80, torch.where(lv == 12, 0x8, 0))
        bits = (bits & keep) | fill
    x = bits_fp16(bits)  # [B, H, NB, D, block]
    b, h, nb, d, blk = x.shape
    return x.transpose(-1, -2).reshape(b, h, nb * blk, d)
