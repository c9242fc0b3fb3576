"""The plan of one ``decode_attention`` call from shapes alone (no device sync): tiles and splits per segment, and
for 1-bit channel segments the fused / cluster variants; plus the device facts and ``MMKV_*`` switches it reads."""

from __future__ import annotations

import math

import torch

from ..layouts import ChannelSeg, DenseSeg, KiviSeg, natural_values, per_byte
from ..switches import count_switch, interpreted, switch
from . import gluon as _gc
from .capability import capability as _capability
from .gluon.skvq_ok import skvq_gluon_ok as _skvq_ok
from .gluon.text_ok import text_ok, text_svec, tiles_ok
from .gluon.text_slots import wave_tiles
from .registry import KIND_CHANNEL, KIND_DENSE, KIND_KIVI, KIND_PLUGIN, LAYOUTS
from .text_rules import (
    text_pdl,
    text_prefetch_span,
    text_programs_per_sm,
    text_regs,
    text_split,
    text_unmasked,
    text_warps,
)
from .window_rules import channel_overlap, window_overlap, window_tps

_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _capacity(seg) -> int:
    if isinstance(seg, DenseSeg):
        return seg.k.shape[2]
    if isinstance(seg, ChannelSeg):
        return seg.k_codes.shape[2] * per_byte(seg.bits)
    if isinstance(seg, KiviSeg):
        return seg.k_codes.shape[2] * per_byte(seg.k_bits)
    if type(seg) in LAYOUTS:
        return LAYOUTS[type(seg)].capacity(seg)
    raise TypeError(f"unknown segment type {type(seg).__name__}")


def _kv_heads(seg) -> int:
    if isinstance(seg, DenseSeg):
        return seg.k.shape[1]
    if isinstance(seg, (ChannelSeg, KiviSeg)):
        return seg.k_codes.shape[1]
    if type(seg) in LAYOUTS:
        return LAYOUTS[type(seg)].kv_heads(seg)
    raise TypeError(f"unknown segment type {type(seg).__name__}")


_GLUON_BROKEN: list = []


def text_prefetch(device, B: int, H: int, T: int, D: int, capped: bool = False) -> int:
    """Iterations ahead the Gluon text kernel requests its bytes into L2 (``gluon/text_prefetch.py``; bulk prefetch:
    sm_90+ only, else 0): ``MMKV_TEXT_PREFETCH`` if set (0: none), else 1 at head_dim 128 from a million (batch x KV
    heads x tokens) or for one row's few long heads (up to 8 (row, KV head) pairs of 16k+ tokens), else 0. H100
    (docs/BENCHMARKS.md, us at 0 / 1 / 2 ahead): InternVL heads B16 n32768 KIVI-2 216.7 / 202.7 / 202.6; SmolLM2
    heads (head_dim 64) B16 n32768 54.4 / 58.6 / 59.1. B1 n32768 alone gained nothing (its 25 MB stay in L2 between
    replays of one call), but inside a decode step, where the weights pass through L2 between two layers' calls, the
    text kernel went 24.1 -> 21.1 us a layer (KIVI-2, ``eval/studies/step_kernels.py``). ``capped`` (a register cap,
    ``text_regs``): 0, the prefetch's addresses cost 50+ registers with 1-bit keys and spill under the cap."""
    if _capability(device)[0] < 9:
        return 0
    p = count_switch("MMKV_TEXT_PREFETCH", 0, 4)
    if p is not None:
        return p
    few_long = B * H <= 8 and T >= 16384
    return 1 if D == 128 and (B * H * T >= 1 << 20 or few_long) and not capped else 0


def text_ring(device, B: int, H: int, T: int, D: int, k_bits: int = 2) -> tuple[int, bool]:
    """(stages, key scale/zero too) of the Gluon text kernel's key-code ring (``gluon/text_ring.py``: ``cp.async``
    into shared memory, stages - 1 iterations ahead; sm_80+, else none): ``MMKV_TEXT_RING`` if set (0: none; 2-6
    stages, with an ``s`` after the number the key scale/zero rows too, e.g. ``3s``), else 3 stages of key codes for
    2-bit keys at head_dim 64 over a few long rows (up to 8 (row, KV head) pairs of 16k+ tokens), else none.
    H100, graph replays, us at none / 3 stages / 3 with the scales (docs/BENCHMARKS.md): SmolLM2 heads B1 n32768
    KIVI-2 12.1 / 10.9 and 12.3 / 11.1 / 11.8 (two sessions), K2/V1 13.5 / 12.5, KIVI-1 14.9 / 15.0; slower
    everywhere else measured: InternVL heads B16 n32768 KIVI-2 203.6 / 225.1 / 297.3, B1 n32768 21.9 / 22.9, B64
    n32768 739.7 / 826.1; SmolLM2 heads B16 n32768 58.4 / 59.7, B1 n4096 7.0 / 7.2. The ring's reads cost a block
    barrier per iteration (Triton's shared-memory hazard pass), which ties the warps of a program together."""
    if _capability(device)[0] < 8:
        return (0, False)
    r = switch("MMKV_TEXT_RING")
    if r:
        n = r[:-1] if r.endswith("s") else r
        if n not in ("0", "2", "3", "4", "5", "6") or r == "0s":
            raise ValueError(f"MMKV_TEXT_RING must be 0 or 2-6 stages (optionally followed by s), got {r}")
        return (int(n), r.endswith("s"))
    return (3, False) if D == 64 and k_bits == 2 and B * H <= 8 and T >= 16384 else (0, False)


def _text_gluon_ok(seg, q, G, D) -> bool:
    """Does the Gluon KIVI/XQuant kernel (``gluon/text.py``) read this segment? ``MMKV_TEXT_GLUON=0``: never."""
    if _GLUON_BROKEN or not (_gc.HAVE_GLUON and q.is_cuda and switch("MMKV_NO_GLUON") != "1"):
        return False
    if interpreted() or switch("MMKV_TEXT_GLUON") == "0":
        return False
    return _capability(q.device)[0] >= 8 and text_ok(seg, G, D)


def kivi_value_order(k_bits: int, v_bits: int, block: int, group: int, D: int, device) -> str:
    """The value order a KIVI/XQuant method packs a flushed block in on ``device``: ``"tiles"`` where the post-scaled
    Gluon text kernel will read it (a CUDA device of sm_80+, Gluon present and not switched off, parameters it
    covers; ``MMKV_KIVI_TILES=0``: never; ``all``: at head_dim 64 too), else ``"natural"``. Readers of the other
    paths un-permute per call.

    Only at head_dim 128: there the post-scaled variant measured 1.03-1.05x the pre-scaled one at B16 n32768 and
    B64 n4096 (H100, InternVL heads, all three layouts); at head_dim 64 (SmolLM2 heads) it was 0.97-1.03x with 2-bit
    keys and 0.86x with 1-bit keys (more registers), so head_dim 64 keeps the natural order (docs/BENCHMARKS.md;
    again in session 21 with ``all``: KIVI-2 B16 n32768 50.2 / 51.8 us natural / tiles, only 1-bit layouts gained)."""
    device = torch.device(device)
    t = switch("MMKV_KIVI_TILES")
    if t not in ("0", "1", "all"):
        raise ValueError(f"MMKV_KIVI_TILES must be 0, 1 or all, got {t}")
    if device.type != "cuda" or t == "0" or (D != 128 and t != "all") \
            or not tiles_ok(k_bits, v_bits, block, group, D):
        return "natural"
    if not _gc.HAVE_GLUON or switch("MMKV_NO_GLUON") == "1" or switch("MMKV_TEXT_GLUON") == "0" or interpreted():
        return "natural"
    return "tiles" if _capability(device)[0] >= 8 else "natural"


def skvq_gluon_ok(seg, dev, G, D) -> bool:
    """Does the Gluon SKVQ kernel (``gluon/skvq.py``) read this segment on ``dev`` with ``G`` query heads per KV head?
    ``MMKV_SKVQ_GLUON=0`` (or ``MMKV_NO_GLUON=1``): never; the Triton kernel (``skvq.py``) reads it."""
    if _GLUON_BROKEN or not (_gc.HAVE_GLUON and dev.type == "cuda" and switch("MMKV_NO_GLUON") != "1"):
        return False
    return _capability(dev)[0] >= 8 and _skvq_ok(seg, G, D)


def _generic_channel_tiles(it, S_tokens: int):
    """(tile tokens, tiles per split) of the Triton channel kernel covering the same tokens per split."""
    per = per_byte(it["seg"].bits)
    tt = min(128, max(16, per * 8))
    return tt, max(1, S_tokens // tt)


def _gluon_ok(seg, q, G, D) -> bool:
    if _GLUON_BROKEN or not (_gc.HAVE_GLUON and q.is_cuda and switch("MMKV_NO_GLUON") != "1"):
        return False
    if interpreted():
        return False
    return (_capability(q.device)[0] >= 8 and G <= 8 and D in (64, 128) and seg.block >= _capacity(seg)
            and seg.k_codes.stride(-1) == 1 and seg.k_codes.stride(-2) == D
            and seg.v_codes.stride() == seg.k_codes.stride())


def _splits(n_units: int, units_per_split: int) -> int:
    return max(1, -(-n_units // max(1, units_per_split)))


def _one_wave_tiles(it, dev, B, H, D, G, warps, channel_stages, nsm, tile_bytes) -> int:
    """Tiles per split of a Gluon channel segment's main pass such that its programs fill one wave: the programs
    one multiprocessor holds at once (measured best on the H100; fewer leave latency unhidden, more start a second
    wave), at least 16 KB of codes per program. Before the variant is compiled, 5 per multiprocessor."""
    bits = it["seg"].bits
    st = _gc.default_stages(bits) if channel_stages is None else channel_stages  # the long-program variant
    cap = _gc.resident_programs(dev.index, D, bits, warps, st, 0, _int8_k(bits, G)) or 5
    splits = max(1, cap * nsm // (B * H))
    return max(-(-it["tiles"] // splits), -(-16384 // max(1, tile_bytes)))


def _fused_warps(pairs: int, n: int, nsm: int) -> int:
    """Warps per program of the fused kernel for ``pairs`` (row, KV head) pairs over a span of ``n`` tokens, from
    side-by-side sweeps of 2, 4, 8 and 16 warps on the H100 (docs/results/h100_warps_sweep.txt). Larger programs pay
    their fixed costs (q and scales, the (min, max) exchange, the epilogue) once per more warps, so they win wherever
    their loops stay long enough and their programs fill the waves they take:

    * n >= 8192: 16 warps (one program per pair and SM) from 0.9 x nsm pairs while up to 4 waves fill (B=16: 21.5 vs
      26.9 us at 2 warps; B=64: 76.6 vs 79.6 at 4), 4 beyond (B=139: 158.7 vs 167.3 at 16, 166.7 at 2), 8 below
      (B=8: 15.8 vs 18.3);
    * n >= 3072: 8 warps (two per SM) while up to 4 waves fill (B=16 n=3328: 11.5 vs 13.1 at 4; B=128: 65.9 vs 68.8
      at 2), else 2 (B=40: 1.21 waves, 26.0 vs 29.7 at 8; B=139: 4.21 waves, 73.2 vs 75.2);
    * n >= 16384 (a pair's logits no longer fit one SM): 2 warps from nsm / 4 to nsm pairs (B=16, n=32768: 88.9 vs
      90.8 at 4), else 4 (B=64: 325.4 vs 448.6 at 2);
    * fewer than nsm / 4 pairs: 4 warps spread further (B=4, n=3328: 10.5 vs 11.7 at 8)."""

    def fills(waves: float) -> bool:  # within one wave, or up to 4 whose last is >= 85% full
        return waves <= 1 or (waves <= 4 and waves / math.ceil(waves) >= 0.85)

    if n >= 16384:
        return 2 if nsm / 4 <= pairs <= nsm or pairs > 4 * nsm else 4
    if pairs < nsm / 4:
        return 4
    if n >= 8192:
        return 8 if pairs < 0.9 * nsm else (16 if fills(pairs / nsm) else 4)
    if n >= 3072:
        return 8 if fills(pairs / (2 * nsm)) else 2
    return 4 if pairs <= 4 * nsm else 2


def _plan_fused(it, dev, B, H, D, G, warps, nsm, pps, auto_warps, tile_bytes):
    """``_fused_plan`` at the warps ``_fused_warps`` picks (where the caller left warps and programs per SM open),
    else at ``warps``; a plan at other warps re-tiles the segment (``it["tt"]``, ``it["tiles"]``, ``it["w"]``)."""
    seg = it["seg"]
    per = per_byte(seg.bits)
    tries = [warps]
    if auto_warps:
        w = _fused_warps(B * H, it["T"], nsm)
        tries = [w] + ([warps] if w != warps else [])
    for w in tries:
        tt = w * _gc.rows_per_warp(seg.bits) * per
        trial = dict(it, tt=tt, tiles=max(1, -(-it["T"] // tt)))
        plan = _fused_plan(trial, dev, B, H, D, G, w, nsm, tile_bytes(trial), pps)
        if plan:
            it.update(tt=trial["tt"], tiles=trial["tiles"], w=w)
            return plan
    return None


def _fused_plan(it, dev, B, H, D, G, warps, nsm, tile_bytes, pps=None):
    """(tiles per split, logit slots per program, CTAs per cluster) of the fused channel kernel (``gluon/kernel.py``
    mode 2: K, the barrier over a (row, KV head)'s splits, then V; K is read once), or ``None`` where it does not
    apply. On sm_90 the splits of a pair are one thread block cluster (``_cluster_plan``) unless the rule below
    prefers the counter barrier; that one (cluster size 0) needs every program of the grid resident at once (one
    wave) with its logits in shared memory.
    The most programs per SM (``pps``, else what registers allow, 8 before the first compile) whose shared memory
    fits wins; below 4 per SM, and above 32 splits per (row, KV head) (batch 1 at n = 32768: 64 splits, 17.7 vs
    16.8 us two-pass on the H100; every program waits for all splits), the two-pass kernels are used.
    ``MMKV_FUSED=0`` switches it off."""
    bits = it["seg"].bits
    if switch("MMKV_FUSED") == "0" or not _int8_k(bits, G):
        return None
    cap = int(pps or _gc.programs_by_registers(dev.index, D, bits, warps, 0, 2, True) or max(1, 16 // warps))
    smem = _smem_per_sm(dev)
    floor = -(-16384 // max(1, tile_bytes))
    wave = cap * nsm // (B * H)  # splits per (row, KV head) that one wave of programs holds
    # measured on the H100 at 2 warps (docs/results/h100_cluster_ablation.txt): where a wave holds 8+ splits of 8+
    # tiles each, the counter barrier over one exactly full wave is faster (B=16, n=8192: 25.1 us; clusters of 8 do
    # not all fit at once, of 4 28.5); elsewhere clusters (B=16, n=3328: 15.4 vs 16.4; B=32: 21.7 vs 24.5; B=64:
    # 42.5 vs 44.3; B=128: 69.2 vs 92.9 two-pass, where no counter plan exists)
    # the GPU co-schedules ~94% of the clusters its SMs would hold (H100: 124 of 8 CTAs, 248 of 4, 528 of 2)
    fit = int(0.93 * cap * nsm) // (B * H)
    if (_clusters_ok(dev) and not (wave >= 8 and it["tiles"] >= 8 * min(wave, 32))
            and not (fit > 16 and it["tiles"] > 64)):  # few rows of a long span: more splits than 8 pay (B=2,
        # n=32768: 23.0 us in clusters of 8, 21.9 two-pass)
        plan = _cluster_plan(it["tiles"], min(fit, _cluster_max()), floor, smem, warps, bits)
        if plan:
            return plan
    for c in range(cap, 3, -1):
        splits = max(1, c * nsm // (B * H))
        tps = min(it["tiles"], max(-(-it["tiles"] // splits), floor))
        itm = tps + tps % 2  # even: fewer compiled variants, and a whole short span still fits (B=64, n=3328: 26)
        if c * (_gc.fused_shared_bytes(itm, warps, bits) + 2048) > smem:
            continue
        nsplit = _splits(it["tiles"], tps)
        if nsplit > 32 or nsplit * B * H > c * nsm or not _int8_k(bits, G, nsplit * B * H, nsm):
            return None
        return tps, itm, 0
    return None


def _cluster_plan(tiles: int, wave_splits: int, floor: int, smem: int, warps: int, bits: int):
    """(tiles per split, logit slots, cluster size) of the fused kernel with one thread block cluster per (row, KV
    head) (sm_90): its CTAs are the splits, a hardware cluster barrier replaces the counters, and the grid may take
    several waves (each cluster is co-scheduled as a whole, so no wait can block). Splits: ``wave_splits`` (those
    that one wave holds) rounded down to a power of two in 2..8 (8: the portable cluster size; 1, one program per
    pair and no cluster, for programs of 8+ warps), fewer where a split would read under ``floor`` tiles, more where
    the logits would not fit in shared memory with 8 warps per SM. ``None`` where one wave would want more than 8
    splits (few rows: the counter barrier spreads wider)."""
    if wave_splits > 8:
        return None
    low = 1 if warps >= 8 else 2
    cl = max(low, 1 << max(0, wave_splits.bit_length() - 1))
    while cl > low and -(-tiles // cl) < floor:
        cl //= 2
    # where the logits do not fit, more CTAs per cluster; not for programs of 8+ warps, which then take several
    # waves (measured slow: B=16, n=32768 at 16 warps in clusters of 4, 114 us; two-pass 91)
    top = 8 if warps <= 4 else cl
    while cl <= top:
        tps = -(-tiles // cl)
        itm = tps + tps % 2
        if max(1, 8 // warps) * (_gc.fused_shared_bytes(itm, warps, bits) + 2048) <= smem:  # 8+ warps per SM
            return tps, itm, cl
        cl *= 2
    return None


def _cluster_max() -> int:
    return int(switch("MMKV_CLUSTER_MAX"))


def _clusters_ok(dev) -> bool:
    """Thread block clusters (sm_90+, compiled kernels through ``Launcher``); ``MMKV_CLUSTER=0`` switches them off."""
    return switch("MMKV_FAST_LAUNCH") != "0" and _sm90_compiled(dev, "MMKV_CLUSTER")


def _sm90_compiled(dev, name: str) -> bool:
    """A CUDA device of sm_90+ running compiled kernels (not the interpreter), and the environment switch ``name``
    not set to 0."""
    return (dev.type == "cuda" and not interpreted()
            and switch(name) != "0" and _capability(dev)[0] >= 9)


def _smem_per_sm(dev) -> int:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SMEM:
        _SMEM[idx] = getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_multiprocessor", 228 * 1024)
    return _SMEM[idx]


_SMEM: dict = {}


def _int8_k(bits: int, G: int, programs: int | None = None, nsm: int = 0) -> bool:
    """Whether the Gluon channel kernels run their K side on int8 tensor cores (q*s as 16-bit fixed point in two
    bytes, both in one m16n8k32 MMA): for 1-bit codes and up to 4 query heads per KV head, where the main pass has at
    least one program per multiprocessor (``programs``; ``None``: eligibility only). The int8 side has a longer
    prologue and per-iteration dependency chain; with fewer programs nothing hides them, and fp16 measured faster
    (docs/BENCHMARKS.md). ``MMKV_INT8_K=0`` switches it off, ``=1`` on wherever eligible."""
    mode = switch("MMKV_INT8_K")
    if mode == "0" or bits != 1 or G > 4:
        return False
    return mode == "1" or programs is None or programs >= nsm


def _pdl_ok(dev) -> bool:
    """Programmatic dependent launch (a kernel's programs start while the previous kernel ends, and wait for it
    before they read its output; used range pass -> main pass -> merge) needs sm_90+ and compiled kernels;
    ``MMKV_PDL=0`` switches it off."""
    return _sm90_compiled(dev, "MMKV_PDL")


def plan_items(q, segs, B, H, G, D, nsm, gluon, warps, auto_warps, programs_per_sm, channel_stages, text_tile):
    """The plan half of one ``decode_attention`` call: per segment its kind, tile, tiles per split, split count and
    global split offset (``items``, in launch order), the total split count ``S``, and the item whose clusters merge
    every partial into the output (``fin``, or ``None``: a merge launch follows). Shapes only: no device sync."""
    dev = q.device
    HQ = H * G
    # ---- plan: tiles per segment, then tokens per split from the total work ------------------------------------
    items = []
    for seg in segs:
        T = _capacity(seg)
        lens = seg.lens
        if lens.device != dev or lens.dtype != torch.int32:
            lens = lens.to(device=dev, dtype=torch.int32)
        if isinstance(seg, DenseSeg):
            it = dict(kind=KIND_DENSE, seg=seg, T=T, lens=lens, tt=64 if D <= 64 else 32, gl=False)
        elif isinstance(seg, ChannelSeg):
            use_gl = _gluon_ok(seg, q, G, D) if gluon is None else (gluon and _gluon_ok(seg, q, G, D))
            per = per_byte(seg.bits)
            if use_gl:
                tt = warps * _gc.rows_per_warp(seg.bits) * per  # tokens per program iteration
            else:
                tt = min(128, max(16, per * 8))
                single = seg.block >= T or seg.k_scale.shape[2] == 1
                if not single:
                    tt = min(tt, 1 << (seg.block.bit_length() - 1))
                    if tt < 16 or tt % per:
                        raise ValueError(f"channel block {seg.block} is too small for the Triton channel kernel: "
                                         f"it needs blocks of at least 16 tokens")
            it = dict(kind=KIND_CHANNEL, seg=seg, T=T, lens=lens, tt=tt, gl=use_gl)
        elif isinstance(seg, KiviSeg):
            tt = text_tile
            if seg.block < 16 or seg.block & (seg.block - 1) or seg.group & (seg.group - 1):
                raise ValueError(f"KIVI block {seg.block} and group {seg.group} must be powers of two >= 16")
            use_gl = _text_gluon_ok(seg, q, G, D) and gluon is not False
            if not use_gl:  # values packed for the post-scaled kernel, read by another: natural order (a copy)
                seg = natural_values(seg)
            tw = text_warps(B, H, T, D) if use_gl else 0
            if use_gl:
                tt = tw * 8 * per_byte(seg.k_bits)  # tokens per program iteration: 8 byte rows of K codes per warp
            regs = text_regs(seg.k_bits, D, B, H, T) if use_gl else (False, 0)
            it = dict(kind=KIND_KIVI, seg=seg, T=T, lens=lens, tt=tt, gl=False, tgl=use_gl, tw=tw, regs=regs,
                      full=text_unmasked() if use_gl else False,
                      pfd=text_prefetch(q.device, B, H, T, D, regs[1] > 0) if use_gl else 0,
                      svec=text_svec(seg, T, D) if use_gl else False,
                      ring=text_ring(q.device, B, H, T, D, seg.k_bits) if use_gl else (0, False))
            it["pfn"] = text_prefetch_span(B * H) if it["pfd"] else 1
        elif type(seg) in LAYOUTS:
            it = dict(kind=KIND_PLUGIN, seg=seg, T=T, lens=lens, tt=LAYOUTS[type(seg)].tile(seg, D), gl=False)
        else:
            raise TypeError(f"unknown segment type {type(seg).__name__}")
        it["tiles"] = max(1, -(-T // it["tt"]))
        items.append(it)

    # bytes a tile moves, to balance splits across kinds (codes vs fp16)
    def tile_bytes(it):
        s = it["seg"]
        if it["kind"] == KIND_DENSE:
            return it["tt"] * D * 2 * s.k.element_size()
        if it["kind"] == KIND_CHANNEL:
            return it["tt"] * D * 2 * s.bits // 8
        if it["kind"] == KIND_PLUGIN:
            return LAYOUTS[type(s)].tile_bytes(s, it["tt"], D)
        return it["tt"] * D * (s.k_bits + s.v_bits) // 8

    total_bytes = sum(it["tiles"] * tile_bytes(it) for it in items) * B * H
    pps = programs_per_sm
    if pps is None:  # the channel kernels size their own splits below; this sizes the text and dense ones
        text = [it["T"] for it in items if it.get("tgl")]
        pps = text_programs_per_sm(B, H, max(text)) if text else 4.0
    target_programs = pps * nsm
    bytes_per_prog = max(total_bytes / target_programs, 16 * 1024)
    S = 0
    longest = max(it["T"] for it in items)
    for it in items:
        tps = max(1, int(bytes_per_prog // max(1, tile_bytes(it))))
        if it["kind"] == KIND_DENSE:
            tps = window_tps(it["T"], tps, longest)
        fused = it["gl"] and channel_stages in (None, 0) and _plan_fused(it, dev, B, H, D, G, warps, nsm,
                                                                         programs_per_sm, auto_warps, tile_bytes)
        if fused:
            tps, it["itm"], it["cl"] = fused
        elif it["gl"] and programs_per_sm is None:
            tps = _one_wave_tiles(it, dev, B, H, D, HQ // H, warps, channel_stages, nsm, tile_bytes(it))
        elif it.get("tgl") and programs_per_sm is None and dev.type == "cuda":
            tps = wave_tiles(it, dev.index, B, H, D, nsm) or tps
            tps, it["cl"] = text_split(it, B, H, tps, _clusters_ok(dev))
            it["pdl"] = text_pdl(B, H, it["T"], D) if _pdl_ok(dev) and not it["cl"] else 0
        elif it["kind"] == KIND_PLUGIN and programs_per_sm is None:
            lay = LAYOUTS[type(it["seg"])]
            if lay.wave_tiles is not None and dev.type == "cuda":
                tps = lay.wave_tiles(it["seg"], it, B, H, G, D, nsm) or tps
            if lay.split is not None:
                tps, pdl = lay.split(it["seg"], it, B, H, D, tps)
                it["pdl"] = pdl if _pdl_ok(dev) else 0
        it["tps"] = min(tps, it["tiles"])
        it["nsplit"] = it.get("cl") or _splits(it["tiles"], it["tps"])  # a cluster's CTAs past the span idle
        it["s_off"] = S
        S += it["nsplit"]

    # a segment that runs as clusters goes last and its clusters merge every partial of their rows into the output
    # (no merge launch); the other segments' kernels run before it on the stream
    clustered = [it for it in items if it.get("cl")]
    fin = clustered[-1] if clustered and switch("MMKV_FIN") != "0" else None
    if fin is not None:
        fin["fin"] = True
        items = [it for it in items if it is not fin] + [fin]
    # the last kernel may start beside the one before it, which then triggers at once (``window_rules``)
    if _pdl_ok(dev) and (window_overlap(items) or channel_overlap(items)):
        items[-2]["trig"] = items[-1]["dep"] = True
    return items, S, fin
