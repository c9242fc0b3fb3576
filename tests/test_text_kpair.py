"""The Gluon text kernel's K operand with the middle bytes of each code word swapped (``MMKV_TEXT_KPAIR``,
``text_rules.text_kpair``, ``text.py``'s ``_pair_bytes`` and ``_b_relabel``).

On CPU (CI): compiled for sm_90 the hot loop keeps its MMAs and drops the ``prmt`` that paired channels p and p + 2
of q*s and q*z (two per register pair, per key block), paying one per K code word instead: at head_dim 128 the
loop issues fewer instructions, K2/V1 with the L2 prefetch and KIVI-1 under its register cap. On the GPU
(``-m gpu``): both operand orders match the torch reference on odd, ragged shapes (1- and 2-bit keys, head_dim
64 and 128, GQA groups 1-8, natural and tile value order, the key ring), output pre-filled with NaN.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from gluon_reports import compiled_reports  # noqa: E402

CUDA = torch.cuda.is_available()

# compile_text arguments: K2/V1 with the prefetch (B16), KIVI-1 capped (as the plan launches it), KIVI-2 natural
SASS = ["G=4, D=128, bits=2, vbits=1, post=True, pfd=1", "G=4, D=128, bits=1, vbits=1, post=True, qsm=True, maxnreg=168",
        "G=4, D=128, bits=2, vbits=2, post=False", "G=3, D=64, bits=2, vbits=2, post=True"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    calls = [f"text_report(tmp, {a}, kpair={p})" for a in SASS for p in (False, True)]
    out = compiled_reports(tmp_path_factory.mktemp("kpair_sass"), f"[{', '.join(calls)}]", timeout=900)
    return {(a, p): out[2 * i + j] for i, a in enumerate(SASS) for j, p in enumerate((False, True))}


def _loop(r: dict) -> int:
    return sum(v for k, v in r.items() if k.isupper())


@pytest.mark.parametrize("args", SASS, ids=["k2v1-prefetch", "kivi1-capped", "kivi2-natural", "smollm2-kivi2"])
def test_paired_k_words_drop_the_q_relabel_prmt(reports, args):
    old, new = reports[args, False], reports[args, True]
    D = 64 if "D=64" in args else 128
    blocks = 2 if " bits=1" in args else 1  # key blocks of 32 tokens in a warp's iteration (64 with 1-bit keys)
    words = 8 * D // 4 // 32  # K code words per lane and iteration: 8 byte rows of D/4 words over 32 lanes
    assert new["HMMA"] == old["HMMA"] and new["local"] == old["local"] == 0, (old, new)
    # q*s and q*z: D/4 channels a lane, D/8 registers each, a prmt per register, one block's worth per key block
    assert old["PRMT"] - new["PRMT"] == blocks * 2 * (D // 8) - words, (old["PRMT"], new["PRMT"])
    if D == 128:
        assert _loop(new) < _loop(old) - 15, (_loop(old), _loop(new))
        assert new["reg"] <= old["reg"] + 4, (old["reg"], new["reg"])


def test_kpair_switch(monkeypatch):
    from kernels.decode.text_rules import text_kpair
    assert text_kpair()
    monkeypatch.setenv("MMKV_TEXT_KPAIR", "0")
    assert not text_kpair()
    monkeypatch.setenv("MMKV_TEXT_KPAIR", "2")
    with pytest.raises(ValueError, match="MMKV_TEXT_KPAIR"):
        text_kpair()


GPU_CASES = [  # B, H, G, capacity, lens, K block, V group, K bits, V bits, head_dim, value order, ring
    (2, 2, 4, 777, [777, 500], 32, 32, 2, 2, 128, "tiles", ""), (3, 1, 8, 1000, [1000, 3, 999], 64, 16, 2, 1, 128,
                                                                "tiles", ""),
    (2, 3, 3, 1000, [999, 64], 64, 32, 1, 2, 128, "tiles", "3s"), (2, 1, 4, 1000, [999, 480], 32, 64, 1, 1, 128,
                                                                   "natural", ""),
    (2, 3, 3, 777, [700, 65], 32, 32, 1, 1, 64, "tiles", ""), (1, 2, 5, 513, [513], 128, 64, 1, 2, 64, "natural", "2"),
    (2, 1, 1, 96, [0, 95], 32, 32, 2, 2, 128, "natural", ""), (2, 2, 2, 400, [333, 400], 32, 16, 2, 2, 64, "tiles", ""),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kpair", ["0", "1"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"k{c[7]}v{c[8]}D{c[9]}G{c[2]}-{c[10]}{'-ring' if c[11] else ''}"
                                                 for c in GPU_CASES])
def test_gpu_both_operand_orders_match_reference(case, kpair, monkeypatch):
    from reference_match import assert_matches_reference

    from kernels import testing
    from kernels.decode.plan import _GLUON_BROKEN, plan_items

    B, H, G, T, lens, blk, grp, kbits, vbits, D, order, ring = case
    monkeypatch.setenv("MMKV_TEXT_KPAIR", kpair)
    if ring:
        monkeypatch.setenv("MMKV_TEXT_RING", ring)
    g = torch.Generator().manual_seed(T + G + D)
    seg = testing.kivi_seg(B, H, T, D, lens, kbits, vbits, blk, grp, g=g, device="cuda", order=order)
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    assert plan_items(q, [seg], B, H, G, D, 132, None, 2, True, None, None, 64)[0][0]["tgl"]
    assert_matches_reference(q, [seg], lens, label=kpair)
    assert not _GLUON_BROKEN, _GLUON_BROKEN
