"""Pure-torch references: the specification every Triton kernel in ``kernels/`` is tested against.

It is also the CPU path and the *extend* path (a later chat turn, chunked scoring) of ``mmkv/attention.py``.
The layouts it reads are defined in ``layouts.py``. Dequantization everywhere is ``x = code * scale + zero``
(CalibQuant Eq. 4).
"""

from __future__ import annotations

import math

import torch

from .layouts import (
    ALIGNED_RULES,
    TERNARY,
    AlignedSeg,
    ChannelSeg,
    DenseSeg,
    KiviSeg,
    SkvqSeg,
    bits_fp16,
    join_planes,
    natural_values,
    unpack,
    unpack_planes,
    unpack_ternary,
)


def dequant_channel(codes, scale, zero, bits: int, block: int) -> torch.Tensor:
    """Channel-wise codes packed along tokens -> fp32 ``[B, H, T, D]``."""
    c = unpack(codes, bits, dim=2).float()
    s = scale.float().repeat_interleave(block, dim=2)[:, :, : c.shape[2]]
    z = zero.float().repeat_interleave(block, dim=2)[:, :, : c.shape[2]]
    return c * s + z


def dequant_token_groups(codes, scale, zero, bits: int, group: int) -> torch.Tensor:
    """Token-wise group codes packed along channels -> fp32 ``[B, H, T, D]``."""
    c = unpack(codes, bits, dim=3).float()
    s = scale.float().repeat_interleave(group, dim=3)
    z = zero.float().repeat_interleave(group, dim=3)
    return c * s + z


# Layouts defined in their own modules register their reference dequantizer here: type -> seg -> (K, V) fp32
# [B, H, T, D] in the model's natural channel order (what attention must see).
DEQUANTIZERS: dict = {}
# Layouts whose decode step reads less than full precision (AlignedKV) also register how: type ->
# (q [B, Hq, D], seg, sm_scale) -> (out [B, Hq, D] fp32, lse [B, Hq]). ``decode_reference`` uses it.
DECODE_READS: dict = {}


def dequantize_segment(seg) -> tuple[torch.Tensor, torch.Tensor]:
    """Any segment -> fp32 (K, V) ``[B, H, T, D]``. The reference path only; kernels never call this."""
    if isinstance(seg, DenseSeg):
        return seg.k.float(), seg.v.float()
    if isinstance(seg, ChannelSeg):
        k = dequant_channel(seg.k_codes, seg.k_scale, seg.k_zero, seg.bits, seg.block)
        v = dequant_channel(seg.v_codes, seg.v_scale, seg.v_zero, seg.bits, seg.block)
        return k, v
    if isinstance(seg, KiviSeg):
        seg = natural_values(seg)
        k = dequant_channel(seg.k_codes, seg.k_scale, seg.k_zero, seg.k_bits, seg.block)
        v = dequant_token_groups(seg.v_codes, seg.v_scale, seg.v_zero, seg.v_bits, seg.group)
        return k, v
    if type(seg) in DEQUANTIZERS:
        return DEQUANTIZERS[type(seg)](seg)
    raise TypeError(f"unknown segment type {type(seg).__name__}")


# The smallest slope calibration may give a query's logits. The paper's map [gamma, delta] -> [gamma - tau1,
# delta - tau2] has slope (width + tau1 - tau2) / width, which is <= 0 for a range under tau2 - tau1 (the softmax
# then ranks the tokens backwards) and near 0 just above it (attention goes flat). CalibQuant fixes tau for
# InternVL2.5-8B, whose ranges are wide; mmkv runs any model. Flooring the slope keeps the paper's map wherever
# its slope is >= 1/4 (ranges >= 4 (tau2 - tau1) / 3: 4 logits at the default tau), is continuous and monotone in
# the range, never inverts or ties two logits, and compresses at most 4x: more than the stretch 1-bit keys cause
# in the lens (quantized / exact range 3.091 / 1.302 = 2.4x on demo-llava, layer 0, head 0), where the paper's
# slope would be 0.03. Every kernel that calibrates (decode/segment_kernel.py, decode/gluon/reduce.py) uses it.
CALIB_MIN_RATIO = 0.25


def calibrate_logits(x: torch.Tensor, valid: torch.Tensor, tau1: float, tau2: float) -> torch.Tensor:
    """CalibQuant Sec. 2.3: map each query's logits in [gamma, delta] linearly onto [gamma - tau1, delta - tau2],
    with the slope floored at ``CALIB_MIN_RATIO`` (then delta goes to gamma - tau1 + width / 4).

    ``x``: ``[..., T]`` scaled logits of one segment; ``valid``: broadcastable bool mask. gamma/delta are the min/max
    over the valid entries of the last axis. Where delta <= gamma (one token, or all equal) the logits are left as
    they are: there is no range to compress.
    """
    big = torch.finfo(x.dtype).max
    gamma = torch.where(valid, x, big).amin(-1, keepdim=True)
    delta = torch.where(valid, x, -big).amax(-1, keepdim=True)
    width = delta - gamma
    ok = width > 0
    paper = (width + tau1 - tau2) / torch.where(ok, width, 1.0)
    ratio = torch.where(ok, paper.clamp_min(CALIB_MIN_RATIO), 1.0)
    shift = torch.where(ok, gamma - tau1, gamma)
    return torch.where(ok, ratio * (x - gamma) + shift, x)


def _grouped_logits(q: torch.Tensor, seg, sm_scale: float):
    """Logits with query heads grouped under their KV head: ``q [B, Hq, Tq, D]`` ->
    ``(x [B, H, G, Tq, T], valid [B, 1, 1, 1, T], v [B, H, T, D])``; K/V are never expanded per query head."""
    k, v = dequantize_segment(seg)
    b, hq, tq, d = q.shape
    h = k.shape[1]
    qg = q.float().reshape(b, h, hq // h, tq, d)
    x = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * sm_scale
    t = torch.arange(k.shape[2], device=q.device)
    valid = (t[None, :] < seg.lens.to(q.device)[:, None].long())[:, None, None, None, :]
    calib = getattr(seg, "calib", None)
    if calib is not None:
        x = calibrate_logits(x, valid, *calib)
    return x, valid, v


def segment_logits(q: torch.Tensor, seg, sm_scale: float):
    """Scaled (and, where the segment asks, calibrated) logits of ``q [B, Hq, Tq, D]`` against one segment.

    Returns ``(logits [B, Hq, Tq, T], valid [B, 1, 1, T], v [B, Hq, T, D])`` in fp32, GQA heads expanded.
    """
    x, valid, v = _grouped_logits(q, seg, sm_scale)
    b, h, g, tq, t = x.shape
    return x.reshape(b, h * g, tq, t), valid[:, 0], v.repeat_interleave(g, dim=1)


def attention_over_segments(q: torch.Tensor, segments: list, sm_scale: float | None = None):
    """Reference attention of ``q [B, Hq, Tq, D]`` over all tokens of all segments (no causal mask: history is fully
    visible). Returns ``(out [B, Hq, Tq, D] fp32, lse [B, Hq, Tq] fp32)``; rows with no valid token give out 0 and
    lse -inf, so they merge away.
    """
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    logits, values = [], []
    for seg in segments:
        x, valid, v = _grouped_logits(q, seg, sm_scale)
        logits.append(x.masked_fill(~valid, float("-inf")))
        values.append(v)
    x = torch.cat(logits, dim=-1)
    v = torch.cat(values, dim=2)
    lse = torch.logsumexp(x, dim=-1)
    p = torch.exp(x - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.matmul(p, v.unsqueeze(2))
    b, h, g, tq, d = out.shape
    return out.reshape(b, h * g, tq, d), lse.reshape(b, h * g, tq)


def decode_attention_ref(q: torch.Tensor, segments: list, sm_scale: float | None = None) -> torch.Tensor:
    """Decode step: ``q [B, Hq, D]`` -> ``out [B, Hq, D]`` (fp32)."""
    out, _ = attention_over_segments(q.unsqueeze(2), segments, sm_scale)
    return out.squeeze(2)


def decode_reference(q: torch.Tensor, segments: list, sm_scale: float | None = None):
    """Decode step as the kernels compute it: ``q [B, Hq, D]`` -> ``(out [B, Hq, D], lse [B, Hq])`` fp32. Segments
    with a ``DECODE_READS`` entry are read their own way and merged by log-sum-exp; the rest as above."""
    own = [s for s in segments if s is not None and type(s) in DECODE_READS]
    rest = [s for s in segments if s is not None and type(s) not in DECODE_READS]
    outs, lses = [], []
    if rest or not own:
        o, l = attention_over_segments(q.unsqueeze(2), rest, sm_scale) if rest else (None, None)
        if o is None:
            o, l = q.new_zeros(q.shape, dtype=torch.float32), q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        else:
            o, l = o.squeeze(2), l.squeeze(2)
        outs.append(o)
        lses.append(l)
    for s in own:
        o, l = DECODE_READS[type(s)](q, s, sm_scale)
        outs.append(o)
        lses.append(l)
    if len(outs) == 1:
        return outs[0], lses[0]
    lse = torch.logsumexp(torch.stack(lses).float(), dim=0)
    return merge_partials(outs, lses), lse


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Log-sum-exp merge of partial attention results over disjoint key sets."""
    lse = torch.stack(lses).float()
    m = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - m).nan_to_num(0.0)
    return sum(w_i.unsqueeze(-1) * o.float() for w_i, o in zip(w, outs))


# SKVQ (arXiv:2405.06219 Sec. 3.1): dequantization of ``SkvqSeg``.


def skvq_codes(lo: torch.Tensor, hi: torch.Tensor | None, bits: float, d: int) -> torch.Tensor:
    """Stored code planes of one side -> integer codes ``[B, H, T, d]`` in stored channel order."""
    if bits == TERNARY:
        return unpack_ternary(lo, d)
    planes = (lo,) if hi is None else (lo, hi)
    return unpack_planes(planes, int(bits), dim=3)


def dequant_skvq_side(lo, hi, scale, zero, bits, perm, gid) -> torch.Tensor:
    h, d = gid.shape
    c = skvq_codes(lo, hi, bits, d).float()
    idx = gid.long().to(c.device)[None, :, None, :].expand(c.shape[0], h, c.shape[2], d)
    x = c * scale.float().gather(3, idx) + zero.float().gather(3, idx)
    if perm is None:
        return x
    out = torch.empty_like(x)
    out.scatter_(3, perm.long().to(x.device)[None, :, None, :].expand_as(x), x)
    return out


def dequant_skvq(seg: SkvqSeg) -> tuple[torch.Tensor, torch.Tensor]:
    k = dequant_skvq_side(seg.k_codes, seg.k_hi, seg.k_scale, seg.k_zero, seg.k_bits, seg.k_perm, seg.k_gid)
    v = dequant_skvq_side(seg.v_codes, seg.v_hi, seg.v_scale, seg.v_zero, seg.v_bits, seg.v_perm, seg.v_gid)
    return k, v


DEQUANTIZERS[SkvqSeg] = dequant_skvq


# AlignedKV (arXiv:2409.16546): the precision-aligned read of ``AlignedSeg`` (layout in ``layouts.py``).

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def exponent_of(x: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) of fp32 values from their exponent field (exact, no log); 0 gives -127."""
    return ((x.float().abs().view(torch.int32) >> 23) & 0xFF) - 127


def _fp16_exp(colmax: torch.Tensor) -> torch.Tensor:
    """Upper-bound exponent of a block: |x| < 2**(e + 1) with e = max(field, 1) - 15 (subnormals as 2**-14)."""
    return colmax.to(torch.int32).clamp(min=1) - 15


def level_of_gap(gap: torch.Tensor) -> torch.Tensor:
    """Bits to read for an addend ``gap`` binades below the reference precision: it needs ``10 - gap`` mantissa
    bits, and the planes offer 2 (8 bits), 6 (12) or 10 (16)."""
    return torch.where(gap < 4, 16, torch.where(gap < 8, 12, 8))


def key_levels(qg: torch.Tensor, k_colmax: torch.Tensor) -> torch.Tensor:
    """Rule 1 for q.K: per query head ``qg [B, H, G, D]`` and block ``k_colmax [B, H, NB, D]`` ->
    ``[B, H, G, NB, D]``. Addend d of a logit is below ``2**(E(q_d) + e_d + 1)``; every addend is aligned to the
    coarsest one (the largest, whose 10 mantissa bits fix the precision of the sum)."""
    add = exponent_of(qg)[:, :, :, None, :] + _fp16_exp(k_colmax)[:, :, None] + 1
    return level_of_gap(add.amax(-1, keepdim=True) - add)


def value_levels(logp_max: torch.Tensor, o_est: torch.Tensor, v_colmax: torch.Tensor) -> torch.Tensor:
    """Rule 2 for p.V, conservative (``values=conservative``): ``logp_max [B, H, G, NB]`` = log2 of the block's largest probability, ``o_est [B, H, G, D]``
    the output estimate, ``v_colmax [B, H, NB, D]`` -> ``[B, H, G, NB, D]``. Addend p_t v_td is below
    ``2**(floor(log2 p) + e_d + 1)``; it is aligned to the precision of the result, ``E(o_est_d)``."""
    add = torch.floor(logp_max).to(torch.int32)[..., None] + _fp16_exp(v_colmax)[:, :, None] + 1
    return level_of_gap(exponent_of(o_est)[:, :, :, None, :] - add)


def value_levels_paper(logp_max: torch.Tensor, o_abs: torch.Tensor, v_colmax: torch.Tensor) -> torch.Tensor:
    """Rule 2 for p.V as the authors' value kernel applies it (``values=paper``, the default): ``logp_max
    [B, H, G, NB]`` = log2 of the block's largest probability, ``o_abs [B, H, G, D]`` the estimate of sum_t p_t |v_td|
    (:func:`output_estimate` with ``absolute=True``), ``v_colmax [B, H, NB, D]`` -> ``[B, H, G, NB, D]``.

    The alignment point of channel d is the probability at which an addend p v_td with |v_td| of the block's largest
    binade lands one binade below the estimate: ``T_d = E(o_abs_d) - 1 - e_d`` (log2 units; the ``- 1`` turns the
    sum of |p v| into a bound on |sum p v|, as the authors' code does). A block whose largest probability p has
    ``log2 p > T_d - 1`` reads 16 bits, ``T_d - 2 < log2 p <= T_d - 1`` reads 12, ``log2 p <= T_d - 2`` reads 8.
    These binade thresholds are the authors' (AlignedQuant/AlignedKV, ``extension/csrc/V_cache.cu``: their fp16
    comparison of the score's bit pattern with ``T`` at integer ``T`` is exactly ``p <= 2**(T - 2)`` /
    ``p <= 2**(T - 1)``); the paper itself gives no numbers. It reads fewer bits than the conservative rule: an
    addend one binade below the result keeps 6 mantissa bits (needs 9), two or more below keeps 2."""
    t = exponent_of(o_abs)[:, :, :, None, :] - 1 - _fp16_exp(v_colmax)[:, :, None]
    gap = t.float() - logp_max[..., None]
    return torch.where(gap < 1, 16, torch.where(gap < 2, 12, 8))


def output_estimate(x: torch.Tensor, lse2: torch.Tensor, v_hi: torch.Tensor, block: int,
                    absolute: bool = False) -> torch.Tensor:
    """O_est of Rule 2 from an approximate top-k: the highest-scoring token of every block (k = number of blocks;
    exactly the top-k unless a block holds two of the k largest scores), its V read at 8 bits. ``absolute``: the
    sign bit is dropped, estimating sum p |v| (the ``paper`` rule, as the authors' code does).

    ``x [B, H, G, T]`` log2-unit logits (-inf where invalid), ``lse2 [B, H, G]``, ``v_hi [B, H, NB, D, block]``.
    """
    b, h, g, t = x.shape
    nb = t // block
    xmax, arg = x.reshape(b, h, g, nb, block).max(-1)
    hi = v_hi[:, :, None].expand(b, h, g, nb, v_hi.shape[3], block)  # widened after the gather: a few bytes, not V
    cand = hi.gather(-1, arg[..., None, None].expand(b, h, g, nb, v_hi.shape[3], 1)).squeeze(-1).to(torch.int32)
    if absolute:
        cand = cand & 0x7F
    vhat = bits_fp16((cand << 8) | 0x80).float()  # [B, H, G, NB, D]
    w = torch.exp2(xmax - lse2[..., None]).nan_to_num(0.0)
    return (w[..., None] * vhat).sum(3)


def _apply_floor(levels: torch.Tensor, rule: str, seg: AlignedSeg) -> torch.Tensor:
    if seg.force_bits:
        return torch.full_like(levels, seg.force_bits)
    if rule == "full":
        return torch.full_like(levels, 16)
    return levels.clamp(min=seg.min_bits)


def aligned_attention(q: torch.Tensor, seg: AlignedSeg, sm_scale: float | None = None):
    """The precision-aligned decode read of one segment (what the Triton kernel computes).

    ``q [B, Hq, D]`` -> ``(out [B, Hq, D] fp32, lse [B, Hq] natural log, k_levels, v_levels)``; the levels
    ``uint8 [B, H, NB, D]`` are the bits read per (block, channel), 0 for blocks without a valid token. GQA: the G
    query heads of a KV head read the same bytes, so a block reads the largest width any of them needs.
    Steps: K levels (Rule 1) -> logits on the aligned K -> softmax statistics -> O_est -> V levels (Rule 2,
    ``seg.values``: ``paper`` or ``conservative``) -> ``p @ V`` on the aligned V.
    """
    if seg.keys not in ALIGNED_RULES["keys"] or seg.values not in ALIGNED_RULES["values"]:
        raise ValueError(f"alignedkv: keys must be one of {ALIGNED_RULES['keys']} and values one of "
                         f"{ALIGNED_RULES['values']}, got {seg.keys!r}, {seg.values!r}")
    b, hq, d = q.shape
    h, nb, blk = seg.k_hi.shape[1], seg.k_hi.shape[2], seg.block
    t, g = nb * blk, hq // h
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qg = q.float().reshape(b, h, g, d)
    valid = torch.arange(t, device=q.device)[None, :] < seg.lens.to(q.device).long()[:, None]  # [B, T]
    blk_valid = valid.reshape(b, nb, blk).any(-1)[:, None, :, None]  # [B, 1, NB, 1]
    lk = _apply_floor(key_levels(qg, seg.k_colmax).amax(2), seg.keys, seg)
    k = join_planes(seg.k_hi, seg.k_mid, seg.k_low, lk).float()
    x = torch.einsum("bhgd,bhtd->bhgt", qg, k) * (sm_scale * _LOG2E)
    x = x.masked_fill(~valid[:, None, None, :], float("-inf"))
    m = x.amax(-1).clamp(min=-1e30)
    lse2 = m + torch.log2(torch.exp2(x - m[..., None]).sum(-1))  # -inf for a row without tokens
    if seg.values in ("paper", "conservative") and not seg.force_bits:
        paper = seg.values == "paper"
        o_est = output_estimate(x, lse2, seg.v_hi, blk, absolute=paper)
        logp = (x.reshape(b, h, g, nb, blk).amax(-1) - lse2[..., None]).nan_to_num(-1e9, neginf=-1e9)
        lv = (value_levels_paper if paper else value_levels)(logp, o_est, seg.v_colmax).amax(2)
    else:
        lv = torch.full_like(lk, 16)
    lv = _apply_floor(lv, seg.values, seg)
    v = join_planes(seg.v_hi, seg.v_mid, seg.v_low, lv).float()
    p = torch.exp2(x - lse2[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhgt,bhtd->bhgd", p, v).reshape(b, hq, d)
    lk, lv = (torch.where(blk_valid, lvl, 0).to(torch.uint8) for lvl in (lk, lv))
    return out, (lse2 * _LN2).reshape(b, hq), lk, lv


def bits_read(levels: torch.Tensor, lens: torch.Tensor, block: int) -> float:
    """Average bits read per valid element from ``levels [B, H, NB, D]`` (tokens of a partly valid block count
    once each; padding is not counted)."""
    nb = levels.shape[2]
    t = torch.arange(nb * block, device=levels.device)
    per_blk = ((t[None, :] < lens.to(levels.device).long()[:, None]).reshape(-1, nb, block).sum(-1)).float()
    n = per_blk.sum() * levels.shape[1] * levels.shape[3]
    return float((levels.float() * per_blk[:, None, :, None]).sum() / n) if n > 0 else 0.0


def dequant_aligned(seg: AlignedSeg) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision (exact fp16) K and V of an ``AlignedSeg``."""
    return (join_planes(seg.k_hi, seg.k_mid, seg.k_low).float(), join_planes(seg.v_hi, seg.v_mid, seg.v_low).float())


DEQUANTIZERS[AlignedSeg] = dequant_aligned
DECODE_READS[AlignedSeg] = lambda q, seg, sm_scale: aligned_attention(q, seg, sm_scale)[:2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama-family RMSNorm as transformers computes it (``LlamaRMSNorm``): mean of squares in fp32, times
    ``rsqrt(mean + eps)``, back to ``x``'s dtype, times the weight in that dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """Rotary position embedding as transformers' Llama applies it (``apply_rotary_pos_emb``, ``unsqueeze_dim=1``):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, every operation rounded to ``x``'s
    dtype. ``q [B, Hq, T, D]``, ``k [B, Hk, T, D]``, ``cos``/``sin`` ``[B or 1, T, D]``."""
    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
    return rot(q), rot(k)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation as transformers' Llama MLP computes it: ``silu(gate) * up``, each rounded to the
    input dtype."""
    return torch.nn.functional.silu(gate) * up


def append_token(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lens: torch.Tensor) -> None:
    """One decoded token per row into a dense segment, in place: ``k[b, :, 0]`` / ``v[b, :, 0]`` to slot ``lens[b]``
    of row ``b`` of ``k_cache`` / ``v_cache [B, H, T, D]``, then every length advances by one."""
    rows = torch.arange(k.shape[0], device=k.device)
    pos = lens.long()
    k_cache[rows, :, pos] = k[:, :, 0]
    v_cache[rows, :, pos] = v[:, :, 0]
    lens += 1
