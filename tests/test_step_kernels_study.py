"""eval/studies/step_kernels: a profiler trace's kernels split into steps (at the host's idle time between them),
per-kernel sums per step, the idle time between kernels, one layer in order, and the variants' switch syntax."""

from __future__ import annotations

from eval.studies.step_kernels import layer_sequence, parse_variants, split_steps, summarize

LAYER = (("gemm", 10.0), ("void _segment_kernel<x>", 5.0), ("_text_kernel", 20.0), ("_merge_kernel", 3.0),
         ("rms", 2.0))


def _trace(steps=3, layers=4, gap=0.5, between=500.0):
    ks, t = [], 0.0
    for _ in range(steps):
        for _ in range(layers):
            for name, dur in LAYER:
                ks.append({"name": name, "ts": t, "dur": dur})
                t += dur + gap
        t += between
    return ks


def test_steps_kernels_and_idle_time():
    steps = split_steps(_trace())
    assert [len(s) for s in steps] == [20, 20, 20]
    s = summarize(steps)
    assert s["launches"] == 20
    assert s["kernels"]["_text_kernel"] == {"calls_per_step": 4.0, "us_per_step": 80.0, "us_per_call": 20.0}
    assert s["kernels"]["_segment_kernel"]["us_per_call"] == 5.0  # template arguments and "void " dropped
    assert s["busy_us"] == 4 * 40.0 and abs(s["span_us"] - (160.0 + 19 * 0.5)) < 1e-9
    assert s["attn_us"] == 4 * 28.0


def test_one_layer_in_order():
    seq = layer_sequence(split_steps(_trace(layers=4))[1], 4)
    assert [e["name"] for e in seq] == ["gemm", "_segment_kernel", "_text_kernel", "_merge_kernel", "rms"]
    assert all(abs(e["gap"] - 0.5) < 1e-9 for e in seq)


def test_variants():
    assert parse_variants("base:,pf:MMKV_TEXT_PREFETCH=1;MMKV_TEXT_WARPS=4") == [
        ("base", {}), ("pf", {"MMKV_TEXT_PREFETCH": "1", "MMKV_TEXT_WARPS": "4"})]
