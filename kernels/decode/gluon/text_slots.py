"""Splits of the Gluon text kernel (``text.py``) in whole waves: how many of a compiled variant's programs an SM
holds (recorded at its first launch on a device), and the tiles per split that fill whole waves of them.

The byte rule of ``plan.plan_items`` (``plan.text_programs_per_sm`` programs per SM, tiles per split rounded down)
overshoots waves by a few programs: InternVL heads B16 n32768 gave 896 programs for 396 resident slots (2.26
waves). docs/KERNELS.md and docs/BENCHMARKS.md give the measurements behind ``text_waves``."""

from __future__ import annotations

import math

import torch

from ...switches import switch, wave_count

LONG_PROGRAM = 4096  # tokens a program of one wave may read before the splits go past one wave (text_waves)
FILL = 0.85  # least share of the started waves' slots the splits of more than one wave must use (text_waves)
_TEXT_RESIDENT: dict = {}  # text_slot_key(...) -> programs per SM of that compiled variant


def text_slot_key(dev_index: int, D: int, k_bits: int, v_bits: int, W: int, tiles: bool, pfd: int, regs,
                  svec: bool = False, ring=(0, False)) -> tuple:
    """What the text kernel's programs per SM depend on (its registers, its shared memory): the key ``text_resident``
    reads."""
    return ("text", dev_index, D, k_bits, v_bits, W, tiles, pfd, tuple(regs), svec, tuple(ring))


def text_resident(key: tuple) -> int | None:
    """Programs per SM of the text kernel variant ``key`` (``text_slot_key``), once it has been launched on that
    device; ``None`` before."""
    return _TEXT_RESIDENT.get(key)


def record_resident(kernel, device, key: tuple, W: int) -> None:
    """After a launch: note the programs per SM of its compiled ``kernel`` under ``key`` (once)."""
    if _TEXT_RESIDENT.get(key) is None:
        _TEXT_RESIDENT[key] = _programs_per_sm(kernel, device, W)


def _programs_per_sm(kernel, device, W: int) -> int | None:
    """Programs of a compiled text kernel one SM holds: registers (allocated per warp in units of 256, from the
    quarter register file of an SM sub-partition, as ``launch._record_resident`` counts them), shared memory and
    warp slots; ``None`` where the kernel object does not say."""
    n_regs = getattr(kernel, "n_regs", None)
    if not n_regs:
        return None
    props = torch.cuda.get_device_properties(device)
    regs_warp = -(-n_regs * 32 // 256) * 256
    by_regs = (getattr(props, "regs_per_multiprocessor", 65536) // 4 // regs_warp) * 4 // W
    shared = getattr(getattr(kernel, "metadata", None), "shared", 0)
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // (shared + 1024)
    return max(1, min(by_regs, by_smem, getattr(props, "max_threads_per_multi_processor", 2048) // 32 // W))


def text_waves(B: int, H: int, per_sm: int | None, nsm: int, long2: bool = False, tokens: int = 0) -> int:
    """Whole waves of resident programs a text segment's splits fill (0: the byte rule instead):
    ``MMKV_TEXT_WAVES`` if set, else, once the variant's ``per_sm`` programs per SM are known: below 32 (row, KV
    head) pairs 0, except 1 for ``long2`` (2-bit keys at head_dim 128, up to 8 pairs of 16k+ tokens; not with
    ``MMKV_TEXT_SPLIT=0``); 1 where one wave holds a program per pair and its ``floor(slots / pairs)`` splits of rows
    of ``tokens`` give programs under ``LONG_PROGRAM`` tokens; else the fewest waves from 3 whose ``floor(waves x
    slots / pairs)`` splits use at least ``FILL`` of the waves they start.

    One wave of long programs loses inside the step: timed in the decode step of random:internvl2.5-8b at 32k (graph
    replays, torch's profiler, one process; H100, 2026-11-27, docs/results/bisect_b16/h100_step_kernels_waves.txt),
    the kernel took us at one wave / the byte rule / 3 waves: KIVI-2 B16 258.9 / 228.5 / 191.8 (6 waves 207.0),
    XQuant B16 254.2 / 218.0 / 187.7, KIVI-2 B8 132.3 / 122.0 / 108.4, although the attention-call bench, the same
    call replayed alone, had one wave ahead at B16 (184.1 vs 194.3 us at 3). Inside the step the one wave of long
    programs made the whole step 7% slower than the byte rule (15.14 vs 14.16 ms, separate processes); the bisect
    (docs/results/bisect_b16/run.sh) found it. Those one-wave programs read 10923 (B16) and 5461 (B8) tokens; at
    KIVI-2 B16 n4096 (1365 tokens) one wave won in the step too, 39.6 us vs 42.7 / 42.3, and SmolLM2 heads (8 per
    SM: 22 splits at B16 n32768, 1489 tokens) were faster at one wave replayed alone (48.4 vs 53.4 us at 3; not
    timed in the step). ``LONG_PROGRAM`` sits between those points; it is not itself a measured optimum. At SmolLM2
    heads B64 n4096 (192 pairs of 528 slots) 3 waves were 19-28% slower than one.
    Past one wave, 3 waves can leave most of the last one idle: InternVL heads
    B60 n32768 (480 pairs, 3 programs per SM: 396 slots) at 3 waves take 2 splits, 960 programs, 2.42 waves;
    4 waves take 3 splits, 1440 programs, 3.64 waves. H100, graph replays, KIVI-2 / K2/V1 / KIVI-1 us at 3 / 4
    waves (2026-11-27, two device calls): 697.4 / 654.4, 681.1 / 631.3, 682.3 / 636.0 and 703.2 / 657.5, 685.2 /
    635.6, 687.6 / 640.0 (1 or 2 waves, one split: 803.3, 761.4, 764.1; 6 waves, 4 splits: 664.5, 643.1, 649.9).
    B64 (512 pairs) keeps 3 waves (2 splits, 2.59 waves: 709.7 / 688.1 / 684.5 vs 710.9 / 684.3 / 687.3 at 4).
    InternVL heads B30 n32768 (240 pairs) take 4 waves, 6 splits: 339.7 us KIVI-2 alone vs 393.2 at one split a
    pair; 359.8 in the step vs 367.0 for the byte rule. ``long2``: InternVL heads B1 n32768, 2 warps, 6 programs
    per SM, merge launch started early (``text_pdl``), KIVI-2 / K2/V1 us at 7 tiles a split (the byte rule: 74
    splits, 592 programs) / 6 (one wave: 86 splits, 688 programs) / 5 (824 programs, past a wave of 792): 21.0 /
    20.3 / 24.5, 21.0 / 20.5 / 23.9 (2026-11-27; the seventh session's "one wave", 25.7 vs 21.3 us, was the byte
    rule at 6 per SM: 5 tiles, 1.04 waves). 1-bit keys lost at fewer tiles a split (KIVI-1 19.4 / 22.8 at 7 / 6
    of 128 tokens), so keep the byte rule."""
    w = wave_count("MMKV_TEXT_WAVES")
    if w is not None:
        return w if per_sm else 0
    if not per_sm:
        return 0
    if B * H < 32:
        return 1 if long2 and switch("MMKV_TEXT_SPLIT") != "0" else 0
    slots = per_sm * nsm
    if B * H <= slots and tokens < LONG_PROGRAM * (slots // (B * H)):
        return 1
    for w in range(3, 9):  # the fewest waves from 3 whose splits fill FILL of the waves they start
        used = (w * slots // (B * H)) * B * H / slots
        if used / math.ceil(used) >= FILL:
            return w
    return 3


def wave_tiles(it: dict, dev_index: int, B: int, H: int, D: int, nsm: int) -> int | None:
    """Tiles per split of a planned text segment ``it`` (``plan.plan_items``' item) such that its splits fill
    ``text_waves`` whole waves, the tiles spread evenly over them; ``None`` for the byte rule."""
    s = it["seg"]
    per_sm = text_resident(text_slot_key(dev_index, D, s.k_bits, s.v_bits, it["tw"], s.v_order == "tiles",
                                         it["pfd"], it["regs"], it.get("svec", False), tuple(it.get("ring", (0, False)))))
    waves = text_waves(B, H, per_sm, nsm, s.k_bits == 2 and D == 128 and B * H <= 8 and it["T"] >= 16384, it["T"])
    if not waves:
        return None
    nsplit = max(1, waves * per_sm * nsm // (B * H))
    return -(-it["tiles"] // min(nsplit, it["tiles"]))
