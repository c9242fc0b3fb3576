"""Split and merge-launch rules of SKVQ segments (``decode/skvq.py``'s ``Layout.split`` hook), device-free.

Below 32 (row, KV head) pairs the Gluon SKVQ kernel fills one wave of its resident programs (``skvq_waves``):
InternVL heads (32q/8kv/128) B1 n4096 plan 32 splits of one 128-token tile (256 programs), n32768 64 splits of 4
tiles; SmolLM2 heads (9q/3kv/64) B1 n4096 32 of 1 (96 programs), n32768 128 of 2. At batch 1 every program of one
tile pays the fixed cost of gathering q through ``k_perm`` into its MMA operand and scattering its output, and the
merge launch waits for the whole kernel. The two rules below are the text kernel's batch-1 levers (``text_rules.text_split``,
``text_pdl``) measured on the SKVQ kernel (H100, docs/BENCHMARKS.md, SKVQ, "Kernel: batch-1 levers"), each with
its switch."""

from __future__ import annotations

from ..switches import count_switch, on_off, switch, wave_count
from .waves import FEW_PAIRS, whole_waves

SPLIT_TOKENS = 256  # the text kernel's best split at batch 1 under 16k tokens (text_rules.text_split)
LONG = 16384  # tokens from which one wave of long splits is kept, and programs take 2 warps


def skvq_split(it: dict, B: int, H: int, tps: int, D: int = 128, gluon: bool = True) -> int:
    """Tiles per split of a planned SKVQ segment ``it`` (``T`` capacity, ``tt`` tokens a tile) whose plan gave
    ``tps`` (one wave for the Gluon kernel, the byte rule for the Triton one): ``MMKV_SKVQ_TPS`` replaces it;
    splits of ``SPLIT_TOKENS`` tokens (a floor as well as a cap: one wave gives 128 there) below ``FEW_PAIRS``
    pairs under ``LONG`` tokens where ``MMKV_SKVQ_SPLIT`` is 1, and where it is unset for the Gluon kernel at
    head_dim 128; 0: never. H100, CUDA-graph replays of back-to-back calls, us of K2V2 / K2V1.5 / K2V1.5 FP8, g64,
    merge launch started early (``skvq_pdl``), 2026-11-27: InternVL heads B1 n4096 one wave (32 splits of 128
    tokens) 10.1 / 10.2 / 10.3, 256-token splits 8.8 / 9.0 / 8.8 (fp16 SDPA 9.2; neither lever 10.0 / 10.1 /
    10.1; in a third call the defaults 9.0 / 9.3 / 8.9 vs neither 10.0 / 10.2 / 10.3, SDPA 9.4); SmolLM2 heads B1 n4096 (3 pairs: 96 programs of one tile, 48 of two) 5.6 / 5.7 / 5.7 vs 5.9 /
    6.1 / 6.1 (SDPA 6.6): there it stays off. From 16k tokens the splits are unchanged either way."""
    t = switch("MMKV_SKVQ_TPS")
    if t:
        if not t.isdigit() or int(t) < 1:
            raise ValueError(f"MMKV_SKVQ_TPS must be a positive integer, got {t}")
        return int(t)
    s = switch("MMKV_SKVQ_SPLIT")
    if s not in ("", "0", "1"):
        raise ValueError(f"MMKV_SKVQ_SPLIT must be 0 or 1, got {s}")
    on = s == "1" or (s == "" and gluon and D >= 128)
    if on and B * H < FEW_PAIRS and it["T"] < LONG:
        return max(1, SPLIT_TOKENS // it["tt"])
    return tps


def skvq_waves(B: int, H: int, per_sm: int, nsm: int, tokens: int, D: int = 128) -> int:
    """Waves of resident programs the Gluon SKVQ kernel's splits fill (``skvq._wave_tiles``): ``MMKV_SKVQ_WAVES``
    (0 for the byte rule, 1-8) if set, else one wave below ``FEW_PAIRS`` (row, KV head) pairs and from there
    ``waves.whole_waves``, the text kernel's rule. Inside the decode step of random:internvl2.5-8b (graph replays,
    torch's profiler; H100, 2026-11-27, docs/results/waves_in_step/h100_run1.txt), K2/V1.5 g64 B16 n32768, the
    kernel's us a call and the step's ms at one wave (the earlier rule at every shape) / the byte rule / 3 waves:
    275.3, 274.2 / 275.8 / 207.4, 208.9 us; 15.95, 16.10 / 16.57 / 14.29, 14.33 ms; B16 n4096 one wave 42.1 us,
    3 waves 51.4 (h100_run2.txt)."""
    w = wave_count("MMKV_SKVQ_WAVES")
    if w is not None:
        return w
    return 1 if B * H < FEW_PAIRS else whole_waves(B * H, per_sm * nsm, tokens, D)


def skvq_pdl(B: int, H: int, T: int, D: int) -> int:
    """Where the Gluon SKVQ kernel's programs let the merge launch start (programmatic dependent launch; the plan
    checks sm_90 and compiled kernels, the Triton SKVQ kernel never triggers): ``MMKV_SKVQ_PDL`` 0 never, 1 past
    each program's loop, 2 at its start; unset: 1 below ``FEW_PAIRS`` (row, KV head) pairs, else 0. H100, graph
    replays of back-to-back calls, us of K2V2 / K2V1.5 / K2V1.5 FP8 at 0 / 1 (two rounds each, 2026-11-27):
    SmolLM2 heads B1 n4096 6.1 / 5.6, 6.4 / 5.7, 6.2 / 5.7 and 6.1 / 5.6, 6.3 / 5.7, 6.6 / 5.9; n32768 10.2 / 9.5,
    10.6 / 9.9, 10.7 / 10.4 and 10.0 / 9.4, 10.4 / 10.0, 10.9 / 10.3; InternVL heads B1 n32768 within 0.4 us either
    way (22.5 / 22.6, 22.6 / 22.5, 22.4 / 22.2); InternVL B1 n4096 with one-tile splits 10.0 / 10.1 (K2V2), with the
    256-token splits of ``skvq_split`` 8.8 at 1. From 32 pairs the call is long and the rule keeps 0 (not
    measured on SKVQ; the text kernel's B16/B64 were within 1.5% either way)."""
    p = switch("MMKV_SKVQ_PDL")
    if p:
        if p not in ("0", "1", "2"):
            raise ValueError(f"MMKV_SKVQ_PDL must be 0, 1 or 2, got {p}")
        return int(p)
    return 1 if B * H < FEW_PAIRS else 0


def skvq_warps(B: int, H: int, T: int, D: int = 128) -> int:
    """Warps per program of the Gluon SKVQ kernel (its tile is ``warps x 32`` tokens): ``MMKV_SKVQ_WARPS`` (2 or 4) if
    set, else 2 from ``LONG`` tokens below ``FEW_PAIRS`` (row, KV head) pairs (the text kernel's rule for a few long
    rows, ``text_rules.text_warps``), else 4. H100, K2/V1.5 g64, us at 4 / 2 warps (docs/BENCHMARKS.md, SKVQ, "Two
    warps a program", 2026-12-07): inside the decode step of random:internvl2.5-8b n32768, B1 the kernel 25.0, 25.2
    / 23.0, 23.0 (step 6.876, 6.879 / 6.834, 6.839 ms), but B16 198.2, 196.2 / 232.8, 232.5 (step 12.76 / 13.90 ms),
    although the call replayed alone was faster at B16 (202.8 / 195.9; FP8 scales 202.6 / 198.2; SmolLM2 heads 64.5 /
    61.7). Under 16k tokens 2 warps were mixed (InternVL B1 n4096 12.8 / 13.8, B16 37.0 / 34.8)."""
    w = switch("MMKV_SKVQ_WARPS")
    if w:
        if w not in ("2", "4"):
            raise ValueError(f"MMKV_SKVQ_WARPS must be 2 or 4, got {w}")
        return int(w)
    return 2 if T >= LONG and B * H < FEW_PAIRS else 4


def skvq_prefetch(B: int, H: int, T: int, D: int = 128) -> int:
    """Iterations ahead the Gluon SKVQ kernel asks L2 for its bytes (``gluon/skvq_prefetch.py``; the caller checks
    sm_90): ``MMKV_SKVQ_PREFETCH`` (0-4) if set, else 1 at head_dim 128 from ``LONG`` tokens below ``FEW_PAIRS``
    (row, KV head) pairs (where ``skvq_warps`` gives 2 warps), else 0. H100, inside the decode step of
    random:internvl2.5-8b B1 n32768, K2/V1.5 g64 at 2 warps, the kernel's us at prefetch 0 / 1 / 2: 22.97, 23.00 /
    22.33, 22.41 / 23.41 (step 6.876, 6.853 / 6.839, 6.836 / 6.911 ms)."""
    p = count_switch("MMKV_SKVQ_PREFETCH", 0, 4)
    if p is not None:
        return p
    return 1 if D >= 128 and T >= LONG and B * H < FEW_PAIRS else 0


def skvq_prefetch_span() -> int:
    """Iterations one L2 prefetch request of the Gluon SKVQ kernel covers (where ``skvq_prefetch`` > 0):
    ``MMKV_SKVQ_PREFETCH_SPAN`` (1-8) if set, else 1. The six ranges' address arithmetic is ~105 of the ~890
    instructions an iteration at 2 warps (K2/V1.5, FP8 scales, head_dim 128; local sm_90 compile), but where the
    plan prefetches (batch 1) a wider span measured slower in the decode step: H100, random:internvl2.5-8b B1
    n32768, K2/V1.5 g64, the SKVQ kernel at span 1 / 2 / 4 22.38, 22.44 / 23.09 / 24.03, 24.17 us (the call replayed
    alone: 25.5 / 25.7 / 23.7 us with FP8 scales; docs/BENCHMARKS.md)."""
    s = count_switch("MMKV_SKVQ_PREFETCH_SPAN", 1, 8)
    return 1 if s is None else s


def skvq_unmasked() -> bool:
    """``MMKV_SKVQ_FULL`` (default 1): the Gluon SKVQ kernel runs the iterations whose every token is valid through a
    copy of its loop body without masks, as the text kernel does (``text_rules.text_unmasked``); 0 masks every
    iteration. Read at launch: the SKVQ launch has no fallback that would hide a bad value."""
    return on_off("MMKV_SKVQ_FULL")
