"""Attention over stored segments on the CPU without Triton: what ``kernels.decode_attention`` runs for a CPU
tensor, and the extend path (several new tokens over the history, then causally among themselves) of
``mmkv/attention.py`` on the CPU.

The torch reference (``kernels/reference.py``) builds every segment's logits with a grouped matmul, a mask, a
``logsumexp`` and a ``cat``: it is the oracle the kernels are tested against, and made decoding 2-3x slower than
transformers' own on a 2-core CPU (docs/BENCHMARKS.md). Here every segment goes through PyTorch's fused CPU flash
attention, which also returns the log-sum-exp, so the partial results of the segments (and of the blocks of one
segment) merge exactly. GQA is folded into the query rows: the G query heads of a KV head attend as G rows of that
head, so K/V are never expanded per query head.

Quantized segments are dequantized a block of tokens at a time (up to ``BLOCK`` tokens and ``BLOCK_BYTES`` of
fp32) into one buffer per thread that every block, layer and step reuses, and each block is attended and merged: no
fp32 copy of a whole cache is ever made (one block's K and V per thread is the only extra memory). KIVI/XQuant and
channel-wise codes are dequantized by two compiled C loops (``cpu_native.py``: one read of each code byte, one
write of each value) where a C compiler exists, by torch operations otherwise; SKVQ's planes likewise, and
AlignedKV's precision-aligned read by two compiled passes (``cpu_planes.py``). Segments whose logits need the whole
segment at once (CalibQuant's pre-softmax calibration takes each query's min and max over it) go through the
reference. For a single row the dense tokens (sinks, window) join the last block of the longest segment, so a
layer is one fused call (:func:`cpu_join.join_host`). One row with one new token over up to 16k tokens of the
layouts it reads goes to ``cpu_row.py`` (one compiled call a segment, no buffer); this is the path of the rest.
"""

from __future__ import annotations

import math
import sys
import threading

import torch

from ..layouts import AlignedSeg, ChannelSeg, DenseSeg, KiviSeg, SkvqSeg, natural_values, per_byte
from ..reference import DECODE_READS, attention_over_segments, dequantize_segment
from . import cpu_native, cpu_planes, cpu_row
from .cpu_join import fill_tail, join_host, joined_dense, longer, slack
from .cpu_native import lane_order

BLOCK = 16384  # most tokens dequantized at a time; segments whose scale block does not divide it are read whole
BLOCK_BYTES = 16 << 20  # ... and at most this much fp32 K + V per block, but never fewer than MIN_BLOCK tokens
MIN_BLOCK = 1024

_LOCAL = threading.local()  # the app may decode two caches at once (its side-by-side compare)


def _buffer(shape, dtype, device) -> torch.Tensor:
    """A buffer of this thread, grown as needed, viewed to ``shape``. One per dtype and per inference mode: a
    tensor made under ``torch.inference_mode`` may not be written outside it."""
    n = math.prod(shape)
    key = (dtype, torch.device(device), torch.is_inference_mode_enabled())
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = bufs[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def _buffers(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    both = _buffer((2, *shape), dtype, device)
    return both[0], both[1]


def _words(c: torch.Tensor) -> torch.Tensor | None:
    """``c`` (uint8, packed) viewed as little-endian int32 words along its last dim, or None where it cannot be."""
    if sys.byteorder == "little" and c.shape[-1] % 4 == 0 and c.stride(-1) == 1 and c.storage_offset() % 4 == 0 and all(
            st % 4 == 0 for st in c.stride()[:-1]):
        return c.view(torch.int32)
    return None


def _lanes(words: torch.Tensor, bits: int, out: torch.Tensor, axis: int) -> None:
    """Code ``i`` of every byte of ``words`` into ``out.select(axis, i)``, each code in its own byte: a shift and
    a byte-replicated mask per code position, so a 32-bit operation unpacks four codes at once and nothing wider
    than a byte per code is written (an int32 per code costs 3-4x the memory traffic)."""
    mask = ((1 << bits) - 1) * 0x01010101
    for i in range(8 // bits):
        o = out.select(axis, i)
        if i:
            torch.bitwise_right_shift(words, bits * i, out=o)
            o.bitwise_and_(mask)
        else:
            torch.bitwise_and(words, mask, out=o)


def _tokens_unpacked(codes, bits: int, r0: int, r1: int) -> torch.Tensor:
    """Codes packed along tokens (rows ``[r0, r1)`` of ``[B, H, T/PER, D]``) -> uint8 ``[B, H, (r1-r0)*PER, D]``.
    Where the rows are whole int32 words, byte ``j`` of word ``w`` is channel ``4w + j`` and its code ``i`` is
    token ``r * PER + i``: the lanes land in token order without a permutation."""
    per = per_byte(bits)
    c = codes[:, :, r0:r1]
    if per == 1:
        return c
    b, h, r, d = c.shape
    w = _words(c)
    if w is not None:
        buf = _buffer((b, h, r, per, d // 4), torch.int32, c.device)
        _lanes(w, bits, buf, 3)
        return buf.view(torch.uint8).view(b, h, r * per, d)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device).view(per, 1)
    u = (c.unsqueeze(3) >> shifts) & ((1 << bits) - 1)
    return u.reshape(b, h, -1, d)


def _channel_side(codes, scale, zero, bits: int, block: int, t0: int, t1: int, out: torch.Tensor) -> torch.Tensor:
    """Channel-wise codes of tokens ``[t0, t1)`` (``t0`` a multiple of ``block``) dequantized into ``out``, which
    holds whole blocks (``t1 - t0`` rounded up to ``block``); returns its first ``t1 - t0`` tokens."""
    per = per_byte(bits)
    n = t1 - t0
    nb = -(-n // block)
    if _native_fits(codes, out.dtype):
        s = scale[:, :, t0 // block: t0 // block + nb].to(out.dtype)
        z = zero[:, :, t0 // block: t0 // block + nb].to(out.dtype)
        return cpu_native.dequant_tokens(codes[:, :, t0 // per:], s, z, bits, block, n, out)
    c = _tokens_unpacked(codes, bits, t0 // per, (t0 + nb * block) // per)
    b, h, _, d = c.shape
    s = scale[:, :, t0 // block: t0 // block + nb].unsqueeze(3).to(out.dtype)
    z = zero[:, :, t0 // block: t0 // block + nb].unsqueeze(3).to(out.dtype)
    o = out[:, :, :nb * block].view(b, h, nb, block, d)
    # in place, one op each: no temporary the size of the block (large ones are fresh pages on every call)
    o.copy_(c.view(b, h, nb, block, d)).mul_(s).add_(z)
    return out[:, :, :n]


def _channel_codes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``[..., DV]`` packed along channels (byte ``j``: channels ``j * per + i``) -> codes ``[..., DV * per]``
    in channel order. Four bytes are read as one int32 where the row allows: shifting 32-bit words is ~4x faster on
    the CPU than shifting bytes, and little-endian words hold their codes in channel order."""
    per = per_byte(bits)
    mask = (1 << bits) - 1
    if per == 1:
        return c
    w = _words(c)
    if w is not None:
        u = (w.unsqueeze(-1) >> torch.arange(0, 32, bits, dtype=torch.int32, device=c.device)) & mask
    else:
        u = (c.unsqueeze(-1) >> torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)) & mask
    return u.reshape(*c.shape[:-1], c.shape[-1] * per)


_UNLANE: dict = {}


def _unlane_index(bits: int, d: int) -> torch.Tensor:
    """Index that puts an output computed on lane-ordered values (:func:`lane_order`) back in channel order."""
    key = (bits, d)
    if key not in _UNLANE:
        _UNLANE[key] = torch.argsort(lane_order(bits, d))
    return _UNLANE[key]


def _token_groups(codes, scale, zero, bits: int, group: int, t0: int, t1: int, out: torch.Tensor,
                  lanes: bool = False) -> torch.Tensor:
    """Token-wise group codes packed along channels, tokens ``[t0, t1)``, dequantized into ``out``: by the compiled
    loop in lane order where ``lanes`` (the caller checked :func:`_lanes_fit`), else in channel order."""
    n = t1 - t0
    out = out[:, :, :n]
    s = scale[:, :, t0:t1].to(out.dtype)
    z = zero[:, :, t0:t1].to(out.dtype)
    if lanes:
        return cpu_native.dequant_groups(codes[:, :, t0:t1], s, z, bits, group, out)
    c = _channel_codes(codes[:, :, t0:t1], bits)
    b, h, _, d = c.shape
    o = out.view(b, h, n, d // group, group)
    o.copy_(c.view(o.shape))
    o.mul_(s.unsqueeze(-1)).add_(z.unsqueeze(-1))
    return out


def _lanes_fit(seg, dtype) -> bool:
    """Are a KIVI segment's values read by the compiled loop (in lane order)? Whole bytes per scale group."""
    per = per_byte(seg.v_bits)
    return per > 1 and seg.group % per == 0 and _native_fits(seg.v_codes, dtype)


def _native_fits(codes, dtype) -> bool:
    """Can the compiled loops read ``codes`` into a ``dtype`` buffer? fp32, and (batch, head) rows at one stride."""
    return (dtype == torch.float32 and codes.stride(-1) == 1 and codes.stride(0) == codes.shape[1] * codes.stride(1)
            and cpu_native.library() is not None)


def _capacity_whole(codes, bits: int, block: int) -> bool:
    """Does the capacity end on a block boundary (the methods pad to it), so whole blocks can be read?"""
    return (codes.shape[2] * per_byte(bits)) % block == 0


def _whole(n: int, block: int) -> int:
    return -(-n // block) * block


def _block_reader(seg, dtype):
    """``(key bits, values(t0, t1, out), unlane)`` of a layout read here in blocks, or None (read whole). Keys are
    channel-wise in both; values are channel-wise (``ChannelSeg``) or token groups (``KiviSeg``); ``unlane`` is
    None, or the index that puts an output over lane-ordered values back in channel order."""
    unlane = None
    if isinstance(seg, KiviSeg):
        bits = seg.k_bits
        lanes = _lanes_fit(seg, dtype)
        if lanes:
            unlane = _unlane_index(seg.v_bits, seg.v_codes.shape[-1] * per_byte(seg.v_bits)).to(seg.v_codes.device)

        def values(t0, t1, out):
            return _token_groups(seg.v_codes, seg.v_scale, seg.v_zero, seg.v_bits, seg.group, t0, t1, out, lanes)
    elif isinstance(seg, ChannelSeg):
        bits = seg.bits

        def values(t0, t1, out):
            return _channel_side(seg.v_codes, seg.v_scale, seg.v_zero, seg.bits, seg.block, t0, t1, out)
    else:
        return None
    if _block_tokens(seg, dtype) % seg.block or not _capacity_whole(seg.k_codes, bits, seg.block):
        return None
    return bits, values, unlane


def _block_tokens(seg, dtype) -> int:
    """Tokens per block: large blocks let the fused attention spread its work over the threads and cut the
    per-block overhead (8192 tokens of SmolLM2 on 2 cores: 1.47 ms a layer in one block, 2.45 ms in 2048-token
    blocks); the byte cap keeps a batch's buffer bounded."""
    b, h, _, d = seg.k_codes.shape
    if isinstance(seg, SkvqSeg):  # codes packed along channels: the head dim is the group ids'
        d = seg.k_gid.shape[1]
    per_token = 2 * b * h * d * torch.finfo(dtype).bits // 8
    return min(BLOCK, max(MIN_BLOCK, BLOCK_BYTES // per_token // MIN_BLOCK * MIN_BLOCK))


def _blocks(seg, L: int, dtype, room: int = 0):
    """(t0, k, v, unlane, roomy) for blocks of ``seg`` covering tokens ``[0, L)``; quantized blocks live in the
    thread's buffer; ``unlane``: see :func:`_block_reader`. ``room`` (one row only): the last block is made
    ``room`` tokens longer where it can (``roomy``), those tokens left for the caller to fill
    (:func:`cpu_join.join_host`)."""
    if isinstance(seg, DenseSeg):
        if room and slack(seg, L + room, dtype):
            yield 0, seg.k[:, :, :L + room], seg.v[:, :, :L + room], None, True
        else:
            yield 0, seg.k[:, :, :L].to(dtype), seg.v[:, :, :L].to(dtype), None, False
        return
    if isinstance(seg, SkvqSeg):
        dev = seg.k_codes.device
        yield from cpu_planes.skvq_blocks(seg, L, dtype, _block_tokens(seg, dtype),
                                          lambda shape: _buffers(shape, dtype, dev), room)
        return
    reader = _block_reader(seg, dtype)
    if reader is None:  # layouts without a block reader here: dequantized whole, once per step
        k, v = dequantize_segment(seg)
        yield 0, k[:, :, :L].to(dtype), v[:, :, :L].to(dtype), None, False
        return
    bits, values, unlane = reader
    b, h, _, d = seg.k_codes.shape
    step = _block_tokens(seg, dtype)
    for t0 in range(0, L, step):
        t1 = min(L, t0 + step)
        extra = room if t1 == L else 0
        kb, vb = _buffers((b, h, _whole(t1 - t0, seg.block) + extra, d), dtype, seg.k_codes.device)
        k = _channel_side(seg.k_codes, seg.k_scale, seg.k_zero, bits, seg.block, t0, t1, kb)
        v = values(t0, t1, vb)
        if extra:
            k, v = longer(k, extra), longer(v, extra)
        yield t0, k, v, unlane, bool(extra)


def _attend(q4, k, v, lens, t0: int, scale: float):
    """Flash attention of ``q4 [B, H, G, D]`` over one block (tokens ``t0 ..``), masked to each row's ``lens``."""
    # the fused op reads K/V wrongly unless the channel stride is 1 (measured on torch 2.13: errors of order 1)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    n = k.shape[2]
    mask = None
    if any(x < t0 + n for x in lens):
        dev = q4.device
        valid = torch.arange(t0, t0 + n, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
        mask = torch.zeros(valid.shape, dtype=q4.dtype, device=dev).masked_fill_(~valid, float("-inf"))
        mask = mask[:, None, None, :]
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k, v, 0.0, False, attn_mask=mask,
                                                                        scale=scale)
    empty = [x <= t0 for x in lens]
    if any(empty):  # the fused op gives rows without a valid token lse 0; they must merge away
        e = torch.tensor(empty, device=q4.device)[:, None, None]
        lse = lse.masked_fill(e, float("-inf"))
        o = o.masked_fill(e[..., None], 0.0)
    return o, lse


def decode_attention_cpu(q: torch.Tensor, segments: list, sm_scale: float | None = None):
    """``q [B, Hq, D]`` (CPU) over every valid token of ``segments`` -> ``(out [B, Hq, D], lse [B, Hq])`` fp32, as
    ``reference.decode_reference`` returns them."""
    own = [s for s in segments if s is not None and type(s) in DECODE_READS]
    rest = [s for s in segments if s is not None and type(s) not in DECODE_READS]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = history_attention_cpu(q.unsqueeze(2), rest, scale)
    outs, lses = [out.squeeze(2)], [lse.squeeze(2)]
    for seg in own:  # layouts that read their own precision at decode (AlignedKV)
        if isinstance(seg, AlignedSeg) and cpu_planes.aligned_native(seg, q.float()):
            o, l_ = cpu_planes.aligned_attention_cpu(q.float(), seg, scale)
        else:
            o, l_ = DECODE_READS[type(seg)](q, seg, scale)
        outs.append(o.float())
        lses.append(l_.float())
    return _merge(outs, lses)


def history_attention_cpu(q: torch.Tensor, segments: list, sm_scale: float | None = None):
    """``q [B, Hq, Tq, D]`` (CPU) over every valid token of ``segments``, no causal mask (the stored history) ->
    ``(out [B, Hq, Tq, D], lse [B, Hq, Tq])`` fp32, as ``reference.attention_over_segments`` returns them."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # every loop here reads KIVI values in natural order (tile order is for the GPU kernel; a cache moved off it)
    segments = [natural_values(s) if isinstance(s, KiviSeg) else s for s in segments]
    split = cpu_row.partition(q, segments)
    if split is None:
        return _history_blocks(q, segments, scale)
    todo, rest = split  # one row, one token: one compiled call a segment it reads, the block path for the rest
    if not todo:
        return _history_blocks(q, rest, scale)
    out, lse = cpu_row.attend(q, todo, scale)
    if not rest:
        return out, lse
    o2, l2 = _history_blocks(q, rest, scale)
    return _merge([out, o2], [lse, l2])


def _history_blocks(q: torch.Tensor, segments: list, scale: float):
    """:func:`history_attention_cpu` by blocks of dequantized tokens (and the reference for calibrated segments)."""
    B, HQ, TQ, D = q.shape
    dtype = _compute_dtype(q)
    outs, lses = [], []
    host, tails = join_host(q, segments)
    joined = None
    if host is None or (isinstance(host, DenseSeg)
                        and not slack(host, int(host.lens[0]) + sum(int(t.lens[0]) for t in tails), dtype)):
        # a short dense history without room: copied whole into one buffer
        joined, segments = joined_dense(q, segments, dtype, lambda shape: _buffers(shape, dtype, q.device))
        if joined is not None:
            host, tails = None, []
    if joined is not None:  # attended before the loop below reuses the buffer
        k, v, n = joined
        H = k.shape[1]
        o, lse = _attend(q.to(dtype).reshape(B, H, HQ // H * TQ, D), k, v, [n], 0, scale)
        outs.append(o.reshape(B, HQ, TQ, D).float())
        lses.append(lse.reshape(B, HQ, TQ).float())
    taken = False
    if host is not None:  # the host first: its tails are then read by it, or after it where it had no room
        segments = [host] + [s for s in segments if s is not host and not any(s is t for t in tails)] + tails
    for seg in segments:
        if taken and any(seg is t for t in tails):
            continue
        if getattr(seg, "calib", None) is not None:
            o, lse = attention_over_segments(q, [seg], scale)
            outs.append(o)
            lses.append(lse)
            continue
        lens = [int(x) for x in seg.lens.tolist()]
        L = max(lens, default=0)
        if L == 0:
            continue
        H = getattr(seg, seg.token_fields()[0][0]).shape[1]  # KV heads: dim 1 of every layout's first field
        # the G query heads of KV head h and their Tq tokens are G * Tq rows of that head
        qs = q.to(dtype).reshape(B, H, HQ // H * TQ, D)
        qmap = cpu_planes.skvq_query_order(seg, dtype) if isinstance(seg, SkvqSeg) else None
        if qmap is not None:  # keys in the positions of SKVQ's compiled loop: the query follows them once
            qs = qs.gather(-1, qmap[None, :, None, :].expand(qs.shape))
        room = sum(int(t.lens[0]) for t in tails) if seg is host else 0
        for t0, k, v, unlane, roomy in _blocks(seg, L, dtype, room):
            if roomy:
                fill_tail(k, v, tails, qmap, unlane)
                lens, taken = [t0 + k.shape[2]], True
            o, lse = _attend(qs, k, v, lens, t0, scale)
            if unlane is not None and unlane.dim() == 1:
                o = o.index_select(-1, unlane)
            elif unlane is not None:  # one order per head
                o = o.gather(-1, unlane[None, :, None, :].expand(o.shape))
            outs.append(o.reshape(B, HQ, TQ, D).float())
            lses.append(lse.reshape(B, HQ, TQ).float())
    if not outs:
        return (q.new_zeros((B, HQ, TQ, D), dtype=torch.float32),
                q.new_full((B, HQ, TQ), float("-inf"), dtype=torch.float32))
    return _merge(outs, lses)


def causal_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """The new tokens among themselves, causally: ``q [B, Hq, Tq, D]``, ``k, v [B, H, Tq, D]`` -> ``(out, lse)``
    fp32 for a log-sum-exp merge with :func:`history_attention_cpu`."""
    g = q.shape[1] // k.shape[1]
    dtype = _compute_dtype(q)
    k = k.to(dtype).repeat_interleave(g, dim=1)  # Tq tokens only: the expansion is small
    v = v.to(dtype).repeat_interleave(g, dim=1)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.to(dtype), k, v, 0.0, True, scale=scale)
    return o.float(), lse.float()


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """bf16 stays bf16 (the fused op takes it, and a bf16 cache is then read without a copy); everything else runs
    in fp32: fp16 attention on a CPU without fp16 arithmetic measured 5.6x slower than fp32 (torch 2.13)."""
    return torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32


def _merge(outs: list, lses: list):
    """Partial results over disjoint token sets -> the result over all of them. Written out rather than through
    ``torch.logsumexp``, whose CPU version (with its infinity handling) cost ~35 us a call on two rows of 9
    numbers, twice a layer. Rows without a token anywhere come out 0 with lse -inf."""
    if len(outs) == 1:
        return outs[0], lses[0]
    m = lses[0]
    for x in lses[1:]:
        m = torch.maximum(m, x)
    m = m.masked_fill(m == float("-inf"), 0.0)
    ws = [torch.exp(x - m) for x in lses]
    tot = ws[0]
    out = ws[0].unsqueeze(-1) * outs[0]
    for w, o in zip(ws[1:], outs[1:]):
        tot = tot + w
        out.addcmul_(w.unsqueeze(-1), o)
    return out / tot.clamp_min(1e-30).unsqueeze(-1), m + torch.log(tot)
