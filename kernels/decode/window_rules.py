"""How the fp16 window (a short dense segment: the sinks and the recent tokens) is split, and which of a layer's last
two kernels start side by side (programmatic dependent launch), device-free; applied by ``plan.plan_items``."""

from __future__ import annotations

from ..switches import on_off, switch
from .registry import KIND_CHANNEL, KIND_DENSE, KIND_KIVI, KIND_PLUGIN, LAYOUTS

WINDOW_TOKENS = 1024  # a dense segment of at most this capacity is a window (sinks + recent tokens), not a body
BESIDE = 8  # ... when another segment of the layer holds at least this many times its tokens


def window_tps(T: int, tps: int, longest: int) -> int:
    """Tiles per split of a dense segment of capacity ``T`` whose byte rule gave ``tps``, in a layer whose longest
    segment holds ``longest`` tokens: at most ``MMKV_WINDOW_TPS`` (default 1; 0: the byte rule) for a window of up
    to ``WINDOW_TOKENS`` beside a segment of ``BESIDE`` times its tokens or more. The byte rule sizes splits from
    the whole layer's bytes, so beside a long segment at batch 16 it gave the window one split of all its tiles per
    (row, KV head): 128 programs of 8 serial iterations. H200, random:internvl2.5-8b n32768, XQuant 1.375, in the
    decode step (docs/results/step_sweep/h200_window.txt), window + merge us a layer at the byte rule / 2 / 1
    tiles: B16 6.69 + 3.34 / 5.93 + 3.57 / 5.62 + 3.67, B1 (where the byte rule gave 2) 3.52 + 2.33 / - / 2.82 +
    2.36; mmkv fp16's step the same within its noise. A short cache with no long segment (a few hundred tokens at
    a large batch) keeps the byte rule: one-tile splits of every row there are unmeasured."""
    cap = switch("MMKV_WINDOW_TPS")
    if not cap.isdigit():
        raise ValueError(f"MMKV_WINDOW_TPS must be a non-negative integer, got {cap}")
    return min(tps, int(cap)) if int(cap) and T <= WINDOW_TOKENS and longest >= BESIDE * T else tps


def window_overlap(items: list) -> bool:
    """Whether the fp16 window's kernel lets the layer's last kernel start beside it (programmatic dependent launch;
    the caller checked sm_90 and compiled kernels): ``MMKV_WINDOW_OVERLAP`` (default 1) where the planned items end
    with a window (a dense segment of up to ``WINDOW_TOKENS``; a longer dense segment beside the text kernel is
    unmeasured) and then a Gluon text kernel or a layout whose launch honours ``it["dep"]`` (SKVQ's). The window's
    programs trigger at their start; the text kernel waits for the window only before writing its partials, so its
    end still implies the window's and the merge after it reads finished partials. H100, random:internvl2.5-8b
    n32768, decode step ms on / off (docs/BENCHMARKS.md, "The window beside the text kernel"): XQuant B16 12.43 /
    12.52, SKVQ K2/V1.5 B16 13.16 / 13.24 and B1 7.12 / 7.17; KIVI-2 B1 6.98 / 6.98."""
    if not on_off("MMKV_WINDOW_OVERLAP") or len(items) < 2 or items[-1].get("fin"):
        return False
    if items[-2]["kind"] != KIND_DENSE or items[-2]["T"] > WINDOW_TOKENS:  # a window, not a dense body
        return False
    last = items[-1]
    return bool(last.get("tgl")) or (last["kind"] == KIND_PLUGIN and LAYOUTS[type(last["seg"])].dependent)


def channel_overlap(items: list) -> bool:
    """Whether the clustered fused channel kernel (the plan's ``fin`` item, last) starts beside the dense or KIVI
    segment kernel before it (which triggers at once; the fused kernel waits for it only where it merges the
    partials; the caller checked sm_90 and compiled kernels): the fused kernel leaves memory bandwidth to spare (a
    text segment of a budget batch hid behind it, docs/BENCHMARKS.md); ``MMKV_OVERLAP=0`` launches them one after
    the other."""
    return (len(items) > 1 and bool(items[-1].get("fin")) and items[-1]["kind"] == KIND_CHANNEL
            and items[-2]["kind"] in (KIND_DENSE, KIND_KIVI) and switch("MMKV_OVERLAP") != "0")
