"""The Gluon SKVQ kernel's program shape and L2 prefetch (``skvq_rules.skvq_warps`` / ``skvq_prefetch``; issue 26).

On CPU: the rules' values and errors, the plan's tile per warps (64 tokens at 2 warps), and the sm_90 build at 2
warps (same hot loop per warp as 4, nothing spilled) and with the prefetch (6 bulk L2 prefetches in each loop, the
same tensor-core and load work). On the GPU (``-m gpu``): 2 warps and the prefetch against the torch reference on
odd, ragged shapes (an empty row, 1- and 2-bit keys, ternary and 2-bit values, head_dim 64/128, FP8, G 1-8),
outputs pre-filled with NaN, relative L2 error < 2e-3 as in ``test_skvq_gluon.py``; and a long row (the rule's 2
warps by default) likewise.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from gluon_reports import compiled_reports  # noqa: E402
from reference_match import assert_matches_reference  # noqa: E402

CUDA = torch.cuda.is_available()


def test_warps_rule(monkeypatch):
    from kernels.decode.skvq_rules import skvq_warps

    monkeypatch.delenv("MMKV_SKVQ_WARPS", raising=False)
    assert skvq_warps(1, 8, 32768) == 2 and skvq_warps(3, 8, 16384) == 2 and skvq_warps(10, 3, 16384, 64) == 2
    assert skvq_warps(1, 8, 16383) == 4 and skvq_warps(4, 8, 32768) == 4 and skvq_warps(16, 8, 32768) == 4
    monkeypatch.setenv("MMKV_SKVQ_WARPS", "4")
    assert skvq_warps(1, 8, 32768) == 4
    for bad in ("3", "8", "x"):
        monkeypatch.setenv("MMKV_SKVQ_WARPS", bad)
        with pytest.raises(ValueError, match="MMKV_SKVQ_WARPS must be 2 or 4"):
            skvq_warps(1, 8, 32768)


def test_prefetch_rule(monkeypatch):
    from kernels import testing
    from kernels.decode.gluon.skvq_ok import seg_prefetch
    from kernels.decode.skvq_rules import skvq_prefetch

    monkeypatch.delenv("MMKV_SKVQ_PREFETCH", raising=False)
    assert skvq_prefetch(1, 8, 32768) == 1 and skvq_prefetch(3, 8, 16384) == 1
    assert skvq_prefetch(1, 8, 16383) == 0 and skvq_prefetch(4, 8, 32768) == 0 and skvq_prefetch(1, 3, 32768, 64) == 0
    monkeypatch.setenv("MMKV_SKVQ_PREFETCH", "2")
    assert skvq_prefetch(1, 8, 32768) == 2
    seg = testing.skvq_seg(1, 2, 64, 64, [64], 2, 2.0, 2, g=torch.Generator().manual_seed(0))
    assert seg_prefetch(seg, 64) == 0  # a CPU segment: no bulk prefetch off sm_90 (the switch says 2)
    for bad in ("5", "-1", "x"):
        monkeypatch.setenv("MMKV_SKVQ_PREFETCH", bad)
        with pytest.raises(ValueError, match="MMKV_SKVQ_PREFETCH must be 0-4"):
            skvq_prefetch(1, 8, 32768)


def test_plan_tile_follows_the_warps(monkeypatch):
    """The SKVQ layout's tile is 32 tokens a warp of the segment's rule (its rows, KV heads and capacity)."""
    from kernels import testing
    from kernels.decode import skvq
    from kernels.decode.gluon.skvq import gluon_tile

    monkeypatch.setattr(skvq, "skvq_gluon_ok", lambda *a: True)
    g = torch.Generator().manual_seed(1)
    long = testing.skvq_seg(1, 2, 16384, 64, [16384], 2, 2.0, 2, g=g)
    short = testing.skvq_seg(1, 2, 1000, 64, [1000], 2, 2.0, 2, g=g)
    assert gluon_tile(2) == 64 and gluon_tile(4) == 128
    assert skvq._tile(long, 64) == 64 and skvq._tile(short, 64) == 128
    monkeypatch.setenv("MMKV_SKVQ_WARPS", "4")
    assert skvq._tile(long, 64) == 128


# head_dim, K bits, V bits, groups, G, ternary lane loads
SASS_CASES = [(128, 2, 1.5, 2, 4, True), (64, 2, 2, 2, 3, False)]
SASS_VARIANTS = [(4, 0), (2, 0), (2, 1), (4, 1)]  # warps, prefetch


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from kernels.decode.gluon.skvq_ok import columns, skvq_regs

    calls = [f"skvq_report(tmp, D={d}, kbits={k}, vbits={v}, ng={n}, G={g}, tlane={t}, W={w}, pfd={p}, "
             f"maxnreg={skvq_regs(v, True, d, columns(g, n))})"
             for d, k, v, n, g, t in SASS_CASES for w, p in SASS_VARIANTS]
    out = compiled_reports(tmp_path_factory.mktemp("skvq_warps"), f"[{', '.join(calls)}]", timeout=900)
    n = len(SASS_VARIANTS)
    return {(c, wp): out[i * n + j] for i, c in enumerate(SASS_CASES) for j, wp in enumerate(SASS_VARIANTS)}


@pytest.mark.parametrize("case", SASS_CASES, ids=[f"D{c[0]}-k{c[1]}v{c[2]}" for c in SASS_CASES])
def test_two_warps_and_prefetch_build(reports, case):
    """2 warps: each warp's loop issues what it does at 4 (same MMAs, loads and unpacking; within 1% overall), at most
    the registers of 4 warps, no local memory. Prefetch 1: six bulk L2 prefetches (``UBLKPF``) in each of the two
    loops, none without, the same MMAs, loads, ternary FMAs and exponentials, and at most 12 more ``LOP3``/``PRMT``
    (the prefetches' address rounding, register moves)."""
    def ops(r, names=("HMMA", "LDG", "LOP3", "PRMT", "HFMA2", "MUFU")):
        return {op: r.get(op, 0) for op in names}

    def total(r):
        return sum(v for k, v in r.items() if k.isupper() and isinstance(v, int))

    w4, w2 = reports[(case, (4, 0))], reports[(case, (2, 0))]
    for r in reports.values():
        assert r["local"] == 0 and r["loops"] == 2, r
    assert ops(w2) == ops(w4) and ops(w2["masked"]) == ops(w4["masked"]), (w2, w4)
    assert abs(total(w2) - total(w4)) <= 0.01 * total(w4), (total(w2), total(w4))
    assert w2["reg"] <= w4["reg"], (w2["reg"], w4["reg"])
    for w in (2, 4):
        plain, pf = reports[(case, (w, 0))], reports[(case, (w, 1))]
        for loop, base in ((pf, plain), (pf["masked"], plain["masked"])):
            assert loop.get("UBLKPF", 0) == 6 and base.get("UBLKPF", 0) == 0, (loop, base)
            keep = ("HMMA", "LDG", "HFMA2", "MUFU")
            assert ops(loop, keep) == ops(base, keep), (w, loop, base)
            bits = sum(ops(loop, ("LOP3", "PRMT")).values()) - sum(ops(base, ("LOP3", "PRMT")).values())
            assert 0 <= bits <= 12, (w, bits, loop, base)


GPU_CASES = [  # B, H, G, capacity, lens, head_dim, K bits, V bits, groups, fixed, permuted, fp8
    (3, 2, 4, 777, [777, 300, 0], 128, 2, 1.5, 2, False, True, True),
    (2, 3, 3, 1001, [1001, 65], 64, 2, 2, 4, True, True, False),
    (2, 1, 8, 640, [640, 17], 128, 1, 1.5, 1, False, False, False),
    (3, 2, 1, 531, [531, 64, 1], 64, 1, 1, 2, False, True, True),
]
MODES = {"w2": {"MMKV_SKVQ_WARPS": "2"}, "w2+pf1": {"MMKV_SKVQ_WARPS": "2", "MMKV_SKVQ_PREFETCH": "1"},
         "w4+pf2": {"MMKV_SKVQ_WARPS": "4", "MMKV_SKVQ_PREFETCH": "2"}, "w2+pf1+tps3": {
             "MMKV_SKVQ_WARPS": "2", "MMKV_SKVQ_PREFETCH": "1", "MMKV_SKVQ_TPS": "3"}}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ci", range(len(GPU_CASES)))
def test_gpu_warps_and_prefetch_match_reference(ci, mode, monkeypatch):
    from kernels import testing
    from kernels.decode.gluon.skvq import gluon_tile
    from kernels.decode.plan import plan_items

    for k, v in MODES[mode].items():
        monkeypatch.setenv(k, v)
    B, H, G, T, lens, D, kbits, vbits, ng, fixed, perm, fp8 = GPU_CASES[ci]
    g = torch.Generator().manual_seed(T + G + D)
    seg = testing.skvq_seg(B, H, T, D, lens, kbits, float(vbits), ng, fixed, perm, fp8, g=g, device="cuda")
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    items = plan_items(q, [seg], B, H, G, D, 132, None, 2, True, None, None, 64)[0]
    assert items[0]["tt"] == gluon_tile(int(MODES[mode]["MMKV_SKVQ_WARPS"]))
    assert_matches_reference(q, [seg], lens)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("vbits", [1.5, 2])
def test_gpu_long_row_takes_two_warps(vbits, monkeypatch):
    """A row of 16k+ tokens plans 2-warp programs by default and matches the reference (a second row ends mid-tile)."""
    from kernels import testing
    from kernels.decode.gluon.skvq import gluon_tile
    from kernels.decode.plan import plan_items

    monkeypatch.delenv("MMKV_SKVQ_WARPS", raising=False)
    g = torch.Generator().manual_seed(7)
    lens = [16391, 9000]
    seg = testing.skvq_seg(2, 2, 16400, 128, lens, 2, float(vbits), 2, fp8=True, g=g, device="cuda")
    q = torch.randn(2, 8, 128, generator=g).to("cuda", torch.float16)
    assert plan_items(q, [seg], 2, 2, 4, 128, 132, None, 2, True, None, None, 64)[0][0]["tt"] == gluon_tile(2)
    assert_matches_reference(q, [seg], lens)
