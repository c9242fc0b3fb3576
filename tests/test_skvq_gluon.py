"""The Gluon SKVQ decode kernel (``kernels/decode/gluon/skvq.py``).

On CPU (CI): it compiles for the H100 (sm_90) and its hot loop issues what the design says per warp iteration
(``NS`` = 2 steps of 16 tokens): one fp16 MMA per step, group and 16 channels on each side, one ``lop3`` per two
codes and plane, no shared memory, no barrier, no local memory. Gluon cannot run under the Triton interpreter, so
its numbers are tested on the GPU (``-m gpu``) against the torch reference (``kernels.reference``, which
dequantizes the segment in fp32 and runs softmax attention), never against the Triton kernel: odd and ragged
lengths (one row empty), GQA groups 1-8, head_dim 64 and 128, 1- and 2-bit keys, 1-, 1.5- (ternary: token
counts not multiples of 5) and 2-bit values, fixed and variable
groups, permuted and natural channel order, fp16 and FP8 scales, outputs pre-filled with NaN. Threshold: relative
L2 error < 2e-3 (q, p * s and the codes are fp16 MMA operands with fp32 accumulation, as in the Triton kernel's test).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from gluon_reports import compiled_reports  # noqa: E402
from reference_match import assert_matches_reference  # noqa: E402

CUDA = torch.cuda.is_available()

# head_dim, K bits, V bits, groups, G
SASS_CASES = [(128, 2, 2, 2, 4), (128, 1, 1, 1, 8), (64, 2, 1, 4, 3), (64, 1, 2, 2, 1), (128, 2, 1.5, 2, 4),
              (64, 2, 1.5, 2, 3)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every case compiled in one fresh interpreter (no TRITON_INTERPRET; Gluon cannot be interpreted)."""
    calls = [f"skvq_report(tmp, D={d}, kbits={k}, vbits={v}, ng={n}, G={g})" for d, k, v, n, g in SASS_CASES]
    out = compiled_reports(tmp_path_factory.mktemp("skvq_sass"), f"[{', '.join(calls)}]", timeout=900)
    return dict(zip(SASS_CASES, out, strict=True))


@pytest.mark.parametrize("case", SASS_CASES, ids=[f"D{c[0]}-k{c[1]}v{c[2]}-ng{c[3]}-G{c[4]}" for c in SASS_CASES])
def test_skvq_kernel_hot_loop_counts(reports, case):
    from kernels.decode.gluon.skvq_ok import columns

    D, kbits, vbits, ng, G = case
    steps = 2  # NS: 16-token steps per warp iteration
    assert reports[case]["local"] == 0, reports[case]
    assert reports[case]["loops"] == 2, reports[case]  # the unmasked copy for full iterations, then the masked loop
    for r in (reports[case], reports[case]["masked"]):
        # K side and V side: per step one MMA per 16 channels and 8 (group, head) columns
        assert r["HMMA"] == 2 * steps * (D // 16) * (columns(G, ng) // 8), r
        # one lop3 per two codes and plane: a lane holds 16 * D / 32 codes of each side per step (ternary values
        # take fma.f16x2 instead, counted below: the keys' lop3 alone)
        sides = 1 if vbits == 1.5 else 2
        assert r.get("LOP3", 0) >= steps * sides * (16 * D // 32) // 2, r
        for op in ("BAR", "STS", "LDS", "STL", "LDL"):
            assert r.get(op, 0) == 0, (op, r)
        if vbits == 1.5:  # four fma.f16x2 per whole byte and two tokens: 3 bytes a lane row at D=128, 1 at D=64
            assert r.get("HFMA2", 0) == steps * 2 * 4 * (3 if D == 128 else 1), r


# head_dim, K bits, V bits, groups, G, ternary lane loads: the variants decode_attention launches (register cap
# skvq_regs), with and without the unmasked copy of the loop
FULL_CASES = [(128, 2, 2, 2, 4, False), (128, 2, 1.5, 2, 4, True), (64, 2, 1, 4, 3, False), (64, 1, 2, 2, 1, False),
              (128, 2, 2, 2, 8, False)]  # the last: 16 MMA columns, uncapped


@pytest.fixture(scope="module")
def full_reports(tmp_path_factory):
    from kernels.decode.gluon.skvq_ok import columns, skvq_regs

    calls = [f"skvq_report(tmp, D={d}, kbits={k}, vbits={v}, ng={n}, G={g}, tlane={t}, unmasked={u}, "
             f"maxnreg={skvq_regs(v, u, d, columns(g, n))})" for d, k, v, n, g, t in FULL_CASES for u in (True, False)]
    out = compiled_reports(tmp_path_factory.mktemp("skvq_full"), f"[{', '.join(calls)}]", timeout=900)
    return {(c, u): out[2 * i + (not u)] for i, c in enumerate(FULL_CASES) for u in (True, False)}


def _per_sm(regs: int) -> int:
    """Programs of 4 warps an SM holds by registers: a warp's come from one quarter of the register file (16384),
    in steps of 8 a thread."""
    return 16384 // (32 * (-(-regs // 8) * 8))


def _issued(loop: dict) -> int:
    return sum(n for op, n in loop.items() if op.isupper() and isinstance(n, int))


@pytest.mark.parametrize("case", FULL_CASES, ids=[f"D{c[0]}-k{c[1]}v{c[2]}-ng{c[3]}-G{c[4]}" for c in FULL_CASES])
def test_skvq_unmasked_loop(full_reports, case):
    """``MMKV_SKVQ_FULL`` (default 1): full iterations run a copy of the loop with no token masks (at most 2
    ``ISETP``, no ``FSEL`` select of -inf, against 10-18 and 8 in the masked loop), at least 10% fewer instructions
    than the masked-only build (sm_90: 634 / 726 K2V2 D128, 676 / 770 K2V1.5 D128 with lane loads, 818 / 1007 K2V2
    G=8, 2026-11-27), the same tensor-core work, as many programs per SM (registers by the launch's cap or uncapped)
    and spilling no more than the masked-only build plus one 8-byte reload."""
    full, masked = full_reports[(case, True)], full_reports[(case, False)]
    assert full["loops"] == 2 and masked["loops"] == 1, (full, masked)
    assert full.get("ISETP", 0) <= 2 and full.get("FSEL", 0) == 0, full
    assert masked.get("FSEL", 0) >= 8, masked
    assert _issued(full) <= 0.9 * _issued(masked), (_issued(full), _issued(masked))
    assert full["HMMA"] == masked["HMMA"] == full["masked"]["HMMA"]
    assert _per_sm(full["reg"]) >= _per_sm(masked["reg"]), (full["reg"], masked["reg"])
    assert full.get("STL", 0) <= masked.get("STL", 0) and full.get("LDL", 0) <= masked.get("LDL", 0) + 1, full


PDL_CASES = [(64, 2, 2, 2, 3), (128, 2, 1.5, 2, 4)]  # head_dim, K bits, V bits, groups, G


@pytest.fixture(scope="module")
def pdl_reports(tmp_path_factory):
    """The early-merge-launch variants (``MMKV_SKVQ_PDL``: 0, 1, 2) of two cases, compiled in one interpreter."""
    calls = [f"skvq_report(tmp, D={d}, kbits={k}, vbits={v}, ng={n}, G={g}, tlane={d == 128}, pdl={p})"
             for d, k, v, n, g in PDL_CASES for p in (0, 1, 2)]
    out = compiled_reports(tmp_path_factory.mktemp("skvq_pdl"), f"[{', '.join(calls)}]", timeout=900)
    return {(c, p): out[3 * i + p] for i, c in enumerate(PDL_CASES) for p in (0, 1, 2)}


@pytest.mark.parametrize("case", PDL_CASES, ids=[f"D{c[0]}-k{c[1]}v{c[2]}-ng{c[3]}-G{c[4]}" for c in PDL_CASES])
def test_skvq_pdl_trigger_placement(pdl_reports, case):
    """``pdl`` 1 triggers the merge launch once, past the hot loop, 2 before it, 0 never; the loop issues the same
    memory and tensor-core work in each (the trigger is one instruction outside it) and nothing spills."""
    base = pdl_reports[(case, 0)]
    assert base["trigger"] is None, base
    assert pdl_reports[(case, 1)]["trigger"] == "after", pdl_reports[(case, 1)]
    assert pdl_reports[(case, 2)]["trigger"] == "before", pdl_reports[(case, 2)]
    for p in (1, 2):
        r = pdl_reports[(case, p)]
        assert r["local"] == 0 and r["loops"] == 2 and r.get("PREEXIT", 0) == 0, r
        for op in ("HMMA", "LDG", "LOP3", "HADD2", "PRMT", "MUFU"):
            assert r.get(op, 0) == base.get(op, 0), (op, p, r, base)
        assert r["reg"] <= base["reg"] + 4, (r["reg"], base["reg"])


def test_ternary_quotient_chain_is_exact():
    """fma.f16x2(1024 + q, R, K) must round to 1024 + q // 3 for every q a byte holds (the kernel chains it four
    times from 1024 + x); emulated exactly: an fp16 x fp16 product plus an fp16 is exact in fp64, then one
    round-to-nearest-even into fp16, as the instruction does."""
    import numpy as np

    from kernels.decode.gluon.ternary import TERN_K, TERN_R

    r, k = (float(np.array([v], np.uint16).view(np.float16)[0]) for v in (TERN_R, TERN_K))
    q = np.arange(256, dtype=np.float64)
    t = ((1024 + q) * r + k).astype(np.float16).astype(np.float64)
    assert (t == 1024 + q // 3).all()
    x = np.arange(243)
    for _ in range(4):  # the chain itself: every quotient of every byte
        x = (((1024 + x) * r + k).astype(np.float16).astype(np.float64) - 1024).astype(np.int64)
    assert (x == np.arange(243) // 81).all()


def test_ternary_special_digit_multipliers():
    """A special slot's digit k is ((x * M_k) & 0xFFFF) * 3 >> 16; against base-3 digits (and pack_ternary's
    bytes) for every valid byte."""
    from kernels.decode.gluon.ternary import TERN_M
    from kernels.layouts import pack_ternary

    x = torch.arange(243, dtype=torch.int64)
    codes = torch.stack([(x // 3 ** k) % 3 for k in range(5)], -1)
    assert torch.equal(pack_ternary(codes)[:, 0].long(), x)
    for k, m in enumerate(TERN_M):
        assert torch.equal((((x * m) & 0xFFFF) * 3) >> 16, codes[:, k])


CASES = [  # B, H, G, capacity, lens, head_dim, K bits, V bits, groups, fixed, permuted, fp8
    (3, 2, 4, 777, [777, 500, 0], 128, 2, 2, 2, True, True, False),
    (2, 2, 4, 1000, [999, 33], 128, 2, 2, 2, False, True, False),
    (2, 3, 3, 577, [577, 290], 128, 2, 2, 1, True, False, False),
    (2, 1, 8, 4100, [4100, 3001], 128, 2, 2, 2, False, True, True),
    (2, 2, 1, 300, [257, 1], 128, 2, 1, 2, False, True, False),
    (1, 3, 7, 513, [513], 128, 1, 1, 1, True, True, False),
    (2, 2, 5, 401, [401, 64], 128, 1, 2, 2, False, False, True),
    (3, 3, 3, 777, [700, 65, 0], 64, 2, 2, 4, False, True, False),
    (2, 1, 8, 1000, [1000, 3], 64, 2, 1, 2, True, True, True),
    (2, 2, 2, 333, [333, 100], 64, 1, 1, 1, True, False, False),
    (2, 3, 3, 640, [640, 639], 64, 1, 2, 3, False, True, False),
    (2, 1, 6, 300, [300, 299], 64, 2, 2, 2, False, True, False),
    (2, 2, 8, 700, [700, 411], 128, 2, 2, 2, False, True, False),
    (2, 2, 4, 900, [900, 899], 128, 2, 1, 4, True, True, True),
    (1, 3, 2, 555, [555], 64, 2, 2, 8, False, True, False),
    # ternary values (token counts and lens not multiples of 5 or 16)
    (3, 2, 4, 777, [777, 501, 0], 128, 2, 1.5, 2, True, True, False),
    (2, 2, 4, 1003, [1001, 34], 128, 2, 1.5, 2, False, True, True),
    (2, 3, 1, 579, [579, 291], 128, 1, 1.5, 1, True, False, False),
    (2, 1, 8, 4101, [4101, 3002], 128, 2, 1.5, 2, False, True, False),
    (1, 3, 7, 513, [513], 128, 2, 1.5, 1, False, True, True),
    (2, 2, 2, 402, [402, 66], 128, 2, 1.5, 4, True, True, False),
    (3, 3, 3, 778, [701, 67, 0], 64, 2, 1.5, 4, False, True, False),
    (2, 1, 8, 1001, [1001, 3], 64, 2, 1.5, 2, True, True, True),
    (2, 2, 5, 641, [641, 638], 64, 1, 1.5, 2, False, False, False),
    (1, 3, 2, 556, [556], 64, 2, 1.5, 8, False, True, False),
    # ternary values at head_dim 128 with a capacity that is a multiple of 16: per-lane addresses (TLANE)
    (3, 2, 4, 784, [784, 501, 0], 128, 2, 1.5, 2, True, True, False),
    (2, 1, 8, 4096, [4093, 2050], 128, 2, 1.5, 2, False, True, True),
    (2, 3, 3, 640, [640, 17], 128, 1, 1.5, 1, False, False, False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}H{c[1]}G{c[2]}T{c[3]}D{c[5]}k{c[6]}v{c[7]}ng{c[8]}"
                                             f"{'fix' if c[9] else 'var'}{'-perm' if c[10] else ''}"
                                             f"{'-fp8' if c[11] else ''}" for c in CASES])
def test_gpu_skvq_kernel_matches_reference(case):
    from kernels import testing
    from kernels.decode.gluon.skvq import gluon_tile
    from kernels.decode.plan import plan_items, skvq_gluon_ok

    B, H, G, T, lens, D, kbits, vbits, ng, fixed, perm, fp8 = case
    g = torch.Generator().manual_seed(T + G + D)
    seg = testing.skvq_seg(B, H, T, D, lens, kbits, float(vbits), ng, fixed, perm, fp8, g=g, device="cuda")
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    items, _, _ = plan_items(q, [seg], B, H, G, D, 132, None, 2, True, None, None, 64)
    assert items[0]["tt"] == gluon_tile() and skvq_gluon_ok(seg, q.device, G, D), "the Gluon kernel should read it"
    assert_matches_reference(q, [seg], lens)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["pdl1", "pdl2", "split", "split+pdl1", "tps3+pdl2"])
@pytest.mark.parametrize("ci", [0, 3, 4, 7, 8, 15, 19, 22, 26])
def test_gpu_skvq_batch1_levers_match_reference(ci, mode, monkeypatch):
    """The batch-1 levers (``skvq_rules``: ``MMKV_SKVQ_PDL``, ``MMKV_SKVQ_SPLIT``, ``MMKV_SKVQ_TPS``) on shapes of
    ``CASES`` (2-bit and ternary values, D 64/128, G 1-8, FP8, ragged and empty rows), also at batch 1 (the first
    row alone, where the split rule applies): output and log-sum-exp match the reference, and the merge launch was
    a programmatic dependent exactly where the plan asked for it (sm_90)."""
    from kernels import testing
    from kernels.decode import dispatch
    from kernels.decode.plan import _pdl_ok

    env = {"pdl1": {"MMKV_SKVQ_PDL": "1"}, "pdl2": {"MMKV_SKVQ_PDL": "2"}, "split": {"MMKV_SKVQ_SPLIT": "1"},
           "split+pdl1": {"MMKV_SKVQ_SPLIT": "1", "MMKV_SKVQ_PDL": "1"},
           "tps3+pdl2": {"MMKV_SKVQ_TPS": "3", "MMKV_SKVQ_PDL": "2"}}[mode]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = []
    real = dispatch._launch_merge
    monkeypatch.setattr(dispatch, "_launch_merge", lambda *a: seen.append(a[-1]) or real(*a))
    B, H, G, T, lens, D, kbits, vbits, ng, fixed, perm, fp8 = CASES[ci]
    g = torch.Generator().manual_seed(T + G + D)
    for b, ls in ((B, lens), (1, lens[:1])):
        seg = testing.skvq_seg(b, H, T, D, ls, kbits, float(vbits), ng, fixed, perm, fp8, g=g, device="cuda")
        q = torch.randn(b, H * G, D, generator=g).to("cuda", torch.float16)
        assert_matches_reference(q, [seg], ls, label=b)
    from kernels.decode.skvq_rules import skvq_pdl  # with the switch unset: the rule's (early below 32 pairs)

    assert seen == [bool(skvq_pdl(b, H, T, D)) and _pdl_ok(q.device) for b in (B, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_skvq_switch_and_fallbacks(monkeypatch):
    """``MMKV_SKVQ_GLUON=0`` plans Triton tiles (ternary values too); more than 16 (group, head) columns (known only at
    launch, where G is) take the Triton kernel over the splits planned in Gluon tiles, and still match the
    reference."""
    import kernels
    from kernels import testing
    from kernels.decode.plan import plan_items, skvq_gluon_ok
    from kernels.decode.skvq import TILE
    from kernels.reference import decode_reference

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 12, 128, generator=g).to("cuda", torch.float16)  # 3 KV heads x 4 query heads
    plain = testing.skvq_seg(2, 3, 1000, 128, [1000, 777], 2, 2.0, 2, g=g, device="cuda")
    tern = testing.skvq_seg(2, 3, 100, 128, [100, 5], 2, 1.5, 2, g=g, device="cuda")
    wide = testing.skvq_seg(2, 3, 1000, 128, [1000, 777], 2, 2.0, 8, g=g, device="cuda")  # 4 heads x 8 groups

    def tile(seg):
        return plan_items(q, [seg], 2, 3, 4, 128, 132, None, 2, True, None, None, 64)[0][0]["tt"]

    assert tile(plain) != TILE and tile(tern) != TILE
    assert tile(wide) != TILE and not skvq_gluon_ok(wide, q.device, 4, 128)
    ref = decode_reference(q, [wide])[0]
    got = kernels.decode_attention(q, [wide])
    assert ((got.float() - ref.float()).norm() / ref.float().norm()) < 2e-3
    monkeypatch.setenv("MMKV_SKVQ_GLUON", "0")
    assert tile(plain) == TILE and tile(tern) == TILE


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_skvq_ternary_lane_loads_match_byte_loads(monkeypatch, fp8):
    """The per-lane ternary loads (``t_operand_lanes``) feed the MMA the same codes as the per-byte loads: the same
    output bit for bit, ragged rows (one empty), a capacity that is a multiple of 16 but not of the 128-token tile."""
    import kernels
    from kernels import testing
    from kernels.decode.gluon.skvq_ok import tern_lanes

    g = torch.Generator().manual_seed(11)
    seg = testing.skvq_seg(3, 2, 1040, 128, [1040, 333, 0], 2, 1.5, 2, fixed=False, perm=True, fp8=fp8, g=g,
                           device="cuda")
    q = torch.randn(3, 8, 128, generator=g).to("cuda", torch.float16)
    assert tern_lanes(128, 1040) and not tern_lanes(128, 1041) and not tern_lanes(64, 1040)
    lanes = kernels.decode_attention(q, [seg], out=torch.full_like(q, float("nan")))
    monkeypatch.setenv("MMKV_SKVQ_TERN_LOAD", "bytes")
    assert not tern_lanes(128, 1040)
    by_bytes = kernels.decode_attention(q, [seg], out=torch.full_like(q, float("nan")))
    assert not torch.isnan(lanes).any()
    assert torch.equal(lanes, by_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("D,kbits,vbits,ng,T", [(128, 2, 2, 2, 1040), (128, 2, 1.5, 2, 1040), (128, 2, 1.5, 2, 1041),
                                                (64, 2, 1, 4, 1040), (64, 1, 2, 2, 1040)])
def test_gpu_skvq_unmasked_body_is_bit_equal(D, kbits, vbits, ng, T, monkeypatch):
    """The unmasked copy of the loop (``MMKV_SKVQ_FULL=1``, default) gives the bits of the masked loop alone (``0``),
    with rows ending exactly at an iteration (128 tokens), one just past and one just short of it, a single token and
    an empty row, at the plan's splits and at 3 iterations a split; ternary values with and without the lane loads
    (capacity a multiple of 16 or not); close to the reference."""
    from switch_outputs import bit_equal_by_switch

    from kernels import testing
    from kernels.decode.gluon.skvq import gluon_tile
    from kernels.decode.plan import _GLUON_BROKEN, plan_items
    from kernels.reference import decode_reference

    lens = [1024, 1025, 1023, 1, 0]
    g = torch.Generator().manual_seed(T + D + kbits)
    seg = testing.skvq_seg(5, 2, T, D, lens, kbits, float(vbits), ng, g=g, device="cuda")
    q = testing.rand_q(5, 8, D, g=g, device="cuda")
    assert plan_items(q, [seg], 5, 2, 4, D, 132, None, 2, True, None, None, 64)[0][0]["tt"] == gluon_tile()
    outs = bit_equal_by_switch(q, [seg], monkeypatch, "MMKV_SKVQ_FULL", "MMKV_SKVQ_TPS")
    assert not _GLUON_BROKEN, _GLUON_BROKEN
    want = decode_reference(q, [seg])[0][:4]
    err = (outs["3", "1"][0][:4].float() - want).norm() / want.norm()
    assert err < 2e-3, float(err)
