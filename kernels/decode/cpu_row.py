"""One row, one new token, a history of up to 16k tokens: decode attention as one compiled call per segment
(``cpu_row_c.py``).

At a few hundred tokens a layer's attention is cheap arithmetic and dear dispatch: the block path of ``cpu.py``
(dequantize into the buffer, copy the window in after it, a fused attention call, put the output back in channel
order) took 275 us a layer on the app's first example (323 tokens, KIVI-2, 2 threads) where transformers' whole
SDPA call takes 25-30 us. Here each segment is read as stored (dense rows: sinks, window, an fp16 store; KIVI/XQuant
codes; SKVQ token rows, a chunk at a time; CalibQuant's channel-wise codes, every logit held for its per-query
calibration) by one C function that keeps an online softmax per query head and merges
into a running state; nothing else is written. From ``SPLIT_TOKENS`` tokens a second Python thread reads the later
half (ctypes releases the GIL; a CalibQuant segment is never cut) and the two states merge once. Past
``ROW_TOKENS`` (not measured there) and for what the loops do not read (several rows or new tokens, AlignedKV, bf16)
the block path runs; a layer mixing both is split between the paths and merged (``cpu.history_attention_cpu``). Measurements: the comment below and docs/BENCHMARKS.md ("CPU generation").
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from ..layouts import TERNARY, ChannelSeg, DenseSeg, KiviSeg, SkvqSeg, per_byte
from ..reference import CALIB_MIN_RATIO
from ..switches import switch
from . import cpu_native, cpu_planes

# Most tokens (all segments) read by this path. One layer, SmolLM2 heads, 133 dense + n KIVI-2 tokens, 2 torch
# threads, the box not quiet (2026-11-26), us for the row path on 1 / 2 threads and the block path: n = 1024 249 /
# 236 / 424, 2048 456 / 368 / 553, 4096 874 / 517 / 926; dense only 4096 419 / 328 / 620. In a decode step the
# block path also pays for its buffer (12 MiB of fp32 a layer at 8k) falling out of the cache between layers.
ROW_TOKENS = 16384
CHUNK = 64  # as in the C source
SPLIT_TOKENS = 2048  # from here two threads read halves of the tokens (module doc)

_LOCAL = threading.local()
_threads = torch.get_num_threads  # the torch threads the step may use (a second one reads half the tokens)
_HALF = {torch.float16: 1, torch.float32: 0}


def _scratch(name: str, n: int) -> torch.Tensor:
    """This thread's float32 buffer ``name`` of at least ``n`` elements (grown, never shrunk); the C loops write it
    through its pointer only."""
    buf = getattr(_LOCAL, name, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=torch.float32)
        setattr(_LOCAL, name, buf)
    return buf


def _work(hq: int, g: int, d: int) -> torch.Tensor:
    """The loops' state of ``hq`` query rows and their scratch (the C source's layout)."""
    return _scratch("work", hq * (2 + d) + CHUNK * (g + 2 * d) + g * (d + 1) + 3 * d)


def _half(s) -> int:
    """Bit 0: the keys' scale/zero are fp16, bit 1: the values' (else fp32), as the C loops take it."""
    return _HALF[s.k_scale.dtype] | (_HALF[s.v_scale.dtype] << 1)


def _dense_ok(s: DenseSeg, d: int) -> bool:
    return s.k.dtype == s.v.dtype == torch.float32 and all(t.stride(-1) == 1 and t.stride(-2) == d
                                                           for t in (s.k, s.v))


def _kivi_ok(s: KiviSeg, d: int) -> bool:
    if s.k_codes is None or s.v_codes is None or s.k_bits not in (1, 2, 4, 8) or s.v_bits not in (1, 2, 4, 8):
        return False
    per = per_byte(s.v_bits)
    if s.group % per or d % s.group or s.k_scale.dtype not in _HALF or s.v_scale.dtype not in _HALF:
        return False
    if s.block % min(s.block, CHUNK):  # the loops' token chunks must not straddle two key blocks
        return False
    return (s.k_zero.dtype == s.k_scale.dtype and s.v_zero.dtype == s.v_scale.dtype
            and s.k_codes.stride(-1) == 1 and s.k_codes.stride(-2) == d
            and all(t.stride(-1) == 1 and t.stride(-2) == d for t in (s.k_scale, s.k_zero))
            and s.v_codes.stride(-1) == 1 and s.v_codes.stride(-2) == d // per
            and all(t.stride(-1) == 1 and t.stride(-2) == d // s.group for t in (s.v_scale, s.v_zero))
            and s.k_scale.stride() == s.k_zero.stride() and s.v_scale.stride() == s.v_zero.stride())


_OK: dict = {}


def _channel_ok(s: ChannelSeg, d: int) -> bool:
    per = per_byte(s.bits) if s.bits in (1, 2, 4, 8) else 0
    return (per > 0 and s.block % per == 0 and s.k_scale.dtype in _HALF and s.v_scale.dtype in _HALF
            and s.k_zero.dtype == s.k_scale.dtype and s.v_zero.dtype == s.v_scale.dtype
            and all(t.stride(-1) == 1 and t.stride(-2) == d for t in (s.k_codes, s.v_codes, s.k_scale, s.k_zero,
                                                                       s.v_scale, s.v_zero))
            and s.k_scale.stride() == s.k_zero.stride() and s.v_scale.stride() == s.v_zero.stride())


def _eligible(s, d: int) -> bool:
    """Does this path read segment ``s``? Memoized per segment object (a cache's segments are replaced, never
    changed in place, when they grow or shrink): the checks cost ~10 us a layer, a sixth of the call at 300 tokens."""
    hit = _OK.get(id(s))
    if hit is not None and hit[0]() is s and hit[1] == d:
        return hit[2]
    if type(s) is DenseSeg:
        ok = _dense_ok(s, d)
    elif type(s) is KiviSeg:
        ok = getattr(s, "calib", None) is None and _kivi_ok(s, d)
    elif type(s) is SkvqSeg:
        ok = s.k_gid.shape[1] == d and cpu_planes.skvq_native(s, torch.float32)
    elif type(s) is ChannelSeg:
        ok = _channel_ok(s, d)
    else:
        ok = False
    if len(_OK) > 4096:
        _OK.clear()
    _OK[id(s)] = (weakref.ref(s), d, ok)
    return ok


def partition(q: torch.Tensor, segments: list):
    """``(todo, rest)``: ``[(segment, tokens)]`` this path reads and the segments it leaves to the block path (a
    layout or dtype it does not read, e.g. fp16 rows on the CPU, or a calibrated segment of more than 8 query heads a
    KV head); None where it does not apply at all (several rows or new tokens, a query it does not take, more than ``ROW_TOKENS`` tokens of its own,
    no compiled loops)."""
    b, hq, tq, d = q.shape
    if b != 1 or tq != 1 or q.dtype != torch.float32 or d % 16 or q.device.type != "cpu" or switch("MMKV_CPU_ROW") == "0":
        return None
    todo, rest, total = [], [], 0
    for s in segments:
        if s is None:
            continue
        n = s.lens.item() if s.lens.numel() == 1 else int(s.lens[0])
        if n == 0:
            continue
        if not _eligible(s, d) or (type(s) is ChannelSeg and hq // s.k_codes.shape[1] > 8):
            rest.append(s)
            continue
        if type(s) is SkvqSeg:
            n = min(n, s.k_codes.shape[2])  # lens past the capacity read what it holds, as the block path
        todo.append((s, n))
        total += n
    if total > ROW_TOKENS or cpu_native.library() is None:
        return None
    return todo, rest


def plan(q: torch.Tensor, segments: list):
    """``[(segment, tokens)]`` when this path reads every segment with tokens, else None (see :func:`partition`)."""
    split = partition(q, segments)
    return split[0] if split is not None and not split[1] else None


def attend(q: torch.Tensor, todo: list, scale: float):
    """``q [1, Hq, 1, D]`` fp32 over the planned segments -> ``(out [1, Hq, 1, D], lse [1, Hq, 1])`` fp32. From
    ``SPLIT_TOKENS`` tokens with two or more torch threads, a second thread reads the later half of the tokens
    (the C loops run without the GIL) and the two states merge once."""
    _, hq, _, d = q.shape
    q = q.contiguous()
    out = torch.empty(1, hq, 1, d, dtype=torch.float32)
    lse = torch.empty(1, hq, 1, dtype=torch.float32)
    parts = [(s, 0, n) for s, n in todo]
    prep = {id(s): _skvq_prep(q, s, n) for s, n in todo if type(s) is SkvqSeg}
    sums = _scratch("l", hq)  # the running sums of exponentials (lse and out hold the rest of the state)
    if not parts:
        return out.zero_(), lse.fill_(float("-inf"))
    if sum(n for _, n in todo) >= SPLIT_TOKENS and _threads() >= 2:
        first, second = _halves(parts)
        if first and second:
            m2, l2, acc2 = torch.empty(hq), torch.empty(hq), torch.empty(hq * d)
            job = _worker().submit(_run, q, second, prep, scale, m2, l2, acc2, False)
            _run(q, first, prep, scale, lse, sums, out, False)
            job.result()
            cpu_native.library().mmkv_row_merge(lse.data_ptr(), sums.data_ptr(), out.data_ptr(), m2.data_ptr(),
                                                l2.data_ptr(), acc2.data_ptr(), hq, d, 1)
            return out, lse
    _run(q, parts, prep, scale, lse, sums, out, True)
    return out, lse


def _halves(parts: list) -> tuple[list, list]:
    """Segments' token ranges cut into two runs of about half the tokens each; a KIVI segment is cut on a key
    block's start (its scale block)."""
    half = sum(hi - lo for _, lo, hi in parts) // 2
    first, second, seen = [], [], 0
    for s, lo, hi in parts:
        cut = min(hi, max(lo, lo + half - seen))
        if type(s) is ChannelSeg:  # calibration takes each query's range over the whole segment: never cut
            cut = hi if seen < half else lo
        elif type(s) is KiviSeg:
            cut = min(hi, -(-cut // s.block) * s.block)
        if cut > lo:
            first.append((s, lo, cut))
        if hi > cut:
            second.append((s, cut, hi))
        seen += cut - lo
    return first, second


def _skvq_prep(q, s: SkvqSeg, n: int) -> tuple:
    """What the SKVQ loop reads beside the codes: the query in the keys' position order per head (scaled by
    nothing), scales and zeros of the first ``n`` tokens in fp32 (fp16 and FP8 widen exactly), the group masks and
    the values' position -> natural channel map. Made once a call, shared by both threads."""
    h, d = s.k_gid.shape
    g = q.shape[1] // h
    knat, kmask, _ = cpu_planes._side_maps(s.k_perm, s.k_gid, s.k_bits, d)
    vnat, vmask, _ = cpu_planes._side_maps(s.v_perm, s.v_gid, s.v_bits, d)
    qp = q.reshape(h, g, d).gather(-1, knat[:, None, :].expand(h, g, d)).contiguous()
    sz = [t[:, :, :n].to(torch.float32).contiguous() for t in (s.k_scale, s.k_zero, s.v_scale, s.v_zero)]
    return qp, sz, kmask, vmask, vnat


def _kind(bits: float) -> int:
    return 15 if bits == TERNARY else int(bits)


def _run(q, parts: list, prep: dict, scale: float, m, l, acc, fin: bool) -> None:
    """The C loops over ``parts`` in order, into the state ``(m, l, acc)``; ``fin``: normalized at the end."""
    lib = cpu_native.library()
    _, hq, _, d = q.shape
    last = len(parts) - 1
    for i, (s, lo, hi) in enumerate(parts):
        init, end = int(i == 0), int(fin and i == last)
        if type(s) is DenseSeg:
            h = s.k.shape[1]
            work = _work(hq, hq // h, d)
            lib.mmkv_row_dense(q.data_ptr(), s.k.data_ptr(), s.v.data_ptr(), m.data_ptr(), l.data_ptr(),
                               acc.data_ptr(), work.data_ptr(), hq, h, d, lo, hi, s.k.stride(1), s.v.stride(1), init,
                               end, scale)
        elif type(s) is ChannelSeg:
            h = s.k_codes.shape[1]
            work = _work(hq, hq // h, d)
            lg = _scratch("logits", hq // h * hi)
            tau1, tau2 = s.calib if s.calib is not None else (0.0, 0.0)
            lib.mmkv_row_channel(q.data_ptr(), s.k_codes.data_ptr(), s.k_scale.data_ptr(), s.k_zero.data_ptr(),
                                 s.v_codes.data_ptr(), s.v_scale.data_ptr(), s.v_zero.data_ptr(), m.data_ptr(),
                                 l.data_ptr(), acc.data_ptr(), work.data_ptr(), lg.data_ptr(), hq, h, d, hi, s.bits,
                                 s.block, s.k_codes.stride(1), s.k_scale.stride(1), s.v_codes.stride(1),
                                 s.v_scale.stride(1), _half(s), int(s.calib is not None), init, end, tau1, tau2,
                                 CALIB_MIN_RATIO, scale)
        elif type(s) is SkvqSeg:
            h = s.k_codes.shape[1]
            work = _work(hq, hq // h, d)
            qp, (ks, kz, vs, vz), km, vm, vnat = prep[id(s)]
            kh = 0 if s.k_hi is None else s.k_hi.data_ptr()
            vh = 0 if s.v_hi is None else s.v_hi.data_ptr()
            khs = (0, 0) if s.k_hi is None else (s.k_hi.stride(1), s.k_hi.stride(2))
            vhs = (0, 0) if s.v_hi is None else (s.v_hi.stride(1), s.v_hi.stride(2))
            lib.mmkv_row_skvq(qp.data_ptr(), s.k_codes.data_ptr(), kh, ks.data_ptr(), kz.data_ptr(), km.data_ptr(),
                              s.v_codes.data_ptr(), vh, vs.data_ptr(), vz.data_ptr(), vm.data_ptr(), vnat.data_ptr(),
                              m.data_ptr(), l.data_ptr(), acc.data_ptr(), work.data_ptr(), hq, h, d, lo, hi,
                              _kind(s.k_bits), _kind(s.v_bits), ks.shape[-1], vs.shape[-1],
                              s.k_codes.stride(1), s.k_codes.stride(2), *khs, ks.stride(1), ks.stride(2),
                              s.v_codes.stride(1), s.v_codes.stride(2), *vhs, vs.stride(1), vs.stride(2),
                              init, end, scale)
        else:
            h = s.k_codes.shape[1]
            work = _work(hq, hq // h, d)
            lib.mmkv_row_kivi(q.data_ptr(), s.k_codes.data_ptr(), s.k_scale.data_ptr(), s.k_zero.data_ptr(),
                              s.v_codes.data_ptr(), s.v_scale.data_ptr(), s.v_zero.data_ptr(), m.data_ptr(),
                              l.data_ptr(), acc.data_ptr(), work.data_ptr(), hq, h, d, lo, hi, s.k_bits, s.block,
                              s.v_bits, s.group, s.k_codes.stride(1), s.k_scale.stride(1), s.v_codes.stride(1),
                              s.v_scale.stride(1), _half(s), init, end, scale)


_POOL: list = []


def _worker() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmkv-row"))
    return _POOL[0]
