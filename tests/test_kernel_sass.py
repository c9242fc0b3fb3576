"""The Gluon channel kernels compile for the H100 (sm_90) on this CPU-only machine, and their hot loops issue what
docs/KERNELS.md counts: one ``and`` per two codes and one fp16 MMA per 256 codes on each fp16 side, one ``and`` per
four codes and one int8 MMA per 512 codes on an int8 K side (1-bit codes, up to 4 query heads), no local memory;
the codes arrive by ``cp.async`` where the shared-memory ring is on and by plain loads where it is off; the range
pass lets the main pass start early and the main pass waits for it, then lets the merge start
(``griddepcontrol``). The fused kernel's K loop keeps its logits in shared memory (one block barrier per iteration)
and its V loop reads them back (none). Gluon kernels cannot run under the Triton interpreter, so this is what CI can
check of them; their numbers are tested on the GPU (tests/test_kernels.py -k gpu).

Compiled in a subprocess (``gluon_reports.py``): an earlier test module may have imported triton with
TRITON_INTERPRET=1, which turns every ``@jit`` function into an interpreted one.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
from gluon_reports import compiled_reports  # noqa: E402

# (bits, head_dim, 0 main / 1 range, query heads per KV head): 1-bit with G <= 4 takes the int8 K side
CASES = [(1, 128, 0, 4), (1, 128, 1, 4), (1, 64, 0, 8), (1, 64, 1, 8), (2, 64, 0, 4), (8, 64, 0, 4), (8, 128, 1, 4)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = compiled_reports(tmp_path_factory.mktemp("sass"),
                           f"[report(b, d, g, m, 2, 90, tmp) for b, d, m, g in {CASES!r}]")
    return dict(zip(CASES, out, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[f"{b}bit-D{d}-{'range' if m else 'main'}-G{g}" for b, d, m, g in CASES])
def test_hot_loop_and_and_mma_counts(reports, case):
    bits, D, mode, G = case
    r = reports[case]
    tokens = r["tokens_per_warp_iteration"]
    assert r["int8_k"] == (bits == 1 and G <= 4), r
    assert r["local"] == 0, f"local memory (spills): {r}"
    side_codes = tokens * D  # token-channel codes of one side (K or V) per warp iteration
    k_and = side_codes // 32 // (4 if r["int8_k"] else 2)  # per lane
    v_and = 0 if mode else side_codes // 32 // 2  # the range pass reads K only
    if r["int8_k"]:  # m16n8k32 int8: 16 rows x 32 codes per MMA; the V side stays m16n8k16 fp16
        assert r["imma"] == side_codes // 512 and r["hmma"] == (0 if mode else side_codes // 256), r
    else:  # m16n8k16: 16 rows x 16 codes per MMA and side
        assert r["imma"] == 0 and r["hmma"] == (1 if mode else 2) * side_codes // 256, r
    assert k_and + v_and <= r["lop3"] <= k_and + v_and + 2, r
    assert r["reg"] <= 168, r  # at least 12 warps of 2-warp programs per SM
    if r["stages"]:
        assert r["ldgsts"] > 0 and r["ldg"] == 0, r
    else:
        assert r["ldg"] > 0 and r["ldgsts"] == 0, r
    assert r["griddepcontrol"] == (1 if mode else 2), r  # range: launch_dependents; main: wait, launch_dependents


FUSED = [(128, 4), (64, 3)]


@pytest.fixture(scope="module")
def fused_reports(tmp_path_factory):
    out = compiled_reports(tmp_path_factory.mktemp("sass_fused"),
                           f"[report(1, d, g, 2, 2, 90, tmp, itm=8) for d, g in {FUSED!r}]")
    return dict(zip(FUSED, out, strict=True))


@pytest.mark.parametrize("case", FUSED, ids=[f"D{d}-G{g}" for d, g in FUSED])
def test_fused_kernel_phases(fused_reports, case):
    """K loop: one ``and`` per 4 codes, one int8 MMA per 512 codes, its logits stored to shared memory (``STSM``)
    behind one block barrier per iteration; V loop: one ``and`` per 2 codes, one fp16 MMA per 256 codes, the logits
    read back (``LDSM``), no barrier, no K load. Barrier atomics present; the merge may start early."""
    D, G = case
    r = fused_reports[case]
    assert r["int8_k"] and r["local"] == 0, r
    k_loop, v_loop = r["phases"]
    codes = 64 * D  # 64 tokens per warp iteration (8 byte rows of 1-bit codes)
    assert k_loop.get("IMMA") == codes // 512 and "HMMA" not in k_loop, k_loop
    assert codes // 128 <= k_loop["LOP3"] <= codes // 128 + 2 and k_loop.get("BAR") == 1, k_loop
    assert k_loop.get("STSM", 0) + k_loop.get("STS", 0) > 0, k_loop
    assert v_loop.get("HMMA") == codes // 256 and "IMMA" not in v_loop, v_loop
    assert codes // 64 <= v_loop["LOP3"] <= codes // 64 + 2 and "BAR" not in v_loop, v_loop
    # the logits read back; V codes only (two vector loads per lane, where the main pass's K and V take four)
    assert v_loop.get("LDSM", 0) + v_loop.get("LDS", 0) > 0 and v_loop.get("LDG") == 2, v_loop
    assert r["atomics"] >= 2 and r["griddepcontrol"] == 1, r
    assert r["reg"] <= 128, r  # 8 two-warp programs per SM


# (warps, CTAs per cluster, merge into the output: 0 no / 1 out / 2 out + lse, head_dim): the planner's shapes
CLUSTERED = [(2, 2, 1, 128), (4, 8, 0, 64), (16, 1, 2, 128)]


@pytest.fixture(scope="module")
def cluster_reports(tmp_path_factory):
    out = compiled_reports(tmp_path_factory.mktemp("sass_cluster"),
                           f"[report(1, d, 4, 2, w, 90, tmp, itm=8, cl=c, fin=f) for w, c, f, d in {CLUSTERED!r}]")
    return dict(zip(CLUSTERED, out, strict=True))


@pytest.mark.parametrize("case", CLUSTERED, ids=[f"W{w}-CL{c}-FIN{f}-D{d}" for w, c, f, d in CLUSTERED])
def test_cluster_kernel_phases(cluster_reports, case):
    """The fused kernel's cluster variants (sm_90): the same K and V loops as the counter variant, no atomics; two
    cluster-barrier instructions (arrive, wait) per barrier: one before V (a one-CTA pair takes a block barrier
    instead), one more before the in-kernel merge (a one-CTA pair skips it at run time where its partial is the
    layer's only one); the merge launch is not signalled where the kernel merges, which instead waits once for the
    layer's previous segment kernel, that it may run beside, before it reads the partials. A one-CTA pair's exchange
    between the loops takes a few block barriers (2 with Triton 3.6, 5 with 3.9), where it took 13-15 before its
    (min, max) became one reduction."""
    W, CL, FIN, D = case
    r = cluster_reports[case]
    assert r["int8_k"] and r["local"] == 0, r
    k_loop, v_loop = r["phases"]
    codes = 64 * D
    assert k_loop.get("IMMA") == codes // 512 and k_loop.get("BAR") == 1, k_loop
    assert v_loop.get("HMMA") == codes // 256 and "BAR" not in v_loop, v_loop
    assert r["atomics"] == 0, r
    assert r["cluster_barriers"] == 2 * ((CL > 1) + (FIN > 0)), r
    if CL == 1:  # a one-program pair: (min, max) in one shared-memory round, calibration without layout conversions
        assert 1 <= r["exchange_barriers"] <= 5, r  # Triton 3.6 (the GPU image) 2, Triton 3.9 5; 13 / 15 before
    assert r["griddepcontrol"] == 1, r  # FIN: wait (before merging); else launch_dependents (for the merge)
    assert r["reg"] <= 128, r


def test_append_kernel_writes_each_length_after_a_barrier(tmp_path):
    """``kernels/ops/append.py`` compiled for sm_90 (4 warps, InternVL's 8 heads of 128): a block barrier, then one
    global store, the row's length; without the barrier a warp could write the length back while another has not
    read it yet, and its K/V would land one slot late (the interpreter runs a program's threads as one, so only the
    compiled code shows it). No local memory."""
    r = compiled_reports(tmp_path, "[append_report(tmp)]")[0]
    assert r["bars"] >= 1 and r["stores_after_bar"] == 1 and r["stores"] > 1, r
    assert r["local"] == 0, r
