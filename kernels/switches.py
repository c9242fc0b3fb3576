"""Every environment switch mmkv reads, with its default and what it does, read through ``switch(name)``.

Each is read at the moment it matters (not cached at import), so a test or a side-by-side benchmark may set one
between calls. The kernel switches exist for measurements (``eval/bench/ab.py`` runs variants from them); their
defaults are the measured best. docs/KERNELS.md lists the same table.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class Switch(NamedTuple):
    default: str
    meaning: str


SWITCHES: dict[str, Switch] = {
    # kernels: which path decode attention takes
    "TRITON_INTERPRET": Switch("0", "1: run the Triton kernels in Triton's CPU interpreter (the tests); no Gluon"),
    "MMKV_NO_GLUON": Switch("0", "1: channel segments take the Triton kernel instead of the Gluon kernels"),
    "MMKV_TEXT_GLUON": Switch("1", "0: KIVI/XQuant segments take the Triton kernel instead of the Gluon text kernel"),
    "MMKV_KIVI_TILES": Switch("1", "0: KIVI/XQuant values stay in natural order on CUDA (the pre-scaled text kernel); "
                                   "all: tile order at head_dim 64 too (1: head_dim 128 only)"),
    "MMKV_SKVQ_GLUON": Switch("1", "0: SKVQ segments take the Triton kernel instead of the Gluon SKVQ kernel"),
    "MMKV_SKVQ_WAVES": Switch("", "whole waves of resident programs the Gluon SKVQ kernel's splits fill: 0 (the "
                                  "byte rule instead), 1-8 (unset: one below 32 (row, KV head) pairs, else the text "
                                  "kernel's rule, waves.whole_waves)"),
    "MMKV_SKVQ_TERN_LOAD": Switch("lanes", "bytes: the Gluon SKVQ kernel reads ternary values by per-byte addresses "
                                           "and masks instead of 16 loads at fixed offsets from two addresses per "
                                           "lane (head_dim 128, capacity a multiple of 16)"),
    "MMKV_SKVQ_REGS": Switch("", "register cap of the Gluon SKVQ kernel: 0 (none), 64-255 (unset: 128 with ternary "
                                 "values, and with the unmasked loop at head_dim 128 and 8 MMA columns; else none)"),
    "MMKV_SKVQ_SPLIT": Switch("", "SKVQ splits of 256 tokens below 32 (row, KV head) pairs under 16k tokens: 1 (any "
                                  "kernel and head_dim), 0 (never: one wave of the Gluon kernel, the byte rule for "
                                  "the Triton one) (unset: the Gluon kernel at head_dim 128, skvq_rules.skvq_split)"),
    "MMKV_SKVQ_FULL": Switch("1", "0: the Gluon SKVQ kernel masks every iteration's loads and logits, not only "
                                  "those that reach past a row's length"),
    "MMKV_SKVQ_WARPS": Switch("", "warps per program of the Gluon SKVQ kernel, 2 or 4 (its tile: 32 tokens a warp) "
                                  "(unset: 2 from 16k tokens below 32 (row, KV head) pairs, else 4; "
                                  "skvq_rules.skvq_warps)"),
    "MMKV_SKVQ_PREFETCH": Switch("", "iterations ahead the Gluon SKVQ kernel requests its bytes into L2 (sm_90): 0 "
                                     "(none), 1-4 (unset: 1 at head_dim 128 from 16k tokens below 32 (row, KV head) "
                                     "pairs, else 0; skvq_rules.skvq_prefetch)"),
    "MMKV_SKVQ_PREFETCH_SPAN": Switch("", "iterations one L2 prefetch request of the Gluon SKVQ kernel covers: 1-8 "
                                          "(unset: 1)"),
    "MMKV_SKVQ_TPS": Switch("", "tiles (program iterations) per split of SKVQ segments (unset: the plan's)"),
    "MMKV_SKVQ_PDL": Switch("", "where the Gluon SKVQ kernel lets the merge launch start (sm_90): 0 (never), 1 (past "
                                "each program's loop), 2 (at its start) (unset: 1 below 32 (row, KV head) pairs, "
                                "else 0, skvq_rules.skvq_pdl)"),
    "MMKV_TEXT_PREFETCH": Switch("", "iterations ahead the Gluon text kernel requests its bytes into L2: 0 (none), "
                                     "1-4 (unset: 1 at head_dim 128, without a register cap, from a million batch x "
                                     "KV heads x tokens or at up to 8 (row, KV head) pairs of 16k+ tokens, else 0)"),
    "MMKV_TEXT_PREFETCH_SPAN": Switch("", "iterations one L2 prefetch request of the Gluon text kernel covers: 1-8 "
                                          "(unset: 4 from 32 (row, KV head) pairs, else 1)"),
    "MMKV_TEXT_KPAIR": Switch("1", "1: the Gluon text kernel swaps the middle bytes of each K code word so that q*s "
                                   "and q*z enter the MMA as loaded; 0: the channel kernel's operand order"),
    "MMKV_TEXT_BCOL": Switch("1", "1: with 1-bit keys in 32-token blocks and at most 4 query heads per KV head, the "
                                  "Gluon text kernel puts the second key block on the MMA's spare columns; 0: a "
                                  "second K-side MMA"),
    "MMKV_TEXT_RING": Switch("", "stages of the Gluon text kernel's cp.async ring for the key codes: 0 (none), 2-6; "
                                 "a trailing s puts the key scale/zero rows in it too, e.g. 3s (unset: 3 stages of "
                                 "key codes for 2-bit keys at head_dim 64 over up to 8 (row, KV head) pairs of 16k+ "
                                 "tokens, else none)"),
    "MMKV_TEXT_REGS": Switch("", "register cap of the Gluon text kernel, which then reads q back from shared memory "
                             "each iteration: 0 (no cap, q kept in registers), 64-248 (unset: 168 with 1-bit keys at "
                             "head_dim 128 and larger work, else 0)"),
    "MMKV_TEXT_WAVES": Switch("", "whole waves of resident programs the Gluon text kernel's splits fill: 0 (the byte "
                                  "rule), 1-8 (unset: from 32 (row, KV head) pairs, once the variant ran, 1 where "
                                  "one wave's splits use 85% of it and the rows hold under 2^20 elements (tokens x "
                                  "head_dim), else the fewest from 3 whose splits use 85% of the waves they start; "
                                  "below 32 pairs 0, except 1 for 2-bit keys at head_dim 128 over up to 8 pairs of "
                                  "16k+ tokens)"),
    "MMKV_TEXT_SVEC": Switch("0", "1: the Gluon text kernel reads natural-order value scales and zeros as one "
                                  "vector per lane and chunk of its tokens (0: one 2-byte load per token)"),
    "MMKV_TEXT_WARPS": Switch("", "warps per program of the Gluon text kernel: 2, 4 or 8 (unset: by shape)"),
    "MMKV_TEXT_PDL": Switch("", "where the Gluon text kernel lets the merge launch start (sm_90): 0 (never), 1 (past "
                                "each program's loop), 2 (at its start) (unset: 1 below 32 (row, KV head) pairs "
                                "except at head_dim 128 under 16k tokens, else 0)"),
    "MMKV_TEXT_CL": Switch("", "the Gluon text kernel's splits of a (row, KV head) as one thread block cluster of 2, "
                               "4 or 8 CTAs that writes the output itself (no merge launch; sm_90); 0 or unset: "
                               "never (measured slower)"),
    "MMKV_TEXT_FULL": Switch("1", "0: the Gluon text kernel masks every iteration's loads and logits, not only "
                                  "those that reach past a row's length"),
    "MMKV_TEXT_TPS": Switch("", "tiles (program iterations) per split of the Gluon text kernel (unset: the plan's)"),
    "MMKV_TEXT_SPLIT": Switch("1", "0: the Gluon text kernel's splits below 32 (row, KV head) pairs by the byte rule "
                                   "alone (no 256-token cap under 16k tokens, no single wave for few long 2-bit "
                                   "rows)"),
    "MMKV_FUSED": Switch("1", "0: no fused 1-bit channel kernel (range pass and main pass launched separately)"),
    "MMKV_CLUSTER": Switch("1", "0: the fused kernel uses the counter barrier, never thread block clusters"),
    "MMKV_CLUSTER_MAX": Switch("8", "most CTAs per thread block cluster of the fused kernel"),
    "MMKV_FIN": Switch("1", "0: the clustered fused kernel leaves the merge to the merge launch"),
    "MMKV_OVERLAP": Switch("1", "0: the clustered fused kernel starts only after the text segment's kernel ends"),
    "MMKV_INT8_K": Switch("auto", "0: K side of the Gluon kernels on fp16 tensor cores; 1: int8 wherever eligible"),
    "MMKV_ALIGNED_PREFETCH": Switch("1", "0: the AlignedKV Rule 2 passes load a block's colmax and logits in the "
                                         "block's own iteration and gather O_est's V byte right after its logits "
                                         "(their plane loads then wait behind them; main before 2026-11-27)"),
    "MMKV_ALIGNED_OEST": Switch("gather", "where the AlignedKV Rule 2 path finds O_est: gather (the keys pass "
                                          "gathers each block's top-token V bytes, a sector per channel; the values "
                                          "pass reads all of V), vhi (kernels/decode/alignedkv_vhi.py: the keys pass "
                                          "reads each block's V high bytes whole, takes the 8-bit read p @ V8 and "
                                          "O_est's top tokens from them; a levels launch decides the value widths 16 "
                                          "blocks at a time; a correction pass reads only the nibbles of (block, "
                                          "channel)s at 12/16 bits), vhi4 (vhi with the keys pass on the 4-token "
                                          "phase reader, blocks of 64+); both measured slower than gather "
                                          "(docs/BENCHMARKS.md, AlignedKV, 2026-11-27)"),
    "MMKV_ALIGNED_ASM": Switch("1", "0: the AlignedKV one-pass kernel assembles fp16 from its bit planes with Triton "
                                    "integer operations instead of its inline-asm prmt block"),
    "MMKV_WINDOW_TPS": Switch("1", "most tiles (program iterations) per split of a dense segment of up to 1024 tokens "
                                   "(the fp16 window) beside a segment of 8x its tokens: more, shorter programs where "
                                   "the byte rule gave one long one a (row, KV head); 0: the byte rule alone"),
    "MMKV_WINDOW_OVERLAP": Switch("1", "0: the layer's Gluon text or SKVQ kernel starts only after the fp16 window's "
                                       "kernel ends, not beside it (sm_90)"),
    "MMKV_MERGE_WIDE": Switch("1", "0: the split-K merge launch reads 16 partials per round over all channels "
                                   "instead of up to 128 per round over channel chunks"),
    "MMKV_PDL": Switch("1", "0: no programmatic dependent launch (range pass -> main pass -> merge)"),
    "MMKV_FAST_LAUNCH": Switch("1", "0: launch through Triton's ordinary path instead of the cached launcher"),
    "MMKV_APPEND_KERNEL": Switch("1", "0: a decode step appends each token's K/V on the GPU with torch indexing (five "
                                      "kernels a layer) instead of one kernel (kernels/ops/append.py)"),
    "MMKV_CPU_REFERENCE": Switch("0", "1: decode on the CPU through the torch reference instead of decode/cpu.py"),
    "MMKV_CPU_NATIVE": Switch("1", "0: the CPU path dequantizes with torch operations, not its compiled C loops"),
    "MMKV_CPU_ROW": Switch("1", "0: one row's CPU decode takes the block path, not one compiled call a segment"),
    "MMKV_CPU_SPLIT_LINEAR": Switch("1", "0: a CPU decode step's linear layers run as torch's F.linear (one thread for "
                                         "a few rows) instead of output-row blocks over torch's threads"),
    "MMKV_CPU_GROUP_LINEAR": Switch("1", "0: mmkv's CPU forwards run q, k and v as three GEMMs (as transformers "
                                         "does) instead of one over their joined weights "
                                         "(mmkv/models/cpu_forward.py)"),
    "MMKV_CPU_INPLACE_MLP": Switch("1", "0: mmkv's CPU forwards run the gated MLP as transformers does instead of "
                                        "its activation and product in place on the gate's output (a prompt of more "
                                        "than 1024 rows in pieces of at most 1024 rows, into two reused buffers)"),
    "MMKV_LAST_ROW": Switch("cpu", "where a prefill runs its last decoder layer's attention, o_proj and MLP for the "
                                   "last position only, the one whose logits it keeps (mmkv/models/last_row.py), "
                                   "instead of every position as transformers does: cpu, 1 (every device), 0 "
                                   "(nowhere)"),
    "MMKV_CPU_ROPE": Switch("1", "0: mmkv's CPU forwards apply rotary embedding as transformers does instead of one "
                                 "product into the output plus two half-width ones (mmkv/models/rotary.py)"),
    "MMKV_AQUAKV_CPU_MEMO": Switch("1", "0: AQUA-KV on the CPU rebuilds every text token from its codes each step "
                                        "instead of keeping the flush's reconstruction"),
    # files
    "MMKV_CACHE_DIR": Switch("", "folder of converted models, calibration artifacts and compiled CPU loops "
                                 "(empty: ~/.cache/mmkv)"),
    "MMKV_WIKITEXT": Switch("", "folder holding WikiText-2 test.txt/valid.txt (empty: see mmkv/paths.py)"),
    # evaluation and tests
    "MMKV_EVAL_DIST_TIMEOUT_S": Switch("172800", "seconds the multi-GPU eval waits for the other ranks (48 h)"),
    "MMKV_CHROMIUM": Switch("/usr/bin/chromium", "the Chromium the browser tests drive"),
}


def switch(name: str) -> str:
    """The current value of switch ``name`` (its default where unset); KeyError for a name not in the table."""
    return os.environ.get(name, SWITCHES[name].default)


def on_off(name: str) -> bool:
    """A switch that is 0 or 1: True for 1; any other value (empty included) a ValueError that names the switch."""
    v = switch(name)
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v}")
    return v == "1"


def count_switch(name: str, lo: int, hi: int) -> int | None:
    """A switch holding a small count, ``lo``-``hi`` (single digits), ``None`` where unset or set empty; any other
    value a ValueError that names the switch and the range."""
    w = switch(name)
    if not w:
        return None
    if w not in tuple(str(i) for i in range(lo, hi + 1)):
        raise ValueError(f"{name} must be {lo}-{hi}, got {w}")
    return int(w)


def wave_count(name: str) -> int | None:
    """A switch that counts waves of resident programs (``MMKV_TEXT_WAVES``, ``MMKV_SKVQ_WAVES``): 0-8."""
    return count_switch(name, 0, 8)


def cache_dir() -> Path:
    """mmkv's folder of converted models, calibration artifacts and compiled CPU loops."""
    return Path(switch("MMKV_CACHE_DIR") or Path.home() / ".cache" / "mmkv")


def interpreted() -> bool:
    """Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return switch("TRITON_INTERPRET") == "1"
