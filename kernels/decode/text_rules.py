"""The Gluon text kernel's device-free per-shape rules (warps, register cap, programs per SM), each with its
``MMKV_TEXT_*`` switch and the H100 measurements that chose it; ``plan.plan_items`` applies them (the rules that
depend on the device's capability, L2 prefetch and the key-code ring, stay in ``plan``)."""

from __future__ import annotations

from ..switches import count_switch, on_off, switch
from .waves import FEW_PAIRS


def text_warps(B: int, H: int, T: int, D: int = 128) -> int:
    """Warps per program of the Gluon text kernel: ``MMKV_TEXT_WARPS`` if set, else 4, or 2 for a few long rows:
    up to 32 (row, KV head) pairs, 48 at head_dim 64, from 16k tokens (H100, docs/BENCHMARKS.md; us at 2 vs 4
    warps: InternVL heads B1 n32768 26.4 vs 32.6, B16 n32768 293 vs 276, B1 n4096 9.7 vs 8.4; SmolLM2 heads
    (48 pairs at B16) n32768 KIVI-2 47.2 vs 48.7 and 47.4 vs 48.9 in two sessions, B64 182.2 vs 178.5)."""
    w = switch("MMKV_TEXT_WARPS")
    if w:
        if w not in ("2", "4", "8"):
            raise ValueError(f"MMKV_TEXT_WARPS must be 2, 4 or 8, got {w}")
        return int(w)
    return 2 if T >= 16384 and (B * H <= 32 or (D <= 64 and B * H <= 48)) else 4


def text_regs(k_bits: int, D: int, B: int, H: int, T: int) -> tuple[bool, int]:
    """(q read back from shared memory each iteration, register cap or 0) of the Gluon text kernel:
    ``MMKV_TEXT_REGS`` if set (0: neither), else (True, 168) for 1-bit keys at head_dim 128 from half a million
    (batch x KV heads x tokens), (False, 0) otherwise. 1-bit keys at head_dim 128 take 178-181 registers (234 with
    the L2 prefetch): 2 programs of 4 warps per SM; q out of the registers and a cap of 168 leave 162 without spills
    (local sm_90 compile), 3 programs per SM. H100, graph replays, InternVL heads, KIVI-1, us without / with
    (docs/BENCHMARKS.md): B16 n32768 234.9 / 205.9, B64 n32768 797.9 / 715.8, B16 n4096 44.3 / 40.4, B64 n4096
    134.2 / 122.9; batch 1 (programs of a few iterations) n4096 9.4 / 9.8, n32768 22.1 / 22.4: there it stays off.
    2-bit keys (152-158 registers, 3 programs) capped at 128 for a 4th program spill and were slower (B16 n32768
    KIVI-2 202.7 / 215.6), as were 128 and 96 at head_dim 64 (SmolLM2 heads B16 n32768 KIVI-2 54.5 / 55.0 /
    59.3)."""
    r = switch("MMKV_TEXT_REGS")
    if r:
        if not r.isdigit() or (int(r) and not (64 <= int(r) <= 248 and int(r) % 8 == 0)):
            raise ValueError(f"MMKV_TEXT_REGS must be 0 or a multiple of 8 in 64-248, got {r}")
        return (int(r) > 0, int(r))
    return (True, 168) if k_bits == 1 and D == 128 and B * H * T >= 1 << 19 else (False, 0)


def text_programs_per_sm(B: int, H: int, T: int) -> float:
    """Programs per SM to split a Gluon text segment's work into. More, shorter programs balance the tail once the
    work is large (H100, KIVI-2, graph replays, us at 4 / 6 / 12 per SM: InternVL heads B16 n32768 270 / 234 /
    242, B64 n32768 1060 / 949 / 857; SmolLM2 heads B16 n32768 58.9 / 55.9 / 57.9, B64 n32768 231 / 212 / 190);
    small work keeps 4 (InternVL B1 n32768 26.5 / 32.5 / 31.9). From 32 (row, KV head) pairs, once the variant has
    run, ``gluon/text_slots.wave_tiles`` replaces this with splits that fill whole waves."""
    work = B * H * T
    return 4.0 if work < 1 << 20 else 6.0 if work < 6 << 20 else 12.0


def text_pdl(B: int, H: int, T: int, D: int = 128) -> int:
    """Where the Gluon text kernel's programs let the merge launch start (``text_consts``' ``pdl``; the caller
    checked sm_90 and compiled kernels): ``MMKV_TEXT_PDL`` if set, else 1 (past each program's loop) below 32
    (row, KV head) pairs, where the call is a few microseconds and the merge launch's start a visible part of it,
    except at head_dim 128 under 16k tokens; else 0. H100, graph replays, KIVI-2 / K2/V1 / KIVI-1, us at 0 / 1
    (docs/BENCHMARKS.md, 2026-11-27, two device calls; the second with the splits of ``text_split`` and
    ``text_slots.text_waves``): InternVL heads B1 n32768 22.0 / 21.0, 21.5 / 21.0, 20.1 / 19.4 and 21.0 / 20.3,
    20.5 / 19.9, 20.1 / 19.4; SmolLM2 heads B1 n32768 11.1 / 10.6, 13.4 / 12.9, 14.5 / 14.3 and 11.0 / 10.5, 12.6 /
    12.2, 14.6 / 14.1; SmolLM2 B1 n4096 7.0 / 6.8, 7.6 / 7.5, 8.8 / 8.5 and 5.6 / 5.4, 5.6 / 5.4, 5.5 / 5.2. Slower
    at InternVL heads B1 n4096 (8.2 / 8.8, 8.1 / 8.4, 9.5 / 9.0 and 8.4 / 8.9, 8.3 / 8.5, 7.8 / 8.1): off there. At
    B16 and B64 n32768 within 1.5% either way (InternVL B16 KIVI-2 183.5 / 183.3, SmolLM2 B64 177.5 / 180.1): off.
    2 (at the programs' start) was no better than 1 anywhere (InternVL B1 n32768 KIVI-2 21.3, B16 188.4)."""
    p = switch("MMKV_TEXT_PDL")
    if p:
        if p not in ("0", "1", "2"):
            raise ValueError(f"MMKV_TEXT_PDL must be 0, 1 or 2, got {p}")
        return int(p)
    return 1 if B * H < FEW_PAIRS and (T >= 16384 or D <= 64) else 0


def text_split(it: dict, B: int, H: int, tps: int, clusters: bool) -> tuple[int, int]:
    """(tiles per split, CTAs per cluster or 0) of a planned Gluon text segment ``it`` whose split rule gave ``tps``:
    ``MMKV_TEXT_TPS`` replaces ``tps``; ``MMKV_TEXT_CL`` (where ``clusters``: sm_90, compiled) makes the splits of a
    (row, KV head) one cluster of that many CTAs, the tiles spread evenly over them, which then merges the row's
    partials itself (no merge launch). Unset: no clusters, and below 32 (row, KV head) pairs of under 16k tokens splits
    of at most 256 tokens (``MMKV_TEXT_SPLIT=0``: the byte rule's, whose 16 KB floor gave 512-1024 tokens at head_dim 64
    and 512 for 1-bit keys at 128: programs of 2-5 serial iterations). H100, graph replays, B1 n4096, KIVI-2 / K2/V1 /
    KIVI-1 us (docs/BENCHMARKS.md, 2026-11-27): byte rule / 256 tokens, merge launch not started early, SmolLM2 heads
    7.1 / 5.6, 7.6 / 5.6, 8.9 / 5.5 (fp16 SDPA 6.3), InternVL heads KIVI-1 9.6 / 7.8 (KIVI-2 and K2/V1 were at 256
    already: 8.3 / 8.4, 8.3 / 8.3); with it started early (``text_pdl``), SmolLM2 heads at 512 / 256 / 128 tokens
    (KIVI-1: 1024 / 512 / 256) 6.8 / 5.3 / 5.5, 7.5 / 5.4 / 5.5, 8.5 / 6.5 / 5.2. Clusters of 8 / 4 / 2 CTAs (SmolLM2
    heads KIVI-2 6.6 / 8.8 / 13.9, InternVL heads 10.3 / 14.1 / 23.4 us) lost to more, shorter splits and the merge
    launch: a cluster holds at most 8 splits, and removing the launch saved 0.4 us of 7.0."""
    t = switch("MMKV_TEXT_TPS")
    if t:
        if not t.isdigit() or int(t) < 1:
            raise ValueError(f"MMKV_TEXT_TPS must be a positive integer, got {t}")
        tps = int(t)
    elif B * H < FEW_PAIRS and it["T"] < 16384 and switch("MMKV_TEXT_SPLIT") != "0":
        tps = min(tps, max(1, 256 // it["tt"]))
    c = switch("MMKV_TEXT_CL")
    if c and c not in ("0", "2", "4", "8"):
        raise ValueError(f"MMKV_TEXT_CL must be 0, 2, 4 or 8, got {c}")
    cl = int(c) if c else 0
    if cl and clusters:
        return -(-it["tiles"] // cl), cl
    return tps, 0


def text_unmasked() -> bool:
    """Whether the Gluon text kernel runs the iterations whose every token is valid through a copy of its loop body
    without masks (``MMKV_TEXT_FULL``, default 1; 0: every iteration masked, the kernel before)."""
    return on_off("MMKV_TEXT_FULL")


def text_prefetch_span(pairs: int) -> int:
    """Iterations one L2 prefetch request of the Gluon text kernel covers (``gluon/text_prefetch.py``; the plan asks
    only where it prefetches): ``MMKV_TEXT_PREFETCH_SPAN`` (1-8) if set, else 4 from 32 (row, KV head) ``pairs``, 1
    below. The six ranges' address arithmetic is 89 of the ~626 instructions an iteration of K2/V1 or KIVI-2 at
    head_dim 128 (local sm_90 compile); a request every ``span`` iterations for the next ``span`` pays it once for
    all of them. H100, inside the decode step of random:internvl2.5-8b n32768 (docs/BENCHMARKS.md, variants
    interleaved): XQuant B16 text kernel 172.7 -> 167.5, 168.6 us at 4 (step 12.10 -> 11.96, 11.98 ms); at B1 slower,
    KIVI-2 20.0 -> 21.9 us (programs of a few iterations)."""
    s = count_switch("MMKV_TEXT_PREFETCH_SPAN", 1, 8)
    if s is not None:
        return s
    return 4 if pairs >= FEW_PAIRS else 1


def text_kpair() -> bool:
    """``MMKV_TEXT_KPAIR`` (default 1): the Gluon text kernel swaps the middle bytes of each K code word (one ``prmt``
    a word) so that q*s and q*z enter the MMA as loaded, without two ``prmt`` per register pair of each (0: the
    channel kernel's operand order). Local sm_90 compile, instructions an iteration without / with: K2/V1 at head_dim
    128 with the L2 prefetch 646 / 626, KIVI-1 under its 168-register cap 1127 / 1071."""
    return on_off("MMKV_TEXT_KPAIR")


def text_bcol() -> bool:
    """``MMKV_TEXT_BCOL`` (default 1): with 1-bit keys in blocks of 32 tokens (two blocks in a warp's 64-token
    iteration) and at most 4 query heads per KV head, the Gluon text kernel gives the second block the MMA's spare
    columns 4-7 (heads 0-3 again) instead of a second K-side MMA per step, and merges each column pair at the end:
    half the K-side and zero-term MMAs, one q*s and q*z a step instead of two (0: both blocks on columns 0-3)."""
    return on_off("MMKV_TEXT_BCOL")
