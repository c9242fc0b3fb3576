"""Split and merge-launch rules of SKVQ segments (``decode/skvq.py``'s ``Layout.split`` hook), device-free.

The Gluon SKVQ kernel fills one wave of its resident programs at every shape (``skvq._wave_tiles``), so the two
split levers the KIVI/XQuant text kernel gained at batch 1 (``text_rules.text_split``: at most 256 tokens a split
below 32 (row, KV head) pairs under 16k tokens; one wave for few long rows) already hold there: InternVL heads
(32q/8kv/128) B1 n4096 plan 32 splits of one 128-token tile, n32768 one wave. What differs is the other side:
programs of a single tile, each paying the fixed cost of gathering q through ``k_perm`` into its MMA operand and
scattering its output, and 32 partials per query head for the merge. The switches below make the text kernel's
measured end state (256 tokens a split at batch 1 under 16k tokens) and its early merge launch available to SKVQ,
off until measured (docs/BENCHMARKS.md, SKVQ, "prepared, not measured")."""

from __future__ import annotations

from ..switches import switch

SPLIT_TOKENS = 256  # the text kernel's best split at batch 1 under 16k tokens (text_rules.text_split)
FEW_PAIRS = 32  # (row, KV head) pairs below which a call is a few microseconds (text_rules' threshold)
LONG = 16384  # tokens from which one wave of long splits is kept


def skvq_split(it: dict, B: int, H: int, tps: int) -> int:
    """Tiles per split of a planned SKVQ segment ``it`` (``T`` capacity, ``tt`` tokens a tile) whose plan gave
    ``tps`` (one wave for the Gluon kernel, the byte rule for the Triton one): ``MMKV_SKVQ_TPS`` replaces it;
    ``MMKV_SKVQ_SPLIT=1`` makes splits of ``SPLIT_TOKENS`` tokens below ``FEW_PAIRS`` pairs under ``LONG`` tokens (a
    floor as well as a cap: one wave gives 128 there). Unset / 0: ``tps``."""
    t = switch("MMKV_SKVQ_TPS")
    if t:
        if not t.isdigit() or int(t) < 1:
            raise ValueError(f"MMKV_SKVQ_TPS must be a positive integer, got {t}")
        return int(t)
    s = switch("MMKV_SKVQ_SPLIT")
    if s not in ("", "0", "1"):
        raise ValueError(f"MMKV_SKVQ_SPLIT must be 0 or 1, got {s}")
    if s == "1" and B * H < FEW_PAIRS and it["T"] < LONG:
        return max(1, SPLIT_TOKENS // it["tt"])
    return tps


def skvq_pdl(B: int, H: int, T: int, D: int) -> int:
    """Where the Gluon SKVQ kernel's programs let the merge launch start (programmatic dependent launch; the plan
    checks sm_90 and compiled kernels, the Triton SKVQ kernel never triggers): ``MMKV_SKVQ_PDL`` 0 never, 1 past
    each program's loop, 2 at its start; unset: 0 (not measured yet; the text kernel's rule, ``text_pdl``, is 1
    below 32 pairs except at head_dim 128 under 16k tokens)."""
    p = switch("MMKV_SKVQ_PDL")
    if p:
        if p not in ("0", "1", "2"):
            raise ValueError(f"MMKV_SKVQ_PDL must be 0, 1 or 2, got {p}")
        return int(p)
    return 0
