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
from gluon_reports import compiled_reports, loop_count  # noqa: E402

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

# natural order at head_dim 64 with value scale/zero as vectors (``plan.text_svec``): (K bits, V bits, V group)
SVEC_CASES = [(2, 2, 32), (2, 1, 32), (2, 2, 16), (1, 2, 64)]

# the key ring (``text_ring.py``), 3 stages with the key scale/zero rows: (head_dim, K bits, V bits, post-scaled).
# 1-bit keys at head_dim 128 are compiled without the plan's cap of 168 registers: under it the ring spills (stack 88
# bytes with the key codes alone, 144 with the scale/zero rows: docs/BENCHMARKS.md), so the plan never combines them
RING_CASES = [(128, 2, 2, True), (128, 1, 1, True), (64, 2, 2, False)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every case compiled in one fresh interpreter (no TRITON_INTERPRET; Gluon cannot be interpreted)."""
    calls = [f"text_report(tmp, D={d}, bits={k}, vbits={v}, kblk={b}, group={g}, post={p})"
             for d, k, v, b, g, p in SASS_CASES]
    calls += [f"text_report(tmp, D=128, bits=1, vbits={v}, kblk={b}, group={g}, post=True, qsm=True, maxnreg=168)"
              for v, b, g in CAPPED_CASES]
    calls += [f"text_report(tmp, D=64, bits={k}, vbits={v}, kblk=32, group={g}, post=False, svec=True)"
              for k, v, g in SVEC_CASES]
    calls += [f"text_report(tmp, D={d}, bits={k}, vbits={v}, kblk=32, group=32, post={p}, ring=3, ksr=True)"
              for d, k, v, p in RING_CASES]
    out = compiled_reports(tmp_path_factory.mktemp("text_sass"), f"[{', '.join(calls)}]", timeout=900)
    return dict(zip(SASS_CASES + [("capped",) + c for c in CAPPED_CASES] + [("svec",) + c for c in SVEC_CASES]
                    + [("ring",) + c for c in RING_CASES], out, strict=True))


@pytest.mark.parametrize("case", SASS_CASES, ids=[f"D{d}-k{k}v{v}-blk{b}-g{g}-{'post' if p else 'pre'}"
                                                  for d, k, v, b, g, p in SASS_CASES])
def test_text_kernel_hot_loop_counts(reports, case):
    D, kbits, vbits, kblk, group, post = case
    r = reports[case]
    tokens = 8 * (8 // kbits)  # one warp's 8 byte rows of key codes
    steps, ktiles = tokens // 16, D // 16
    blocks = max(1, tokens // kblk)  # key scale blocks in them: a K-side MMA and a zero-term MMA per block
    assert r["local"] == 0, r
    assert r["loops"] == 2, r  # full iterations' unmasked body, then the masked one
    v_mma = steps * ktiles + (steps if post else 0)  # post-scaled: one more MMA per step, p^T times the zeros
    assert r["HMMA"] == r["masked"]["HMMA"] == steps * ktiles * blocks + blocks * ktiles + v_mma, r
    # unmasked: no zero fill before a load (CS2R), no select of -inf into the logits (FSEL), fewer predicates
    assert r.get("CS2R", 0) == 0 < r["masked"]["CS2R"] and r.get("FSEL", 0) == 0 < r["masked"]["FSEL"], r
    # (unmasked loads may merge into wider ones)
    assert r.get("ISETP", 0) < r["masked"]["ISETP"] and r["LDG"] <= r["masked"]["LDG"], r
    assert sum(r["masked"].values()) * 0.93 > loop_count(r), r
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
    steps, ktiles, blocks = 4, 8, 64 // case[1]
    for loop in (r, r["masked"]):  # the unmasked body of full iterations and the masked one
        assert loop.get("LDS", 0) == 4 and loop.get("STS", 0) == 0 and loop.get("BAR", 0) == 0, r
        assert loop["HMMA"] == steps * ktiles * blocks + blocks * ktiles + steps * ktiles + steps, r


@pytest.mark.parametrize("case", SVEC_CASES, ids=[f"k{k}v{v}-g{g}" for k, v, g in SVEC_CASES])
def test_text_kernel_svec_loads(reports, case):
    """Value scale/zero as vectors (natural order, head_dim 64): per warp iteration each lane loads its tokens'
    constants of every group as one to four 16-byte vectors per tensor instead of one 2-byte load per token and
    tensor; the other loads (key codes: one vector; key scale and zero: two vectors each per key block; value
    words: one per token) and the MMAs are those of the per-token variant."""
    k, v, g = case
    r = reports[("svec",) + case]
    tokens = 8 * (8 // k)
    tpl, blocks, ng = tokens // 4, max(1, tokens // 32), 64 // g
    steps, ktiles = tokens // 16, 4
    for loop in (r, r["masked"]):  # the unmasked body of full iterations and the masked one
        assert loop["LDG"] == 1 + 4 * blocks + tpl + 2 * max(1, tpl * ng * 2 // 16), r
        assert loop["HMMA"] == steps * ktiles * blocks + blocks * ktiles + steps * ktiles, r
    assert r["loops"] == 2, r


@pytest.mark.parametrize("case", RING_CASES, ids=[f"D{d}-k{k}v{v}-{'post' if p else 'pre'}" for d, k, v, p in RING_CASES])
def test_text_kernel_ring_copies(reports, case):
    """With the ring the hot loop copies instead of loading the key side: per lane D/64 16-byte ``cp.async`` of key
    code words and, per key block, one each of the scale and zero rows (a warp's row: D/8 lanes' chunks); it reads them back from
    shared memory and waits once (``DEPBAR``); no spills, the MMAs unchanged, and with 2-bit keys 3 programs of 4
    warps still fit an SM's registers."""
    D, k, v, post = case
    r = reports[("ring",) + case]
    blocks = max(1, 8 * (8 // k) // 32)
    assert r["LDGSTS"] == D // 64 + 2 * blocks, r
    assert r.get("DEPBAR", 0) == 1 and r["local"] == 0 and r.get("stack", 0) == 0 and r.get("LDL", 0) == 0, r
    steps, ktiles = 8 * (8 // k) // 16, D // 16
    assert r["HMMA"] == steps * ktiles * blocks + blocks * ktiles + steps * ktiles + (steps if post else 0), r
    assert k == 1 or 3 * 128 * r["reg"] <= 65536, r


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
@pytest.mark.parametrize("order", ["tiles", "tiles+prefetch", "tiles+regs", "natural", "natural+svec", "tiles+ring",
                                   "natural+ring"])
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_gpu_text_kernel_matches_reference(case, order, monkeypatch):
    """``"tiles"``: the post-scaled variant, wherever groups are multiples of 16 (the methods pack so on CUDA at
    head_dim 128, ``plan.kivi_value_order``); ``"natural"``: the pre-scaled variant on the other shapes and on half
    of these. These shapes are below the work where the plan turns on the L2 prefetch (``plan.text_prefetch``), so
    ``"tiles+prefetch"`` forces it one iteration ahead and ``"natural"`` two (sm_90; elsewhere the plan keeps 0).
    ``"tiles+regs"``: q read back from shared memory under a register cap (``plan.text_regs``): 168 with 1-bit keys
    as the plan launches them from larger work (prefetch off), else 128 with the prefetch on (2-bit keys spill).
    ``"natural+svec"``: natural order with value scale/zero as vectors (``plan.text_svec``) forced on every shape
    that allows it (head_dim 128 included), and ``"natural"`` with it forced off. ``"tiles+ring"``: the key codes
    and key scale/zero through a 3-stage ``cp.async`` ring (``plan.text_ring``, ``text_ring.py``), with the
    register cap of ``"tiles+regs"`` on 1-bit keys (it spills there: the numbers must hold all the same);
    ``"natural+ring"``: the key codes alone through a 2-stage ring."""
    if order == "tiles+ring":
        monkeypatch.setenv("MMKV_TEXT_RING", "3s")
        if case[7] == 1:
            monkeypatch.setenv("MMKV_TEXT_REGS", "168")
        order = "tiles"
    elif order == "natural+ring":
        monkeypatch.setenv("MMKV_TEXT_RING", "2")
        order = "natural+svec" if case[9] == 64 else "natural"
    switch_off = order == "natural"
    if order == "natural+svec":
        monkeypatch.setenv("MMKV_TEXT_SVEC", "1")
        order = "natural"
    elif order == "natural":
        monkeypatch.setenv("MMKV_TEXT_SVEC", "0")
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
    elif order == "natural" and case not in NATURAL and switch_off:
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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("order", ["tiles", "natural"])
@pytest.mark.parametrize("kbits,vbits,D", [(2, 2, 128), (2, 1, 128), (1, 1, 128), (2, 2, 64), (1, 2, 64)])
def test_gpu_text_unmasked_body_is_bit_equal(order, kbits, vbits, D, monkeypatch):
    """The full iterations' unmasked body (``MMKV_TEXT_FULL=1``, default) gives the bits of the masked body alone
    (``0``), with a row whose length ends exactly at an iteration (4 warps x 32 or 64 tokens), one just past and
    one just short of it, one of a single token and an empty one, so every split takes 0, some or all of its
    iterations unmasked."""
    from switch_outputs import bit_equal_by_switch

    from kernels import testing
    from kernels.decode.plan import _GLUON_BROKEN, plan_items

    per_it = 4 * 8 * (8 // kbits)
    lens = [8 * per_it, 8 * per_it + 1, 8 * per_it - 1, 1, 0]
    g = torch.Generator().manual_seed(kbits * 10 + vbits + D)
    seg = testing.kivi_seg(5, 2, 8 * per_it + 16, D, lens, kbits, vbits, 32, 32, g=g, device="cuda", order=order)
    q = torch.randn(5, 8, D, generator=g).to("cuda", torch.float16)
    assert plan_items(q, [seg], 5, 2, 4, D, 132, None, 2, True, None, None, 64)[0][0]["tgl"]
    outs = bit_equal_by_switch(q, [seg], monkeypatch, "MMKV_TEXT_FULL", "MMKV_TEXT_TPS")
    assert not _GLUON_BROKEN, _GLUON_BROKEN  # the Gluon kernel ran: the comparison is not the Triton kernel's twice
    ref = outs[None, "0"][0][:4].float()
    assert not torch.isnan(outs["3", "1"][0]).any() and (outs["3", "1"][0][:4].float() - ref).norm() / ref.norm() < 1e-3


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


def test_text_unmasked_rule(monkeypatch):
    """``MMKV_TEXT_FULL``: unset or 1 the unmasked body for full iterations, 0 every iteration masked; anything else
    is refused by name when the plan reads it (not inside the launch, whose failure would switch the Gluon kernel
    off for the process)."""
    from kernels.decode.text_rules import text_unmasked

    monkeypatch.delenv("MMKV_TEXT_FULL", raising=False)
    assert text_unmasked() is True
    monkeypatch.setenv("MMKV_TEXT_FULL", "0")
    assert text_unmasked() is False
    for bad in ("2", "", "yes"):
        monkeypatch.setenv("MMKV_TEXT_FULL", bad)
        with pytest.raises(ValueError, match="MMKV_TEXT_FULL"):
            text_unmasked()


def test_text_warps_rule(monkeypatch):
    """2 warps per program for a few long rows (up to 32 (row, KV head) pairs, 48 at head_dim 64, from 16k tokens),
    else 4; the switch overrides and rejects other counts."""
    from kernels.decode.plan import text_warps
    monkeypatch.delenv("MMKV_TEXT_WARPS", raising=False)
    assert text_warps(1, 8, 32768) == 2
    assert text_warps(4, 8, 32768) == 2  # 32 pairs
    assert text_warps(6, 8, 32768) == 4  # 48 pairs at head_dim 128
    assert text_warps(16, 3, 32768, 64) == 2  # SmolLM2 heads: 48 pairs at head_dim 64
    assert text_warps(32, 3, 32768, 64) == 4
    assert text_warps(1, 8, 4096) == 4  # short rows
    monkeypatch.setenv("MMKV_TEXT_WARPS", "8")
    assert text_warps(1, 8, 32768) == 8
    monkeypatch.setenv("MMKV_TEXT_WARPS", "3")
    with pytest.raises(ValueError, match="MMKV_TEXT_WARPS"):
        text_warps(1, 8, 32768)


def test_text_svec_rule(monkeypatch):
    """Natural-order value scale/zero as vectors (``plan.text_svec``): off by default (mixed on the H100); with the
    switch on, where the layout allows (natural order, up to 4 value groups, capacity a multiple of 16 tokens); the
    switch rejects other values."""
    from types import SimpleNamespace

    from kernels.decode.plan import text_svec
    nat = SimpleNamespace(v_order="natural", group=32)
    monkeypatch.delenv("MMKV_TEXT_SVEC", raising=False)
    assert not text_svec(nat, 32768, 64)
    monkeypatch.setenv("MMKV_TEXT_SVEC", "1")
    assert text_svec(nat, 32768, 64) and text_svec(nat, 32768, 128)
    assert not text_svec(nat, 32776, 64)  # a lane's chunk would straddle the capacity
    assert not text_svec(SimpleNamespace(v_order="natural", group=8), 32768, 64)  # 8 groups
    assert not text_svec(SimpleNamespace(v_order="tiles", group=32), 32768, 64)
    monkeypatch.setenv("MMKV_TEXT_SVEC", "0")
    assert not text_svec(nat, 32768, 64)
    monkeypatch.setenv("MMKV_TEXT_SVEC", "2")
    with pytest.raises(ValueError, match="MMKV_TEXT_SVEC"):
        text_svec(nat, 32768, 64)


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


def test_text_ring_rule(monkeypatch):
    """``MMKV_TEXT_RING``: stages 2-6 of the key-code ring, ``s`` for the key scale/zero too; unset, 3 stages of key
    codes only for 2-bit keys at head_dim 64 over up to 8 long (row, KV head) pairs; none below sm_80."""
    from kernels.decode import plan

    monkeypatch.setattr(plan, "_capability", lambda dev: (9, 0))
    monkeypatch.delenv("MMKV_TEXT_RING", raising=False)
    assert plan.text_ring("cuda", 16, 8, 32768, 128) == (0, False)
    assert plan.text_ring("cuda", 1, 3, 32768, 64) == (3, False)  # SmolLM2 heads, batch 1
    assert plan.text_ring("cuda", 1, 3, 32768, 64, 1) == (0, False)  # 1-bit keys
    assert plan.text_ring("cuda", 16, 3, 32768, 64) == (0, False)
    assert plan.text_ring("cuda", 1, 3, 4096, 64) == (0, False)
    assert plan.text_ring("cuda", 1, 8, 32768, 128) == (0, False)
    monkeypatch.setenv("MMKV_TEXT_RING", "3")
    assert plan.text_ring("cuda", 16, 8, 32768, 128) == (3, False)
    monkeypatch.setenv("MMKV_TEXT_RING", "4s")
    assert plan.text_ring("cuda", 16, 8, 32768, 128) == (4, True)
    for bad in ("1", "7", "0s", "s", "x"):
        monkeypatch.setenv("MMKV_TEXT_RING", bad)
        with pytest.raises(ValueError):
            plan.text_ring("cuda", 1, 1, 4096, 64)
    monkeypatch.setenv("MMKV_TEXT_RING", "3s")
    monkeypatch.setattr(plan, "_capability", lambda dev: (7, 5))
    assert plan.text_ring("cuda", 16, 8, 32768, 128) == (0, False)


def test_text_prefetch_rule(monkeypatch):
    """L2 prefetch one iteration ahead only on sm_90+, at head_dim 128, from a million batch x KV heads x tokens or at
    up to 8 (row, KV head) pairs of 16k+ tokens (``plan.text_prefetch``'s measurements); the switch overrides and
    rejects other values."""
    from kernels.decode import plan
    monkeypatch.setattr(plan, "_capability", lambda dev: (9, 0))
    assert plan.text_prefetch("cuda", 16, 8, 32768, 128) == 1
    assert plan.text_prefetch("cuda", 64, 8, 4096, 128) == 1
    assert plan.text_prefetch("cuda", 1, 8, 32768, 128) == 1  # a few long rows: cold in L2 inside a decode step
    assert plan.text_prefetch("cuda", 1, 8, 8192, 128) == 0  # 64k: programs of a few iterations
    assert plan.text_prefetch("cuda", 1, 8, 32768, 128, capped=True) == 0
    assert plan.text_prefetch("cuda", 16, 3, 32768, 64) == 0  # head_dim 64 measured slower
    monkeypatch.setenv("MMKV_TEXT_PREFETCH", "2")
    assert plan.text_prefetch("cuda", 1, 1, 64, 64) == 2
    monkeypatch.setenv("MMKV_TEXT_PREFETCH", "5")
    with pytest.raises(ValueError, match="MMKV_TEXT_PREFETCH"):
        plan.text_prefetch("cuda", 16, 8, 32768, 128)
    monkeypatch.setattr(plan, "_capability", lambda dev: (8, 0))
    assert plan.text_prefetch("cuda", 16, 8, 32768, 128) == 0  # the bulk prefetch is sm_90's


MERGE_CASES = [  # B, H, G, KIVI tokens, dense tokens, lens, head_dim, programs per SM (None: the plan's)
    (2, 2, 4, 777, 64, [777, 300], 128, None),  # a few splits per row: one round of 8
    (1, 2, 3, 20000, 100, [19999], 64, 64.0),  # ~40 splits: one round of 64, channels in chunks of 64
    (2, 1, 4, 3000, 5000, [2999, 4000], 128, 1000.0),  # ~180 splits: two rounds of 128, chunks of 32
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", MERGE_CASES, ids=[f"B{c[0]}H{c[1]}G{c[2]}T{c[3]}+{c[4]}D{c[6]}" for c in MERGE_CASES])
def test_gpu_merge_rounds(case, monkeypatch):
    """The merge launch after the text kernel (and a dense segment's kernel) at split counts of one round, one wide
    round over channel chunks and several rounds (``states.merge_shape``; ``programs_per_sm`` forces the splits):
    against the torch reference (output pre-filled with NaN, lse) and the merge before (``MMKV_MERGE_WIDE=0``)."""
    import kernels
    from kernels import testing
    from kernels.decode.plan import plan_items
    from kernels.decode.states import merge_shape
    from kernels.reference import decode_reference

    B, H, G, T, Td, lens, D, pps = case
    g = torch.Generator().manual_seed(T + G)
    seg = testing.kivi_seg(B, H, T, D, lens, 2, 2, 32, 32, g=g, device="cuda",
                           order="tiles" if D == 128 else "natural")
    dn = testing.dense_seg(B, H, Td, D, lens=[min(Td, n) for n in lens], g=g, device="cuda")
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    _, S, _ = plan_items(q, [seg, dn], B, H, G, D, 132, None, 2, pps is None, pps, None, 64)
    bs, dc = merge_shape(S, D)
    assert (S <= 16, 16 < S <= 128, S > 128)[MERGE_CASES.index(case)], S
    assert bs * dc <= 4096 and D % dc == 0 and (bs >= S or bs == 128), (S, bs, dc)
    ref, ref_lse = decode_reference(q, [seg, dn])
    out = torch.full_like(q, float("nan"))
    got, lse = kernels.decode_attention(q, [seg, dn], out=out, return_lse=True, programs_per_sm=pps)
    assert not torch.isnan(got).any()
    assert ((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-3
    assert torch.allclose(lse, ref_lse.float(), atol=2e-3, rtol=1e-4)
    monkeypatch.setenv("MMKV_MERGE_WIDE", "0")
    old, old_lse = kernels.decode_attention(q, [seg, dn], return_lse=True, programs_per_sm=pps)
    assert torch.allclose(old.float(), got.float(), atol=1e-3, rtol=1e-3)
    assert torch.allclose(old_lse, lse, atol=1e-5, rtol=1e-6)


def test_merge_shape_rule():
    """Every partial in one round up to 128, the channels cut so that a round holds 4096 values (chunks of 16 at
    least); ``wide=False`` is the merge before: 16 a round over all channels."""
    from kernels.decode.states import merge_shape
    assert merge_shape(1, 128) == (1, 128) and merge_shape(6, 128) == (8, 128) and merge_shape(32, 128) == (32, 128)
    assert merge_shape(33, 128) == (64, 64) and merge_shape(74, 128) == (128, 32) and merge_shape(74, 64) == (128, 32)
    assert merge_shape(1000, 64) == (128, 32) and merge_shape(300, 16) == (128, 16)
    assert merge_shape(74, 128, wide=False) == (16, 128)


def test_text_waves_rule(monkeypatch):
    """Whole waves from 32 (row, KV head) pairs once the variant's programs per SM are known (``text_waves``):
    one where that wave's splits use 85% of it and a row holds under ``waves.LONG_ROW`` elements (tokens x
    head_dim), else the fewest from three whose splits use 85% of the waves they start; the switch overrides (0: the
    byte rule) and rejects other values."""
    from kernels.decode.gluon import text_slots as ts
    assert ts.text_waves(16, 8, 3, 132) == 1  # 128 pairs, 396 slots: 3 splits, 97%
    assert ts.text_waves(16, 3, 4, 132, D=64) == 1  # 48 pairs of 528: 11 splits, 100%
    assert ts.text_waves(48, 8, 3, 132) == 1  # 384 pairs: one program each in one wave, 97%
    assert ts.text_waves(64, 8, 3, 132) == 3  # 512 pairs: 2 splits, 2.59 of 3 waves
    assert ts.text_waves(60, 8, 3, 132) == 4  # 480 pairs: 3 waves' 2 splits use 2.42 of 3; 4 waves' 3 use 3.64
    assert ts.text_waves(50, 8, 3, 132) == 7  # 400 pairs: 6 splits, 6.06 of 7 waves
    assert ts.text_waves(200, 3, 4, 132, D=64) == 4  # 600 pairs of 528 slots
    assert ts.text_waves(4, 8, 6, 132) == 1  # 32 pairs: the threshold itself; 24 splits, 97%
    # one wave only where it is nearly full: 240 pairs fill 61% of one wave, 320 pairs 81%
    assert ts.text_waves(30, 8, 3, 132) == 4 and ts.text_waves(40, 8, 3, 132, tokens=32768) == 5
    assert ts.text_waves(64, 3, 4, 132, tokens=4096, D=64) == 3  # SmolLM2 heads B64 n4096: 192 pairs fill 73%
    # and only for rows under LONG_ROW elements (the decode step's measurement, waves.py's table)
    assert ts.text_waves(16, 8, 3, 132, tokens=4096) == 1  # 3 splits of 1365 tokens
    assert ts.text_waves(16, 8, 3, 132, tokens=8191) == 1 and ts.text_waves(16, 8, 3, 132, tokens=8192) == 3
    assert ts.text_waves(16, 8, 3, 132, tokens=32768) == 3 and ts.text_waves(8, 8, 3, 132, tokens=32768) == 3
    assert ts.text_waves(16, 3, 4, 132, tokens=8192, D=64) == 1  # SmolLM2 heads: a row of 2^19 elements
    assert ts.text_waves(16, 3, 8, 132, tokens=16384, D=64) == 3  # 2^20: not 22 splits of 745 tokens
    assert ts.text_waves(4, 8, 3, 132, tokens=32768) == 3  # 32 pairs: not 12 splits of 2731 tokens
    assert ts.text_waves(1, 8, 6, 132) == 0  # batch 1: the byte rule
    assert ts.text_waves(16, 8, None, 132) == 0  # not compiled yet
    monkeypatch.setenv("MMKV_TEXT_WAVES", "2")
    assert ts.text_waves(1, 1, 4, 132) == 2 and ts.text_waves(1, 1, None, 132) == 0
    monkeypatch.setenv("MMKV_TEXT_WAVES", "0")
    assert ts.text_waves(16, 8, 3, 132) == 0
    monkeypatch.setenv("MMKV_TEXT_WAVES", "9")
    with pytest.raises(ValueError, match="MMKV_TEXT_WAVES"):
        ts.text_waves(16, 8, 3, 132)


@pytest.mark.parametrize("D,T,splits", [(64, 12288, 11), (128, 12288, 33), (64, 16384, 33), (128, 4096, 11)])
def test_wave_tiles_weigh_rows_by_their_head_dim(D, T, splits, monkeypatch):
    """``text_slots.wave_tiles`` hands the segment's head_dim to the rule: 48 (row, KV head) pairs at 4 programs per
    SM of 132 (528 slots) take one wave (11 splits) for rows under 2^20 elements and three (33) from there, so 12288
    tokens are one wave at head_dim 64 and three at 128."""
    from kernels import testing
    from kernels.decode.gluon import text_slots as ts

    monkeypatch.delenv("MMKV_TEXT_WAVES", raising=False)
    monkeypatch.setattr(ts, "text_resident", lambda key: 4)
    seg = testing.kivi_seg(1, 3, 32, D, [32], 2, 2, 32, 32)
    tiles = T // 64
    it = {"seg": seg, "tw": 4, "pfd": 0, "regs": (False, 0), "T": T, "tiles": tiles}
    assert ts.wave_tiles(it, 0, 16, 3, D, 132) == -(-tiles // splits)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("D,G,kbits", [(128, 4, 2), (64, 3, 2), (128, 4, 1)])
def test_gpu_text_whole_waves(D, G, kbits, monkeypatch):
    """Once the variant ran, its splits fill whole waves of the programs an SM holds (``text_slots.text_waves``; no more
    programs than the waves hold), the tiles spread evenly over them, and the result still
    matches the torch reference; the byte rule (``MMKV_TEXT_WAVES=0``) gives the same output within rounding."""
    import kernels
    from kernels import testing
    from kernels.decode.gluon.text_slots import text_resident, text_slot_key, text_waves
    from kernels.decode.plan import _num_sms, plan_items
    from kernels.reference import decode_reference

    B, H, T = 4, 8, 32768  # 32 (row, KV head) pairs
    g = torch.Generator().manual_seed(D + kbits)
    seg = testing.kivi_seg(B, H, T, D, [T, T - 5, 20001, 7], kbits, kbits, 32, 32, g=g, device="cuda",
                           order="tiles" if D == 128 else "natural")
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    first = kernels.decode_attention(q, [seg])  # compiles the variant: its programs per SM become known
    nsm = _num_sms(q.device)
    items, _, _ = plan_items(q, [seg], B, H, G, D, nsm, None, 2, True, None, None, 64)
    it = items[0]
    assert it["tgl"], "the Gluon text kernel should read this segment"
    per_sm = text_resident(text_slot_key(q.device.index, D, kbits, kbits, it["tw"], D == 128, it["pfd"], it["regs"]))
    assert per_sm, "the launch records its programs per SM"
    waves = text_waves(B, H, per_sm, nsm, tokens=T, D=D)
    assert waves >= 1
    slots = waves * per_sm * nsm
    target = max(1, slots // (B * H))  # splits per (row, KV head) that fill the waves
    assert it["tps"] == -(-it["tiles"] // min(target, it["tiles"])) and it["nsplit"] * B * H <= slots
    assert (it["nsplit"] - 1) * it["tps"] < it["tiles"] <= it["nsplit"] * it["tps"]
    ref, _ = decode_reference(q, [seg])
    out = torch.full_like(q, float("nan"))
    got = kernels.decode_attention(q, [seg], out=out)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-3
    monkeypatch.setenv("MMKV_TEXT_WAVES", "0")
    assert torch.allclose(kernels.decode_attention(q, [seg]).float(), got.float(), atol=2e-3, rtol=1e-3)
    assert torch.allclose(first.float(), got.float(), atol=2e-3, rtol=1e-3)
