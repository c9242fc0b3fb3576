"""The Gluon KIVI/XQuant decode kernel (``kernels/decode/gluon/text.py``).

On CPU (CI): it compiles for the H100 (sm_90) and its hot loop issues what the design says per warp iteration (32
tokens with 2-bit keys, 64 with 1-bit): fp16 MMAs per step and key block on the K side, one per key block for the
zero term, one per step on the V side (x head_dim / 16), no shared memory, no barrier, no local memory; values in
natural order take one ``fma`` per two dequantized values, values in tile order (post-scaled) none, and one more
MMA per step for their zero term; capped at 168 registers with q read back from shared memory (1-bit keys at head_dim
128, as the plan launches them), no spills and four shared-memory loads per iteration. Gluon cannot run under the
Triton interpreter, so its numbers are tested on the GPU
(``-m gpu``): against the torch reference on odd and ragged lengths, GQA groups 1-8, head_dim 64 and 128, 1- and
2-bit keys and values, K blocks of 32-128 tokens and V groups of 8-64 channels, output pre-filled with NaN.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from gluon_reports import compiled_reports  # noqa: E402

CUDA = torch.cuda.is_available()


SASS_CASES = [  # head_dim, K bits, V bits, K block, V group, post-scaled (values in tile order)
    (128, 2, 2, 32, 32, False), (128, 2, 1, 32, 32, False), (128, 1, 1, 32, 32, False), (128, 1, 1, 64, 32, False),
    (64, 2, 2, 32, 32, False), (64, 1, 2, 32, 32, False),
    (128, 2, 2, 32, 32, True), (128, 2, 1, 32, 32, True), (128, 1, 1, 32, 32, True), (128, 2, 2, 32, 16, True),
    (128, 2, 1, 32, 128, True), (64, 2, 2, 32, 32, True), (64, 1, 2, 32, 16, True), (64, 2, 1, 64, 64, True),
]


# 1-bit keys at head_dim 128 as the plan launches them (``plan.text_regs``): q read back from shared memory each
# iteration, 168 registers at most (3 programs of 4 warps per SM), no prefetch; (V bits, K block, V group)
CAPPED_CASES = [(1, 32, 32), (2, 32, 32), (1, 32, 128)]


# the variants the plan launches at InternVL / SmolLM2 heads (G=4 here), with the merge in the kernel (text_merge.py):
# head_dim, K bits, V bits, post-scaled, prefetch, q from shared memory, register cap, warps
FIN_CASES = [(128, 2, 2, True, 1, False, None, 2), (128, 2, 2, True, 1, False, None, 4),
             (128, 1, 1, True, 0, True, 168, 4), (64, 2, 2, False, 0, False, None, 4)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every case compiled in one fresh interpreter (no TRITON_INTERPRET; Gluon cannot be interpreted)."""
    calls = [f"text_report(tmp, D={d}, bits={k}, vbits={v}, kblk={b}, group={g}, post={p})"
             for d, k, v, b, g, p in SASS_CASES]
    calls += [f"text_report(tmp, D=128, bits=1, vbits={v}, kblk={b}, group={g}, post=True, qsm=True, maxnreg=168)"
              for v, b, g in CAPPED_CASES]
    calls += [f"text_report(tmp, G=4, D={d}, bits={k}, vbits={v}, kblk=32, group=32, post={p}, pfd={f}, qsm={q}, "
              f"maxnreg={r}, warps={w}, fin={fin}, lv={lv})" for d, k, v, p, f, q, r, w in FIN_CASES
              for fin, lv in ((0, 1), (2, 1), (2, 2))]
    out = compiled_reports(tmp_path_factory.mktemp("text_sass"), f"[{', '.join(calls)}]", timeout=900)
    keys = SASS_CASES + [("capped",) + c for c in CAPPED_CASES]
    keys += [("fin", fin, lv) + c for c in FIN_CASES for fin, lv in ((0, 1), (2, 1), (2, 2))]
    return dict(zip(keys, out, strict=True))


@pytest.mark.parametrize("case", SASS_CASES, ids=[f"D{d}-k{k}v{v}-blk{b}-g{g}-{'post' if p else 'pre'}"
                                                  for d, k, v, b, g, p in SASS_CASES])
def test_text_kernel_hot_loop_counts(reports, case):
    D, kbits, vbits, kblk, group, post = case
    r = reports[case]
    tokens = 8 * (8 // kbits)  # one warp's 8 byte rows of key codes
    steps, ktiles = tokens // 16, D // 16
    blocks = max(1, tokens // kblk)  # key scale blocks in them: a K-side MMA and a zero-term MMA per block
    assert r["local"] == 0, r
    assert r["loops"] == 1, r
    v_mma = steps * ktiles + (steps if post else 0)  # post-scaled: one more MMA per step, p^T times the zeros
    assert r["HMMA"] == steps * ktiles * blocks + blocks * ktiles + v_mma, r
    if post:  # no per-value arithmetic beyond the plane mask: no fma, no offset subtraction
        assert r.get("HFMA2", 0) == 0 and r.get("HADD2", 0) == 0, r
    else:
        assert r.get("HFMA2", 0) == tokens * D // 32 // 2, r  # one fma per pair of V values per lane
    for op in ("BAR", "STS", "LDS", "STL", "LDL"):
        assert r.get(op, 0) == 0, (op, r)


@pytest.mark.parametrize("case", CAPPED_CASES, ids=[f"k1v{v}-blk{b}-g{g}" for v, b, g in CAPPED_CASES])
def test_text_kernel_capped_fits_three_programs(reports, case):
    """Under the cap the variant fits 3 programs of 4 warps per SM (65536 registers) without spilling: no local
    memory, no stack, and the only shared-memory traffic in the loop is q's reload (D x 8 fp16 per warp: four
    16-byte loads per lane), with no barrier; the MMAs are those of the uncapped variant."""
    r = reports[("capped",) + case]
    assert r["reg"] <= 168 and 3 * 128 * r["reg"] <= 65536, r
    assert r["local"] == 0 and r.get("stack", 0) == 0, r
    assert r.get("STL", 0) == 0 and r.get("LDL", 0) == 0, r
    assert r.get("LDS", 0) == 4 and r.get("STS", 0) == 0 and r.get("BAR", 0) == 0, r
    steps, ktiles, blocks = 4, 8, 64 // case[1]
    assert r["HMMA"] == steps * ktiles * blocks + blocks * ktiles + steps * ktiles + steps, r


@pytest.mark.parametrize("case", FIN_CASES, ids=[f"D{c[0]}-k{c[1]}v{c[2]}-w{c[7]}{'-capped' if c[6] else ''}"
                                                  for c in FIN_CASES])
def test_text_kernel_merge_leaves_the_loop_alone(reports, case):
    """The merge in the kernel (one or two levels) runs after the loop: the loop issues the same MMAs and loads as
    without it, nothing spills, and the registers stay where the programs per SM do not change (168 at most: 3
    warps per SM quarter; the capped 1-bit-key variant under its cap; head_dim 64 at 4 warps per quarter)."""
    base = reports[("fin", 0, 1) + case]
    for lv in (1, 2):
        r = reports[("fin", 2, lv) + case]
        assert r["local"] == 0 and r.get("stack", 0) == 0 and r.get("STL", 0) == 0 and r.get("LDL", 0) == 0, r
        for op in ("HMMA", "LDG", "LDS", "BAR"):
            assert r.get(op, 0) == base.get(op, 0), (op, lv, r, base)
        assert r["reg"] <= (128 if case[0] == 64 else 168), (lv, r["reg"], base["reg"])


CASES = [  # B, H, G, capacity, lens, K block, V group, K bits, V bits, head_dim
    (2, 2, 4, 777, [777, 500], 32, 32, 2, 2, 128), (2, 2, 8, 777, [40, 1], 32, 32, 2, 2, 128),
    (3, 1, 1, 1000, [1000, 999, 33], 64, 64, 2, 2, 128), (1, 3, 7, 300, [257], 128, 16, 2, 2, 128),
    (2, 8, 4, 4096, [4096, 3001], 32, 32, 2, 2, 128), (2, 1, 2, 96, [0, 95], 32, 32, 2, 2, 128),
    (2, 2, 4, 777, [777, 500], 32, 32, 2, 1, 128), (3, 1, 8, 1000, [1000, 3, 999], 64, 16, 2, 1, 128),
    (2, 2, 4, 777, [777, 500], 32, 32, 1, 1, 128), (2, 3, 3, 1000, [999, 64], 64, 32, 1, 2, 128),
    (2, 3, 3, 777, [777, 401], 32, 32, 2, 2, 64), (3, 1, 8, 1000, [1000, 3, 999], 64, 8, 2, 1, 64),
    (2, 3, 3, 777, [700, 65], 32, 32, 1, 1, 64), (1, 2, 5, 513, [513], 128, 64, 1, 2, 64),
    (2, 2, 6, 555, [555, 129], 32, 128, 2, 1, 128), (2, 1, 4, 1000, [999, 480], 32, 64, 1, 1, 128),
    (2, 2, 2, 400, [333, 400], 32, 16, 1, 2, 64), (1, 2, 8, 333, [333], 32, 64, 2, 2, 64),
]
# the same shapes with values in natural order (the pre-scaled variant; groups of 8 channels take it anyway)
NATURAL = [c for c in CASES if c[6] % (c[9] // 8) == 0][::2]


def _ids(cases):
    return [f"B{c[0]}H{c[1]}G{c[2]}T{c[3]}blk{c[5]}g{c[6]}k{c[7]}v{c[8]}D{c[9]}" for c in cases]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("order", ["tiles", "tiles+prefetch", "tiles+regs", "natural"])
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_gpu_text_kernel_matches_reference(case, order, monkeypatch):
    """``"tiles"``: the post-scaled variant, wherever groups are multiples of 16 (the methods pack so on CUDA at
    head_dim 128, ``plan.kivi_value_order``); ``"natural"``: the pre-scaled variant on the other shapes and on half
    of these. These shapes are below the work where the plan turns on the L2 prefetch (``plan.text_prefetch``), so
    ``"tiles+prefetch"`` forces it one iteration ahead and ``"natural"`` two (sm_90; elsewhere the plan keeps 0).
    ``"tiles+regs"``: q read back from shared memory under a register cap (``plan.text_regs``): 168 with 1-bit keys
    as the plan launches them from larger work (prefetch off), else 128 with the prefetch on (2-bit keys spill)."""
    if order == "tiles+prefetch":
        monkeypatch.setenv("MMKV_TEXT_PREFETCH", "1")
        order = "tiles"
    elif order == "tiles+regs":
        if case[7] == 2:
            monkeypatch.setenv("MMKV_TEXT_PREFETCH", "1")
        monkeypatch.setenv("MMKV_TEXT_REGS", "168" if case[7] == 1 else "128")
        order = "tiles"
    elif order == "natural":
        monkeypatch.setenv("MMKV_TEXT_PREFETCH", "2")
    import kernels
    from kernels import testing
    from kernels.decode.plan import plan_items
    from kernels.reference import decode_reference

    B, H, G, T, lens, blk, grp, kbits, vbits, D = case
    if order == "tiles" and grp % 16:
        order = "natural"  # groups of 8 channels: only the pre-scaled variant reads them
    elif order == "natural" and case not in NATURAL:
        pytest.skip("natural order runs on every other shape")
    g = torch.Generator().manual_seed(T + G)
    seg = testing.kivi_seg(B, H, T, D, lens, kbits, vbits, blk, grp, g=g, device="cuda", order=order)
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    items, _, _ = plan_items(q, [seg], B, H, G, D, 132, None, 2, True, None, None, 64)
    assert items[0]["tgl"], "the Gluon text kernel should read this segment"
    ref, ref_lse = decode_reference(q, [seg])
    out = torch.full_like(q, float("nan"))
    got, lse = kernels.decode_attention(q, [seg], out=out, return_lse=True)
    live = torch.tensor(lens, device="cuda") > 0
    err = (got.float() - ref.float())[live].norm() / ref.float()[live].norm()
    assert err < 1e-3, err.item()  # fp16 operands (q*s, dequantized V, p) with fp32 accumulation, as the Triton kernel
    assert not torch.isnan(got).any()
    assert torch.allclose(lse[live], ref_lse.float()[live], atol=2e-3, rtol=1e-4)
    assert (got[~live] == 0).all()
    monkeypatch.setenv("MMKV_TEXT_GLUON", "0")  # the Triton kernel agrees too
    tri = kernels.decode_attention(q, [seg])
    assert ((tri.float() - got.float())[live].norm() / ref.float()[live].norm()) < 1e-3


def test_text_programs_per_sm_by_work():
    """Small work keeps 4 programs per SM; larger work is cut into more, shorter programs (6, then 12), by
    batch x KV heads x tokens (docstring of ``plan.text_programs_per_sm`` for the measurements)."""
    from kernels.decode.plan import text_programs_per_sm
    assert text_programs_per_sm(1, 8, 32768) == 4.0  # 256k
    assert text_programs_per_sm(16, 8, 4096) == 4.0  # 512k
    assert text_programs_per_sm(16, 3, 32768) == 6.0  # 1.5M
    assert text_programs_per_sm(16, 8, 32768) == 6.0  # 4M
    assert text_programs_per_sm(64, 3, 32768) == 12.0  # 6.3M
    assert text_programs_per_sm(64, 8, 32768) == 12.0


def test_text_regs_rule(monkeypatch):
    """A register cap of 168 (and q out of the registers) only for 1-bit keys at head_dim 128 from half a million
    batch x KV heads x tokens, where it takes the kernel from 2 to 3 programs per SM; there the prefetch stays off
    (its addresses would spill under the cap). The switch overrides: 0 is the uncapped kernel; other values must
    be register counts the hardware allocates."""
    from kernels.decode import plan
    monkeypatch.setattr(plan, "_capability", lambda dev: (9, 0))
    assert plan.text_regs(1, 128, 16, 8, 32768) == (True, 168)
    assert plan.text_regs(1, 128, 16, 8, 4096) == (True, 168)  # 512k: the threshold itself
    assert plan.text_regs(1, 128, 1, 8, 32768) == (False, 0)  # 256k: programs of a few iterations
    assert plan.text_regs(2, 128, 16, 8, 32768) == (False, 0)  # a cap of 128 spilled and was slower
    assert plan.text_regs(1, 64, 64, 3, 32768) == (False, 0)
    assert plan.text_prefetch("cuda", 16, 8, 32768, 128, capped=True) == 0
    monkeypatch.setenv("MMKV_TEXT_REGS", "0")
    assert plan.text_regs(1, 128, 16, 8, 32768) == (False, 0)
    monkeypatch.setenv("MMKV_TEXT_REGS", "128")
    assert plan.text_regs(2, 64, 1, 1, 64) == (True, 128)
    for bad in ("100", "256", "-8", "x"):
        monkeypatch.setenv("MMKV_TEXT_REGS", bad)
        with pytest.raises(ValueError, match="MMKV_TEXT_REGS"):
            plan.text_regs(2, 128, 16, 8, 32768)


def test_text_prefetch_rule(monkeypatch):
    """L2 prefetch one iteration ahead only on sm_90+, at head_dim 128 and from a million batch x KV heads x tokens
    (``plan.text_prefetch``'s measurements); the switch overrides and rejects other values."""
    from kernels.decode import plan
    monkeypatch.setattr(plan, "_capability", lambda dev: (9, 0))
    assert plan.text_prefetch("cuda", 16, 8, 32768, 128) == 1
    assert plan.text_prefetch("cuda", 64, 8, 4096, 128) == 1
    assert plan.text_prefetch("cuda", 1, 8, 32768, 128) == 0  # 256k: programs of a few iterations
    assert plan.text_prefetch("cuda", 16, 3, 32768, 64) == 0  # head_dim 64 measured slower
    monkeypatch.setenv("MMKV_TEXT_PREFETCH", "2")
    assert plan.text_prefetch("cuda", 1, 1, 64, 64) == 2
    monkeypatch.setenv("MMKV_TEXT_PREFETCH", "5")
    with pytest.raises(ValueError, match="MMKV_TEXT_PREFETCH"):
        plan.text_prefetch("cuda", 16, 8, 32768, 128)
    monkeypatch.setattr(plan, "_capability", lambda dev: (8, 0))
    assert plan.text_prefetch("cuda", 16, 8, 32768, 128) == 0  # the bulk prefetch is sm_90's


MERGE_CASES = [  # B, H, G, capacity, lens, K bits, V bits, head_dim, programs per SM (None: the plan's), dense segment
    (2, 1, 4, 9000, [9000, 5001], 2, 2, 128, 64.0, None),  # 36 splits per pair: groups of 8, then the groups
    (1, 2, 3, 20000, [19999], 2, 1, 64, 64.0, "after"),  # two levels, a dense segment's partials after the text's
    (2, 2, 8, 4100, [4100, 7], 1, 1, 128, None, "before"),  # one level, a dense segment before
    (3, 1, 1, 777, [777, 0, 300], 2, 2, 128, None, None),  # G=1 (the merge reads 32 partials a round); an empty row
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", MERGE_CASES, ids=[f"B{c[0]}H{c[1]}G{c[2]}T{c[3]}k{c[5]}v{c[6]}D{c[7]}-{c[9]}"
                                                   for c in MERGE_CASES])
def test_gpu_text_kernel_merges_its_partials(case, monkeypatch):
    """The text kernel's own merge (``gluon/text_merge.py``, launched last, no merge launch): against the torch
    reference (output pre-filled with NaN, lse), against the merge launch (``MMKV_TEXT_FIN=0``) on the same inputs,
    with other segments' partials before or after the text kernel's splits, in one level or two (many splits:
    ``programs_per_sm`` forces them), and under CUDA graph replays twice in a row: the counters are back at 0 after
    every launch, so each replay gives the eager output again."""
    import kernels
    from kernels import testing
    from kernels.decode import dispatch
    from kernels.decode.gluon.text_merge import merge_group
    from kernels.decode.plan import plan_items
    from kernels.reference import decode_reference

    B, H, G, T, lens, kbits, vbits, D, pps, dense = case
    g = torch.Generator().manual_seed(T + G)
    seg = testing.kivi_seg(B, H, T, D, lens, kbits, vbits, 32, 32, g=g, device="cuda",
                           order="tiles" if D == 128 else "natural")  # as plan.kivi_value_order packs them
    segs = [seg]
    if dense:
        dn = testing.dense_seg(B, H, 100, D, lens=[min(100, n + 3) for n in lens], g=g, device="cuda")
        segs = [seg, dn] if dense == "after" else [dn, seg]
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    items, S, fin = plan_items(q, segs, B, H, G, D, 132, None, 2, pps is None, pps, None, 64)
    text = items[-1]
    assert fin is None and text["tgl"] and text.get("tfin"), "the text kernel should go last and merge"
    if pps is not None:
        assert merge_group(text["nsplit"], G, text["tw"]) < text["nsplit"], "meant to take two levels"
    ref, ref_lse = decode_reference(q, segs)
    live = torch.tensor(lens, device="cuda") > 0
    kw = dict(return_lse=True, programs_per_sm=pps)
    out = torch.full_like(q, float("nan"))
    got, lse = kernels.decode_attention(q, segs, out=out, **kw)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
    err = (got.float() - ref.float())[live].norm() / ref.float()[live].norm()
    assert err < 1e-3, err.item()
    assert torch.allclose(lse[live], ref_lse.float()[live], atol=2e-3, rtol=1e-4)
    assert (got[~live] == 0).all() and torch.isinf(lse[~live]).all()
    assert not any(buf.any() for buf in dispatch._FIN.values()), "every counter back at 0"

    monkeypatch.setenv("MMKV_TEXT_FIN", "0")
    two, two_lse = kernels.decode_attention(q, segs, **kw)
    assert torch.allclose(two.float(), got.float(), atol=2e-3, rtol=1e-3)
    assert torch.allclose(two_lse[live], lse[live], atol=1e-4, rtol=1e-5)
    monkeypatch.delenv("MMKV_TEXT_FIN")

    gout = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream: its counter buffer exists before the capture
        kernels.decode_attention(q, segs, out=gout, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kernels.decode_attention(q, segs, out=gout, **kw)
    for _ in range(2):
        gout.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gout, got), "a replay must give the eager output (counters reset by the last program)"
    assert not any(buf.any() for buf in dispatch._FIN.values())


def test_text_merge_groups():
    """The merge's shape rule: partials per round (32 query rows of output, at least one per warp) and one level up
    to two rounds of them, else groups of one round (``text_merge.py``); the counters a grid needs."""
    from kernels.decode.gluon.text import text_counters
    from kernels.decode.gluon.text_merge import merge_group, merge_width
    assert merge_width(4, 2) == 8 and merge_width(3, 4) == 8 and merge_width(8, 2) == 4 and merge_width(1, 2) == 32
    assert merge_width(8, 8) == 8  # one partial per warp at least
    assert merge_group(16, 4, 2) == 16 and merge_group(17, 4, 2) == 8
    assert text_counters(16, 8, 1, 4, 2) == 8 * 2  # one level: the pair's counter (and an unused group's)
    assert text_counters(74, 8, 1, 4, 2) == 8 * (1 + 10)  # 10 groups of 8 (the last of 2)
    assert text_counters(6, 8, 16, 4, 4) == 128 * 2
