"""How many whole waves of resident programs the splits of a decode call fill, shared by the Gluon text kernel
(``gluon/text_slots.text_waves``) and the Gluon SKVQ kernel (``skvq_rules.skvq_waves``); device-free.

Chosen from the kernels' time inside the decode step (graph replays, torch's profiler, one process per model; H100,
2026-11-27, docs/results/waves_in_step/; InternVL B16 n4096 and n32768 from docs/results/bisect_b16/
h100_step_kernels_waves.txt), not from the call replayed alone, which had preferred one wave at the same shapes.
KIVI-2, us a call at one wave / 3 waves:

| heads | B | tokens | one wave: splits, fill | one wave | 3 waves |
|---|---:|---:|---|---:|---:|
| InternVL (128) | 16 | 4096 | 3, 97% | **39.6** | 42.3 |
| InternVL | 16 | 8192 | 3, 97% | 70.0 | **65.5** |
| InternVL | 16 | 16384 | 3, 97% | 131.5, 134.2 | **110.0, 109.4** |
| InternVL | 16 | 32768 | 3, 97% | 258.9 | **191.8** |
| InternVL | 4 | 32768 | 12, 97% | 66.9 | **59.3** |
| SmolLM2 (64) | 16 | 8192 | 11, 100% | **20.7** | 22.8 |
| SmolLM2 | 16 | 16384 | 22, 100% | 34.2 | **31.1** |
| SmolLM2 | 16 | 32768 | 22, 100% | 62.8, 63.7 | **54.7, 55.0** |
| SmolLM2 | 64 | 4096 | 2, 73% | 36.7 | **33.7** |

SKVQ K2/V1.5 g64, InternVL heads B16: n32768 275.3, 274.2, 275.6 / 207.4, 208.9, 207.7; n4096 (4 splits, 97%)
**42.1** / 51.4. One wave wins only where it is nearly full and a row holds few elements (tokens x head_dim); past
that, spare programs let the kernel even out SMs that start late behind the step's GEMMs (a reading, not
measured)."""

from __future__ import annotations

import math

FEW_PAIRS = 32  # (row, KV head) pairs below which a call is a few microseconds of latency: the few-pairs rules apply
LONG_ROW = 1 << 20  # elements (tokens x head_dim) of a row from which one wave is not taken: 8192 tokens at 128
FILL = 0.85  # least share of the started waves' slots the splits must use


def _fill(waves: int, slots: int, pairs: int) -> float:
    used = (waves * slots // pairs) * pairs / slots
    return used / math.ceil(used) if used else 0.0


def whole_waves(pairs: int, slots: int, tokens: int, head_dim: int) -> int:
    """Waves for ``pairs`` (row, KV head) pairs of ``tokens`` tokens (the segment's capacity, what the plan sees)
    over ``slots`` resident programs: 1 where the ``floor(slots / pairs)`` splits of one wave use ``FILL`` of it and a
    row holds under ``LONG_ROW`` elements; else the fewest waves from 3 whose ``floor(waves x slots / pairs)`` splits
    use ``FILL`` of the waves they start (3 where none does).

    Past one wave, 3 waves can leave most of the last one idle: InternVL heads B60 n32768 (480 pairs, 396 slots)
    at 3 waves take 2 splits, 960 programs, 2.42 waves; 4 waves take 3 splits, 3.64 waves, and were 6-7% faster
    (``text_slots.text_waves``)."""
    if tokens * head_dim < LONG_ROW and _fill(1, slots, pairs) >= FILL:
        return 1
    for w in range(3, 9):
        if _fill(w, slots, pairs) >= FILL:
            return w
    return 3
