"""The CPU decode path's readers of SKVQ and AlignedKV segments (``cpu.py`` calls them), block by block.

SKVQ: a block of tokens is dequantized by a compiled loop (``cpu_planes_c.py``) into the thread's reused buffer in
*position order* (every store contiguous); the query is gathered once per segment into the keys' position order,
which composes the plane's lane order with the head's channel permutation (``q[perm[chan[p]]]`` pairs with stored
channel ``chan[p]``), and each block's output is put back in natural channel order through the values' map.
Nothing of the cache is expanded beyond one block. Without the compiled loops the torch reference dequantizes each
block (natural order).

AlignedKV: the precision-aligned read of ``reference.aligned_attention``, the same rules on the same small tensors
(levels per block and channel, the output estimate), but ``q . K`` and ``p . V`` are two compiled passes that join
each channel row of a block from its planes as they go (``cpu_planes_c.py``) instead of joining the whole cache
into fp16 with a dozen torch operations per plane. The bits read are the reference's:
the CPU studies of the rules (``eval/studies/alignedkv*.py``) measure the same read.
"""

from __future__ import annotations

import weakref

import torch

from ..layouts import TERNARY, AlignedSeg, SkvqSeg
from ..reference import _apply_floor, dequant_skvq_side
from . import cpu_native
from .cpu_native import lane_order

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def skvq_positions(bits: float, d: int) -> torch.Tensor:
    """The stored channel at each position of the compiled SKVQ loop's output row (see ``cpu_planes_c.py``): the
    plane's lane order (3-bit codes: the 1-bit plane's), or for ternary bytes digit ``i`` of every byte, then
    digit ``i + 1``."""
    if bits == TERNARY:
        return torch.cat([torch.arange(i, d, 5, device="cpu") for i in range(5)])
    return lane_order(1 if bits == 3 else int(bits), d)


_MAPS: dict = {}


def _side_maps(perm, gid, bits: float, d: int):
    """``(nat [H, D] long, masks [H, groups, D] fp32, unlane [H, D])`` of one side: the natural channel of each
    output position of the compiled loop, 1.0 where a position is in a group, and the index that puts an output
    back in natural order; memoized per (permutation, group ids) tensor pair (held once per layer)."""
    key = (id(perm), id(gid), bits, d)
    hit = _MAPS.get(key)
    if hit is not None and hit[0]() is gid and (perm is None or hit[1]() is perm):
        return hit[2]
    chan = skvq_positions(bits, d).to(gid.device)
    h = gid.shape[0]
    nat = chan.expand(h, d) if perm is None else perm.long()[:, chan]
    groups = gid.long()[:, chan]
    masks = (groups[:, None, :] == torch.arange(int(gid.max()) + 1, device=gid.device)[None, :, None]).float()
    res = (nat.contiguous(), masks.contiguous(), torch.argsort(nat, dim=-1))
    if len(_MAPS) > 4096:
        _MAPS.clear()
    _MAPS[key] = (weakref.ref(gid), weakref.ref(perm) if perm is not None else None, res)
    return res


def skvq_native(seg: SkvqSeg, dtype) -> bool:
    """Is this segment read by the compiled loop? fp32 blocks, code rows with unit channel stride, (batch, head)
    rows at one stride (the cache's segments always are)."""
    if dtype != torch.float32 or cpu_native.library() is None:
        return False
    d = seg.k_gid.shape[1]
    planes = [t for t in (seg.k_codes, seg.k_hi, seg.v_codes, seg.v_hi, seg.k_scale, seg.k_zero, seg.v_scale,
                          seg.v_zero) if t is not None]
    return d % 8 == 0 and d <= 256 and all(t.stride(-1) == 1 and t.stride(0) == t.shape[1] * t.stride(1) for t in planes)


def skvq_query_order(seg: SkvqSeg, dtype) -> torch.Tensor | None:
    """``[H, D]``: the natural query channel each key position pairs with, or None (blocks in natural order)."""
    if not skvq_native(seg, dtype):
        return None
    return _side_maps(seg.k_perm, seg.k_gid, seg.k_bits, seg.k_gid.shape[1])[0]


def _dequant_side(lo, hi, scale, zero, bits, masks, t0: int, t1: int, out: torch.Tensor) -> torch.Tensor:
    n = t1 - t0
    b, h, _, d = out.shape
    lo = lo[:, :, t0:t1]
    hi = lo if hi is None else hi[:, :, t0:t1]
    s = scale[:, :, t0:t1].to(torch.float32)
    z = zero[:, :, t0:t1].to(torch.float32)
    if s.stride() != z.stride() or s.stride(0) != h * s.stride(1):
        s, z = s.contiguous(), z.contiguous()
    if out.stride(-2) != d or out.stride(-1) != 1 or out.stride(0) != h * out.stride(1):
        raise ValueError("cpu_planes: the output must have dense token rows")
    kind = 15 if bits == TERNARY else int(bits)
    if s.shape[-1] != masks.shape[1] or d > 256:
        raise ValueError("cpu_planes: scales and group masks disagree, or head_dim > 256")
    cpu_native.library().mmkv_dq_skvq(
        lo.data_ptr(), hi.data_ptr(), s.data_ptr(), z.data_ptr(), masks.data_ptr(), out.data_ptr(), b * h, h, n, d,
        kind, s.shape[-1], lo.stride(1), lo.stride(2), hi.stride(1), hi.stride(2), s.stride(1), s.stride(2),
        out.stride(1))
    return out[:, :, :n]


def skvq_blocks(seg: SkvqSeg, L: int, dtype, step: int, buffers, room: int = 0):
    """``(t0, k, v, unlane, roomy)`` for blocks of ``step`` tokens covering ``[0, L)``; ``buffers(shape)`` gives the
    thread's reused K and V buffers; ``unlane [H, D]`` (or None) puts an output back in natural channel order;
    ``room``: the last block is that many tokens longer, left to the caller (``roomy``; compiled loop only)."""
    b, h, cap = seg.k_codes.shape[:3]
    d = seg.k_gid.shape[1]
    L = min(L, cap)  # lens past the capacity (never in a cache) read what the capacity holds, as the reference
    native = skvq_native(seg, dtype)
    if native:
        _, kg, _ = _side_maps(seg.k_perm, seg.k_gid, seg.k_bits, d)
        _, vg, unlane = _side_maps(seg.v_perm, seg.v_gid, seg.v_bits, d)
    for t0 in range(0, L, step):
        t1 = min(L, t0 + step)
        if not native:
            part = [None if t is None else t[:, :, t0:t1] for t in (seg.k_codes, seg.k_hi, seg.k_scale, seg.k_zero,
                                                                     seg.v_codes, seg.v_hi, seg.v_scale, seg.v_zero)]
            k = dequant_skvq_side(*part[:4], seg.k_bits, seg.k_perm, seg.k_gid)
            v = dequant_skvq_side(*part[4:], seg.v_bits, seg.v_perm, seg.v_gid)
            yield t0, k.to(dtype), v.to(dtype), None, False
            continue
        extra = room if t1 == L else 0
        kb, vb = buffers((b, h, t1 - t0 + extra, d))
        _dequant_side(seg.k_codes, seg.k_hi, seg.k_scale, seg.k_zero, seg.k_bits, kg, t0, t1, kb)
        _dequant_side(seg.v_codes, seg.v_hi, seg.v_scale, seg.v_zero, seg.v_bits, vg, t0, t1, vb)
        yield t0, kb, vb, unlane, bool(extra)


def _plane_ok(t: torch.Tensor) -> bool:
    """A plane ``[B, H, NB, D, X]`` with dense blocks and (batch, head) rows at one stride."""
    x, d = t.shape[-1], t.shape[-2]
    return (t.stride(-1) == 1 and t.stride(-2) == x and t.stride(-3) == d * x
            and t.stride(0) == t.shape[1] * t.stride(1))


def aligned_native(seg: AlignedSeg, q: torch.Tensor) -> bool:
    h, d = seg.k_hi.shape[1], seg.k_hi.shape[3]
    return (q.dtype == torch.float32 and cpu_native.library() is not None and seg.block % 16 == 0
            and seg.block <= 256 and d <= 256 and q.shape[1] // h <= 16
            and all(c.stride(-1) == 1 and c.stride(-2) == d and c.stride(0) == h * c.stride(1)
                    for c in (seg.k_colmax, seg.v_colmax))
            and all(_plane_ok(t) for t in (seg.k_hi, seg.k_mid, seg.k_low, seg.v_hi, seg.v_mid, seg.v_low))
            and seg.k_mid.stride(1) == seg.k_low.stride(1) and seg.v_mid.stride(1) == seg.v_low.stride(1))


def _aligned_pass(fn, hi, mid, low, levels, a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One compiled pass over one side's blocks ``[0, NB)`` read at ``levels [B, H, NB, D]``: ``fn`` is
    ``mmkv_aligned_qk`` (``a = q [B, H, G, D]``, ``out = x [B, H, G, NB * block]``, zeroed) or ``mmkv_aligned_pv``
    (``a = p``, ``out [B, H, G, D]``, zeroed). One thread: split over two (the loop holds no Python lock) it
    measured slower, 0.8 vs 0.6 ms a pass at 8192 SmolLM2 tokens, as torch's OpenMP workers spin for work beside
    it (with ``OMP_WAIT_POLICY=PASSIVE`` it was faster, 0.4 ms; that is the user's process-wide choice)."""
    b, h, _, d, blk = hi.shape
    nb, g, t = levels.shape[2], a.shape[2], levels.shape[2] * blk
    acc = None if fn is cpu_native.library().mmkv_aligned_qk else torch.empty(g * d * 16)  # held until fn returns
    fn(hi.data_ptr(), mid.data_ptr(), low.data_ptr(), levels.data_ptr(), a.data_ptr(), out.data_ptr(),
       *([] if acc is None else [acc.data_ptr()]), b * h, nb, d, blk, g, hi.stride(1), mid.stride(1),
       levels.stride(1), t)
    return out


_ORDER: dict = {}


def block_order(block: int, t: int) -> torch.Tensor:
    """The token at each position of the compiled AlignedKV passes' logits (``cpu_planes_c.py``): in every block
    the even tokens, then the odd ones."""
    key = (block, t)
    if key not in _ORDER:
        pos = torch.arange(t, device="cpu")  # cached host table, as lane_order's
        i, half = pos % block, block // 2
        if len(_ORDER) > 64:
            _ORDER.clear()
        _ORDER[key] = pos - i + torch.where(i < half, 2 * i, 2 * (i - half) + 1)
    return _ORDER[key]


def _key_levels(qg: torch.Tensor, seg: AlignedSeg, nb: int) -> torch.Tensor:
    """Bits read per (block, channel) of K, uint8 ``[B, H, NB, D]``: Rule 1 by the compiled loop (the reference's
    ``key_levels``, widest over the G heads, floored), or the uniform width of ``keys=full``/``force_bits``."""
    b, h, g, d = qg.shape
    if seg.keys != "rule1" or seg.force_bits:
        return _apply_floor(torch.zeros((b, h, nb, d), dtype=torch.uint8), seg.keys, seg)
    lk = torch.empty((b, h, nb, d), dtype=torch.uint8)
    cpu_native.library().mmkv_aligned_klevels(qg.data_ptr(), seg.k_colmax.data_ptr(), lk.data_ptr(), b * h, nb, d,
                                              g, seg.k_colmax.stride(1), seg.min_bits)
    return lk


def _value_levels(x: torch.Tensor, lse2: torch.Tensor, seg: AlignedSeg) -> torch.Tensor:
    """Bits read per (block, channel) of V from the logits ``x [B, H, G, NB * block]`` (log2 units, positions in
    :func:`block_order`) and ``lse2``:
    Rule 2 by the compiled loop (the reference's ``output_estimate`` and value rule, widest over the G heads,
    floored), or the uniform width of ``values=full``/``force_bits``."""
    b, h, g, t = x.shape
    d, nb = seg.v_hi.shape[3], t // seg.block
    if seg.values not in ("paper", "conservative") or seg.force_bits:
        return _apply_floor(torch.zeros((b, h, nb, d), dtype=torch.uint8), seg.values, seg)
    lv = torch.empty((b, h, nb, d), dtype=torch.uint8)
    est, logp = torch.empty(g * d), torch.empty(g * nb)  # scratch, held until the call returns
    lse2 = lse2.contiguous()
    cpu_native.library().mmkv_aligned_vlevels(
        x.data_ptr(), lse2.data_ptr(), seg.v_hi.data_ptr(), seg.v_colmax.data_ptr(), lv.data_ptr(), est.data_ptr(),
        logp.data_ptr(), b * h, nb, d, seg.block, g, seg.v_hi.stride(1), seg.v_colmax.stride(1),
        int(seg.values == "paper"), seg.min_bits)
    return lv


def aligned_attention_cpu(q: torch.Tensor, seg: AlignedSeg, sm_scale: float):
    """``reference.aligned_attention``'s ``(out [B, Hq, D] fp32, lse [B, Hq])`` for fp32 ``q [B, Hq, D]``, reading
    only the blocks up to the longest row."""
    b, hq, d = q.shape
    h, blk = seg.k_hi.shape[1], seg.block
    g = hq // h
    L = int(seg.lens.max()) if seg.lens.numel() else 0
    nb = -(-L // blk)
    if nb == 0:
        return q.new_zeros((b, hq, d), dtype=torch.float32), q.new_full((b, hq), float("-inf"), dtype=torch.float32)
    t = nb * blk
    lib = cpu_native.library()
    qg = q.reshape(b, h, g, d).contiguous()
    x = _aligned_pass(lib.mmkv_aligned_qk, seg.k_hi, seg.k_mid, seg.k_low, _key_levels(qg, seg, nb), qg,
                      q.new_zeros((b, h, g, t)))
    x.mul_(sm_scale * LOG2E)
    valid = block_order(blk, t)[None, :] < seg.lens.long()[:, None]
    x.masked_fill_(~valid[:, None, None, :], float("-inf"))
    m = x.amax(-1).clamp(min=-1e30)
    lse2 = m + torch.log2(torch.exp2(x - m[..., None]).sum(-1))
    lv = _value_levels(x, lse2, seg)
    p = torch.exp2(x - lse2[..., None]).nan_to_num(0.0)
    out = _aligned_pass(lib.mmkv_aligned_pv, seg.v_hi, seg.v_mid, seg.v_low, lv, p, q.new_zeros((b, h, g, d)))
    return out.reshape(b, hq, d), (lse2 * LN2).reshape(b, hq)
