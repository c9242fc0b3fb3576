"""Splits of the Gluon text kernel (``text.py``) in whole waves: how many of a compiled variant's programs an SM
holds (recorded at its first launch on a device), and the tiles per split that fill whole waves of them.

The byte rule of ``plan.plan_items`` (``plan.text_programs_per_sm`` programs per SM, tiles per split rounded down)
overshoots waves by a few programs: InternVL heads B16 n32768 gave 896 programs for 396 resident slots (2.26
waves). docs/KERNELS.md and docs/BENCHMARKS.md give the measurements behind ``text_waves``."""

from __future__ import annotations

import torch

from ...switches import switch, wave_count
from ..text_rules import text_bcol, text_kpair
from ..waves import FEW_PAIRS, whole_waves

_TEXT_RESIDENT: dict = {}  # text_slot_key(...) -> programs per SM of that compiled variant


def text_slot_key(dev_index: int, D: int, k_bits: int, v_bits: int, W: int, tiles: bool, pfd: int, regs,
                  svec: bool = False, ring=(0, False), unmasked: bool = True, pfn: int = 1,
                  kpair: bool = True, bcol: bool = True) -> tuple:
    """What the text kernel's programs per SM depend on (its registers, its shared memory): the key ``text_resident``
    reads."""
    return ("text", dev_index, D, k_bits, v_bits, W, tiles, pfd, tuple(regs), svec, tuple(ring), unmasked, pfn,
            kpair, bcol)


def text_resident(key: tuple) -> int | None:
    """Programs per SM of the text kernel variant ``key`` (``text_slot_key``), once it has been launched on that
    device; ``None`` before."""
    return _TEXT_RESIDENT.get(key)


def record_resident(kernel, device, key: tuple, W: int) -> None:
    """After a launch: note the programs per SM of its compiled ``kernel`` under ``key`` (once)."""
    if _TEXT_RESIDENT.get(key) is None:
        _TEXT_RESIDENT[key] = programs_per_sm(kernel, device, W)


def programs_per_sm(kernel, device, W: int) -> int | None:
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


def text_waves(B: int, H: int, per_sm: int | None, nsm: int, long2: bool = False, tokens: int = 0,
               D: int = 128) -> int:
    """Whole waves of resident programs a text segment's splits fill (0: the byte rule instead):
    ``MMKV_TEXT_WAVES`` if set, else, once the variant's ``per_sm`` programs per SM are known: below 32 (row, KV
    head) pairs 0, except 1 for ``long2`` (2-bit keys at head_dim 128, up to 8 pairs of 16k+ tokens; not with
    ``MMKV_TEXT_SPLIT=0``); from 32 pairs ``waves.whole_waves`` of rows of ``tokens`` at head_dim ``D`` (its table:
    the kernel's time inside the decode step). The bisect (docs/results/bisect_b16/run.sh) found one wave of long
    rows making the whole step 7% slower than the byte rule (15.14 vs 14.16 ms, KIVI-2 B16 n32768); inside that step
    the kernel took 258.9 / 228.5 / 191.8 us at one wave / the byte rule / 3 waves (6 waves 207.0; XQuant 254.2 /
    218.0 / 187.7, KIVI-2 B8 132.3 / 122.0 / 108.4; docs/results/bisect_b16/h100_step_kernels_waves.txt). Replayed
    alone, one wave had won at InternVL heads B16 n32768 (184.1 vs 194.3 us), SmolLM2 heads B16 n32768 (48.4 vs
    53.4) and B64 n4096 (19-28%); inside the step it lost at all three.
    InternVL heads B60 n32768 (480 pairs, 3 programs per SM: 396 slots), KIVI-2 / K2/V1 / KIVI-1 us at 3 / 4 waves,
    replayed alone (2026-11-27, two device calls): 697.4 / 654.4, 681.1 / 631.3, 682.3 / 636.0 and 703.2 / 657.5,
    685.2 / 635.6, 687.6 / 640.0 (1 or 2 waves, one split: 803.3, 761.4, 764.1; 6 waves, 4 splits: 664.5, 643.1,
    649.9). B64 (512 pairs) keeps 3 waves (2 splits, 2.59 waves: 709.7 / 688.1 / 684.5 vs 710.9 / 684.3 / 687.3 at
    4). B30 n32768 (240 pairs) takes 4 waves, 6 splits: 339.7 us KIVI-2 alone vs 393.2 at one split a pair; 359.8 in
    the step vs 367.0 for the byte rule. ``long2``: InternVL heads B1 n32768, 2 warps, 6 programs per SM, merge
    launch started early (``text_pdl``), KIVI-2 / K2/V1 us at 7 tiles a split (the byte rule: 74 splits, 592
    programs) / 6 (one wave: 86 splits, 688 programs) / 5 (824 programs, past a wave of 792): 21.0 / 20.3 / 24.5,
    21.0 / 20.5 / 23.9 replayed alone (2026-11-27; the seventh session's "one wave", 25.7 vs 21.3 us, was the byte
    rule at 6 per SM: 5 tiles, 1.04 waves); inside the step 20.3, 20.3 vs 21.0, 21.1 at ``MMKV_TEXT_SPLIT=0``
    (docs/results/waves_in_step/h100_run1.txt). 1-bit keys lost at fewer tiles a split (KIVI-1 19.4 / 22.8 at 7 / 6
    of 128 tokens), so keep the byte rule."""
    w = wave_count("MMKV_TEXT_WAVES")
    if w is not None:
        return w if per_sm else 0
    if not per_sm:
        return 0
    if B * H < FEW_PAIRS:
        return 1 if long2 and switch("MMKV_TEXT_SPLIT") != "0" else 0
    return whole_waves(B * H, per_sm * nsm, tokens, D)


def wave_tiles(it: dict, dev_index: int, B: int, H: int, D: int, nsm: int) -> int | None:
    """Tiles per split of a planned text segment ``it`` (``plan.plan_items``' item) such that its splits fill
    ``text_waves`` whole waves, the tiles spread evenly over them; ``None`` for the byte rule."""
    s = it["seg"]
    per_sm = text_resident(text_slot_key(dev_index, D, s.k_bits, s.v_bits, it["tw"], s.v_order == "tiles",
                                         it["pfd"], it["regs"], it.get("svec", False), tuple(it.get("ring", (0, False))),
                                         it.get("full", True), it.get("pfn", 1), text_kpair(),
                                         text_bcol()))
    waves = text_waves(B, H, per_sm, nsm, s.k_bits == 2 and D == 128 and B * H <= 8 and it["T"] >= 16384, it["T"], D)
    if not waves:
        return None
    nsplit = max(1, waves * per_sm * nsm // (B * H))
    return -(-it["tiles"] // min(nsplit, it["tiles"]))
