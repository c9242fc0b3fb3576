"""Random segments of every layout, random queries, and the median timers that tests and benches share.

Builders: one per layout, the same for the CPU tests (a seeded ``torch.Generator`` on the CPU, tensors moved to
``device`` after drawing, so a test sees the same values on CPU and GPU) and the GPU benches (``g=None``: drawn
on ``device`` directly). Values are random and never zero; capacities are rounded up as the methods round them;
``lens`` is a list of per-row lengths, a tensor, or one int for every row (default: ``T``).

Timers (GPU only; ``triton.testing`` is imported when one is called, so that importing this module costs nothing
on a CPU): :func:`median_us` (``do_bench`` / ``do_bench_cudagraph`` medians), :func:`event_median_s` (CUDA events,
or wall time on a CPU), :class:`Rotator` and :func:`n_sets` (inputs rotated over enough sets that L2 does not hold
them), :func:`copy_bandwidth` (a 1 GiB device-to-device copy, the bandwidth roof).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from .layouts import ChannelSeg, DenseSeg, KiviSeg, SkvqSeg, pack, pack_planes, pack_ternary, reorder_values

L2_BYTES = 50 * 2**20  # H100's L2, rounded up


# ---- small helpers ------------------------------------------------------------------------------------------------


def _gen_device(g, device):
    """Where to draw: the generator's device, else the target device."""
    return g.device if g is not None else torch.device(device)


def lens_tensor(lens, B: int, device="cpu") -> torch.Tensor:
    """Per-row lengths as int32 on ``device``: from a list, a tensor, or one int for all ``B`` rows."""
    if isinstance(lens, int):
        return torch.full((B,), lens, dtype=torch.int32, device=device)
    return torch.as_tensor(lens, dtype=torch.int32).to(device)


def map_tensors(seg, fn):
    """A copy of segment ``seg`` with ``fn`` applied to every tensor field (e.g. ``.to(device)``, ``[:1]``)."""
    return dataclasses.replace(seg, **{f.name: fn(getattr(seg, f.name)) for f in dataclasses.fields(seg)
                                       if isinstance(getattr(seg, f.name), torch.Tensor)})


def seg_bytes(seg, with_lens: bool = False) -> int:
    """Bytes of a segment's tensors (codes, scales, zeros, K/V), ``lens`` only when asked."""
    ts = [(f.name, getattr(seg, f.name)) for f in dataclasses.fields(seg)]
    return sum(t.numel() * t.element_size() for name, t in ts
               if isinstance(t, torch.Tensor) and (with_lens or name != "lens"))


def rand_q(B: int, HQ: int, D: int, g=None, device="cpu", dtype=torch.float16, scale: float = 1.0) -> torch.Tensor:
    """One decode query per row, ``[B, HQ, D]``, standard normal times ``scale``."""
    q = torch.randn(B, HQ, D, generator=g, device=_gen_device(g, device))
    return (q * scale if scale != 1.0 else q).to(device, dtype)


# ---- segments -----------------------------------------------------------------------------------------------------


def dense_seg(B, H, T, D, lens=None, dtype=torch.float16, g=None, device="cpu") -> DenseSeg:
    gd = _gen_device(g, device)
    k = torch.randn(B, H, T, D, generator=g, device=gd).to(device, dtype)
    v = torch.randn(B, H, T, D, generator=g, device=gd).to(device, dtype)
    return DenseSeg(k, v, lens_tensor(T if lens is None else lens, B, device))


def channel_seg(B, H, T, D, bits, lens=None, calib=None, block=None, global_v=False, g=None, sdtype=torch.float16,
                device="cpu") -> ChannelSeg:
    """CalibQuant's layout: per-channel scale/zero per ``block`` tokens (default: one block), codes packed on T."""
    gd = _gen_device(g, device)
    per = 8 // bits
    cap = -(-T // per) * per
    block = block or cap
    nb = -(-cap // block)
    codes = dict(generator=g, device=gd, dtype=torch.uint8)
    kc = torch.randint(0, 2**bits, (B, H, cap, D), **codes)
    vc = torch.randint(0, 2**bits, (B, H, cap, D), **codes)
    ks = torch.rand(B, H, nb, D, generator=g, device=gd) * 0.5 + 0.05
    kz = torch.randn(B, H, nb, D, generator=g, device=gd)
    if global_v:  # one range per head shared by all channels: stride 0 on D
        vs = (torch.rand(B, H, nb, 1, generator=g, device=gd) * 0.5 + 0.05).expand(B, H, nb, D)
        vz = torch.randn(B, H, nb, 1, generator=g, device=gd).expand(B, H, nb, D)
    else:
        vs = torch.rand(B, H, nb, D, generator=g, device=gd) * 0.5 + 0.05
        vz = torch.randn(B, H, nb, D, generator=g, device=gd)
    return ChannelSeg(pack(kc, bits, 2).to(device), ks.to(device, sdtype), kz.to(device, sdtype),
                      pack(vc, bits, 2).to(device), vs.to(device, sdtype), vz.to(device, sdtype),
                      bits, block, lens_tensor(T if lens is None else lens, B, device), calib)


def kivi_seg(B, H, T, D, lens=None, k_bits=2, v_bits=2, block=32, group=32, g=None, device="cpu",
             order=None) -> KiviSeg:
    """KIVI's layout (also XQuant's, AQUA-KV's): K per channel over ``block`` tokens, V per token in ``group``s;
    values in ``order`` (``None``: the order the methods pack in on ``device``, ``plan.kivi_value_order``)."""
    gd = _gen_device(g, device)
    cap = -(-T // block) * block
    nb = cap // block
    kc = torch.randint(0, 2**k_bits, (B, H, cap, D), generator=g, device=gd, dtype=torch.uint8)
    vc = torch.randint(0, 2**v_bits, (B, H, cap, D), generator=g, device=gd, dtype=torch.uint8)
    ks = torch.rand(B, H, nb, D, generator=g, device=gd) * 0.3 + 0.05
    kz = torch.randn(B, H, nb, D, generator=g, device=gd)
    vs = torch.rand(B, H, cap, D // group, generator=g, device=gd) * 0.3 + 0.05
    vz = torch.randn(B, H, cap, D // group, generator=g, device=gd)
    if order is None:
        from .decode.plan import kivi_value_order
        order = kivi_value_order(k_bits, v_bits, block, group, D, device)
    return KiviSeg(pack(kc, k_bits, 2).to(device), ks.half().to(device), kz.half().to(device),
                   pack(reorder_values(vc, "natural", order), v_bits, 3).to(device), vs.half().to(device),
                   vz.half().to(device), k_bits, v_bits, block, group, lens_tensor(T if lens is None else lens, B, device),
                   order)


def random_groups(h, d, ng, g=None) -> torch.Tensor:
    """Monotone group ids with random sizes (>= 1 channel each) per head, ``[h, d]`` uint8 (CPU)."""
    out = []
    for _ in range(h):
        cuts = torch.randperm(d - 1, generator=g)[: ng - 1].sort().values + 1
        sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([d])]))
        out.append(torch.repeat_interleave(torch.arange(ng), sizes))
    return torch.stack(out).to(torch.uint8)


def skvq_seg(B, H, T, D, lens=None, k_bits=2, v_bits=2.0, ng=2, fixed=False, perm=True, fp8=False, g=None,
             device="cpu") -> SkvqSeg:
    """SKVQ's layout: ``ng`` groups per token after a channel permutation (``perm``), fixed-size (``fixed``) or
    variable groups (per-channel ids), 1/2/3/4-bit planes or 1.5-bit ternary, fp16 or FP8 scales. Drawn on the
    CPU (``g``'s device must be the CPU), then moved to ``device``."""

    def side(bits):
        levels = 2 if bits == 1.5 else (1 << int(bits)) - 1
        codes = torch.randint(0, levels + 1, (B, H, T, D), generator=g, dtype=torch.uint8)
        scale = (torch.rand(B, H, T, ng, generator=g) * 0.4 + 0.05) * 3 / levels  # ranges alike across bits
        zero = torch.randn(B, H, T, ng, generator=g)
        if fp8:
            scale, zero = scale.to(torch.float8_e4m3fn), zero.to(torch.float8_e4m3fn)
        else:
            scale, zero = scale.half(), zero.half()
        if bits == 1.5:
            lo, hi = pack_ternary(codes), None
        else:
            planes = pack_planes(codes, int(bits), dim=3)
            lo, hi = planes[0], (planes[1] if len(planes) > 1 else None)
        p = torch.stack([torch.randperm(D, generator=g) for _ in range(H)]).to(torch.uint8) if perm else None
        size = D // ng if fixed else 0
        gid = (torch.arange(D) // (D // ng)).to(torch.uint8).expand(H, D).contiguous() if fixed \
            else random_groups(H, D, ng, g)
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return mv(lo), mv(hi), scale.to(device), zero.to(device), mv(p), gid.to(device), size

    kl, kh, ks, kz, kp, kg, kf = side(k_bits)
    vl, vh, vs, vz, vp, vg, vf = side(v_bits)
    return SkvqSeg(kl, kh, ks, kz, vl, vh, vs, vz, k_bits, float(v_bits), kp, kg, kf, vp, vg, vf,
                   lens_tensor(T if lens is None else lens, B, device))


def aligned_kv(B, H, T, D, g=None, binades=4, per_head=False, device="cpu", dtype=None):
    """K with per-channel magnitudes ``2**randint(-binades, binades)`` (real keys' columnar pattern; one pattern
    for all heads unless ``per_head``), V standard normal; fp32 unless ``dtype``."""
    gd = _gen_device(g, device)
    shape = (1, H if per_head else 1, 1, D)
    scale = torch.exp2(torch.randint(-binades, binades + 1, shape, generator=g, device=gd).float())
    k = torch.randn(B, H, T, D, generator=g, device=gd) * scale
    v = torch.randn(B, H, T, D, generator=g, device=gd)
    if dtype is not None:
        k, v = k.to(dtype), v.to(dtype)
    return k.to(device), v.to(device)


def aligned_seg(B, H, T, D, lens, quantize, g=None, device="cpu", binades=4):
    """AlignedKV's layout: :func:`aligned_kv` drawn on the CPU, stored by ``quantize(k, v, lens)`` (the method's
    own, e.g. ``AlignedKV(block=32).quantize``: kernels do not import mmkv), then moved to ``device``."""
    k, v = aligned_kv(B, H, T, D, g, binades)
    seg = quantize(k, v, lens_tensor(T if lens is None else lens, B))
    return map_tensors(seg, lambda t: t.to(device))


# ---- timers -------------------------------------------------------------------------------------------------------


def median_us(fn, graphs: bool = False, rep: int | None = None, warmup: int = 25) -> float:
    """Median microseconds per ``fn()``: ``triton.testing.do_bench`` (L2 flushed before every call; host launch
    included), or ``do_bench_cudagraph`` replays when ``graphs`` (launch cost removed). ``rep`` in ms of timing,
    default 200 with graphs, 150 without."""
    from triton.testing import do_bench, do_bench_cudagraph

    if graphs:
        return do_bench_cudagraph(fn, rep=rep or 200, return_mode="median") * 1e3
    return do_bench(fn, warmup=warmup, rep=rep or 150, return_mode="median") * 1e3


def event_median_s(fn, iters: int, device, graphs: bool = False) -> float:
    """Median seconds per ``fn()`` over ``iters`` calls: CUDA events around each call (after 3 warm-up calls;
    ``graphs`` times one captured graph's replay), or wall time on a CPU device."""
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graphs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
        fn()
    times = []
    for _ in range(iters):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) / 1e3)
    return statistics.median(times)


def copy_bandwidth(device="cuda") -> float:
    """GB/s of a 1 GiB device-to-device copy, counting read + write."""
    from triton.testing import do_bench

    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median") * 1e-3
    return 2 * n / t / 1e9


def n_sets(bytes_per_set: int, least: int = 2, most: int = 6, l2_bytes: int = L2_BYTES) -> int:
    """How many input sets to rotate over so that together they are >= 4x the L2 (clamped to [least, most])."""
    return max(least, min(most, math.ceil(4 * l2_bytes / max(1, bytes_per_set))))


class Rotator:
    """Calls ``fn(*sets[i])`` for i = 0, 1, 2, ... cyclically."""

    def __init__(self, sets, fn):
        self.sets, self.fn, self.i = sets, fn, 0

    def __call__(self):
        s = self.sets[self.i % len(self.sets)]
        self.i += 1
        return self.fn(*s)
