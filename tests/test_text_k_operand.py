"""The Gluon text kernel's K side: code words with their middle bytes swapped (``MMKV_TEXT_KPAIR``,
``text_rules.text_kpair``, ``text.py``'s ``_pair_bytes`` and ``_b_relabel``) and, with 1-bit keys in 32-token
blocks and G <= 4, the second key block on the MMA's spare columns (``MMKV_TEXT_BCOL``, ``text_rules.text_bcol``,
``_cols_merged``).

On CPU (CI), compiled for sm_90: KPAIR keeps the MMAs and drops the ``prmt`` that paired channels p and p + 2 of q*s
and q*z (two per register pair, per key block), paying one per K code word instead; BCOL issues one K-side MMA a
step and one zero-term MMA an iteration fewer per 16 channels, and half the q*s / q*z products. On the GPU (``-m
gpu``): every combination matches the torch reference on odd, ragged shapes (1- and 2-bit keys, head_dim 64 and
128, GQA groups 1-8, natural and tile value order, the key ring), output pre-filled with NaN.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from gluon_reports import compiled_reports, loop_count  # noqa: E402

CUDA = torch.cuda.is_available()

# compile_text arguments: K2/V1 with the prefetch (B16), KIVI-1 capped (as the plan launches it, both key blocks on
# columns 0-3); each compile costs a few seconds of CI, so two
SASS = ["G=4, D=128, bits=2, vbits=1, post=True, pfd=1",
        "G=4, D=128, bits=1, vbits=1, post=True, qsm=True, maxnreg=168, bcol=False"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    calls = [f"text_report(tmp, {a}, kpair={p})" for a in SASS for p in (False, True)]
    out = compiled_reports(tmp_path_factory.mktemp("kpair_sass"), f"[{', '.join(calls)}]", timeout=900)
    return {(a, p): out[2 * i + j] for i, a in enumerate(SASS) for j, p in enumerate((False, True))}


@pytest.mark.parametrize("args", SASS, ids=["k2v1-prefetch", "kivi1-capped"])
def test_paired_k_words_drop_the_q_relabel_prmt(reports, args):
    old, new = reports[args, False], reports[args, True]
    D = 64 if "D=64" in args else 128
    blocks = 2 if " bits=1" in args else 1  # key blocks of 32 tokens in a warp's iteration (64 with 1-bit keys)
    words = 8 * D // 4 // 32  # K code words per lane and iteration: 8 byte rows of D/4 words over 32 lanes
    assert new["HMMA"] == old["HMMA"] and new["local"] == old["local"] == 0, (old, new)
    # q*s and q*z: D/4 channels a lane, D/8 registers each, a prmt per register, one block's worth per key block
    assert old["PRMT"] - new["PRMT"] == blocks * 2 * (D // 8) - words, (old["PRMT"], new["PRMT"])
    if D == 128:
        assert loop_count(new) < loop_count(old) - 15, (loop_count(old), loop_count(new))
        assert new["reg"] <= old["reg"] + 4, (old["reg"], new["reg"])


# 1-bit keys in 32-token blocks: (head_dim, G, V bits, post-scaled, capped as the plan launches head_dim 128)
BCOL = [(128, 4, 1, True, True), (64, 3, 1, True, False)]


@pytest.fixture(scope="module")
def bcol_reports(tmp_path_factory):
    calls = [f"text_report(tmp, G={g}, D={d}, bits=1, vbits={v}, post={p}, bcol={b}"
             + (", qsm=True, maxnreg=168)" if c else ")") for d, g, v, p, c in BCOL for b in (False, True)]
    out = compiled_reports(tmp_path_factory.mktemp("bcol_sass"), f"[{', '.join(calls)}]", timeout=900)
    return {(c, b): out[2 * i + j] for i, c in enumerate(BCOL) for j, b in enumerate((False, True))}


@pytest.mark.parametrize("case", BCOL, ids=[f"D{c[0]}G{c[1]}v{c[2]}" for c in BCOL])
def test_second_key_block_on_spare_columns(bcol_reports, case):
    D = case[0]
    old, new = bcol_reports[case, False], bcol_reports[case, True]
    steps, ktiles = 4, D // 16  # a warp's 64 tokens: 4 MMA steps of 16 rows, two key blocks of 32
    assert old["HMMA"] - new["HMMA"] == steps * ktiles + ktiles, (old["HMMA"], new["HMMA"])
    assert old["HMUL2"] - new["HMUL2"] == 2 * (D // 8), (old["HMUL2"], new["HMUL2"])  # one q*s and q*z, not two
    assert new["local"] == 0, new
    assert loop_count(new) < (0.95 if D == 128 else 0.97) * loop_count(old), (loop_count(old), loop_count(new))


def test_k_operand_switches(monkeypatch):
    from kernels.decode.text_rules import text_bcol, text_kpair
    assert text_kpair() and text_bcol()
    for name, rule in (("MMKV_TEXT_KPAIR", text_kpair), ("MMKV_TEXT_BCOL", text_bcol)):
        monkeypatch.setenv(name, "0")
        assert not rule()
        monkeypatch.setenv(name, "2")
        with pytest.raises(ValueError, match=name):
            rule()
        monkeypatch.delenv(name)


GPU_CASES = [  # B, H, G, capacity, lens, K block, V group, K bits, V bits, head_dim, value order, ring
    (2, 2, 4, 777, [777, 500], 32, 32, 2, 2, 128, "tiles", ""), (3, 1, 8, 1000, [1000, 3, 999], 64, 16, 2, 1, 128,
                                                                "tiles", ""),
    (2, 3, 3, 1000, [999, 64], 64, 32, 1, 2, 128, "tiles", "3s"), (2, 1, 4, 1000, [999, 480], 32, 64, 1, 1, 128,
                                                                   "natural", ""),
    (2, 3, 3, 777, [700, 65], 32, 32, 1, 1, 64, "tiles", ""), (1, 2, 5, 513, [513], 128, 64, 1, 2, 64, "natural", "2"),
    (2, 1, 1, 96, [0, 95], 32, 32, 2, 2, 128, "natural", ""), (2, 2, 2, 400, [333, 400], 32, 16, 2, 2, 64, "tiles", ""),
    # 1-bit keys in 32-token blocks, G <= 4 (BCOL): rows ending inside a warp's first or second block, a 1-token row
    (3, 2, 4, 1111, [1111, 40, 1], 32, 32, 1, 1, 128, "tiles", ""), (2, 2, 1, 700, [97, 700], 32, 32, 1, 2, 128,
                                                                     "natural", ""),
    (2, 1, 3, 900, [900, 333], 32, 16, 1, 1, 64, "tiles", ""), (1, 3, 2, 2000, [1999], 32, 64, 1, 2, 64, "tiles", ""),
    (2, 2, 5, 500, [500, 77], 32, 32, 1, 1, 128, "tiles", ""),  # G = 5: BCOL off, the second MMA
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kpair,bcol", [("0", "0"), ("1", "0"), ("1", "1")])
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"k{c[7]}v{c[8]}D{c[9]}G{c[2]}-{c[10]}{'-ring' if c[11] else ''}"
                                                 for c in GPU_CASES])
def test_gpu_k_operands_match_reference(case, kpair, bcol, monkeypatch):
    from reference_match import assert_matches_reference

    from kernels import testing
    from kernels.decode.plan import _GLUON_BROKEN, plan_items

    B, H, G, T, lens, blk, grp, kbits, vbits, D, order, ring = case
    monkeypatch.setenv("MMKV_TEXT_KPAIR", kpair)
    monkeypatch.setenv("MMKV_TEXT_BCOL", bcol)
    if ring:
        monkeypatch.setenv("MMKV_TEXT_RING", ring)
    g = torch.Generator().manual_seed(T + G + D)
    seg = testing.kivi_seg(B, H, T, D, lens, kbits, vbits, blk, grp, g=g, device="cuda", order=order)
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    assert plan_items(q, [seg], B, H, G, D, 132, None, 2, True, None, None, 64)[0][0]["tgl"]
    assert_matches_reference(q, [seg], lens, label=(kpair, bcol))
    assert not _GLUON_BROKEN, _GLUON_BROKEN


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bcol", ["0", "1"])
def test_gpu_spare_columns_under_the_register_cap(bcol, monkeypatch):
    """KIVI-1 at head_dim 128 as the plan launches it from larger work (q from shared memory, 168 registers), where
    the spare-column variant spills a few words an iteration (local sm_90 compile): it must match all the same."""
    from reference_match import assert_matches_reference

    from kernels import testing

    monkeypatch.setenv("MMKV_TEXT_BCOL", bcol)
    monkeypatch.setenv("MMKV_TEXT_REGS", "168")
    lens = [3001, 2048, 63, 0]
    g = torch.Generator().manual_seed(21)
    seg = testing.kivi_seg(4, 2, 3072, 128, lens, 1, 1, 32, 32, g=g, device="cuda", order="tiles")
    q = torch.randn(4, 8, 128, generator=g).to("cuda", torch.float16)
    assert_matches_reference(q, [seg], lens, label=bcol)
