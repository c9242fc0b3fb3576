"""How the Gluon text kernel's splits end (``kernels/decode/gluon/text.py``, ``decode/text_rules.py``): the merge
launch as a programmatic dependent (``text_pdl``) and the splits of a (row, KV head) as one thread block cluster
that writes the output itself (``text_split``). The rules are device-free (CPU); the numbers are tested on the GPU
(``-m gpu``) on the shapes of ``test_text_gluon.py`` (odd and ragged lengths, GQA 1-8, head_dim 64 and 128, NaN-
prefilled output) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.decode import text_rules

CUDA = torch.cuda.is_available()


def test_text_pdl_rule(monkeypatch):
    monkeypatch.delenv("MMKV_TEXT_PDL", raising=False)
    assert text_rules.text_pdl(1, 8, 32768) == 1  # few pairs: the merge launch starts early
    assert text_rules.text_pdl(1, 3, 4096, 64) == 1
    assert text_rules.text_pdl(1, 8, 4096, 128) == 0  # InternVL heads at 4k tokens: slower with it
    assert text_rules.text_pdl(4, 8, 32768) == 0  # 32 pairs and up: within noise, off
    assert text_rules.text_pdl(16, 8, 32768) == 0
    monkeypatch.setenv("MMKV_TEXT_PDL", "2")
    assert text_rules.text_pdl(16, 8, 32768) == 2
    monkeypatch.setenv("MMKV_TEXT_PDL", "3")
    with pytest.raises(ValueError):
        text_rules.text_pdl(1, 8, 4096)


def test_text_split_rule(monkeypatch):
    for name in ("MMKV_TEXT_TPS", "MMKV_TEXT_CL", "MMKV_TEXT_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    smol2 = {"tiles": 32, "T": 4096, "tt": 128}  # SmolLM2 heads, 2-bit keys, 4 warps: 128 tokens a tile
    smol1 = {"tiles": 16, "T": 4096, "tt": 256}  # 1-bit keys: 256
    assert text_rules.text_split(smol2, 1, 3, 4, True) == (2, 0)  # 256 tokens a split, no clusters
    assert text_rules.text_split(smol1, 1, 3, 4, True) == (1, 0)
    assert text_rules.text_split(smol2, 16, 3, 4, True) == (4, 0)  # 48 pairs: the plan's
    assert text_rules.text_split({"tiles": 512, "T": 32768, "tt": 64}, 1, 8, 7, True) == (7, 0)  # long rows
    monkeypatch.setenv("MMKV_TEXT_SPLIT", "0")
    assert text_rules.text_split(smol2, 1, 3, 4, True) == (4, 0)
    monkeypatch.setenv("MMKV_TEXT_CL", "8")
    it = {"tiles": 30, "T": 4096, "tt": 128}
    assert text_rules.text_split(it, 1, 3, 4, True) == (4, 8)  # 30 tiles over 8 CTAs
    assert text_rules.text_split(it, 1, 3, 4, False) == (4, 0)  # no clusters on this device: the plan's split
    monkeypatch.setenv("MMKV_TEXT_CL", "0")
    monkeypatch.setenv("MMKV_TEXT_TPS", "3")
    assert text_rules.text_split(it, 1, 3, 4, True) == (3, 0)
    for bad in ("3", "16"):
        monkeypatch.setenv("MMKV_TEXT_CL", bad)
        with pytest.raises(ValueError):
            text_rules.text_split(it, 1, 3, 4, True)


def test_text_waves_long_rows(monkeypatch):
    """One wave for few long rows of 2-bit keys at head_dim 128 (``long2``), else the byte rule below 32 pairs."""
    from kernels.decode.gluon import text_slots as ts

    for name in ("MMKV_TEXT_WAVES", "MMKV_TEXT_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    assert ts.text_waves(1, 8, 6, 132, long2=True) == 1
    assert ts.text_waves(1, 8, 6, 132) == 0
    assert ts.text_waves(1, 8, None, 132, long2=True) == 0  # before the variant ran: the byte rule
    it = {"seg": type("S", (), {"k_bits": 2, "v_bits": 2, "v_order": "tiles"})(), "tw": 2, "pfd": 1,
          "regs": (False, 0), "T": 32768, "tiles": 512}
    monkeypatch.setattr(ts, "text_resident", lambda key: 6)
    assert ts.wave_tiles(it, 0, 1, 8, 128, 132) == 6  # 99 splits a pair fit one wave of 792: 86 of 6 tiles
    monkeypatch.setenv("MMKV_TEXT_SPLIT", "0")
    assert ts.wave_tiles(it, 0, 1, 8, 128, 132) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["pdl1", "pdl2", "cl2", "cl8", "cl4+dense"])
@pytest.mark.parametrize("order", ["tiles", "natural"])
@pytest.mark.parametrize("ci", range(0, 18, 3))
def test_gpu_text_finish_matches_reference(ci, order, mode, monkeypatch):
    """Every third shape of ``test_text_gluon.CASES``, both value orders, under each finish: the output and the
    log-sum-exp match the reference, and the clusters' output without the log-sum-exp is the same. ``+dense``: a
    dense (fp16) segment follows the KIVI one, so the clusters merge its partials as well."""
    from test_text_gluon import CASES

    import kernels
    from kernels import testing
    from kernels.reference import decode_reference

    if mode.startswith("pdl"):
        monkeypatch.setenv("MMKV_TEXT_PDL", mode[3])
    else:
        monkeypatch.setenv("MMKV_TEXT_CL", mode[2])
    B, H, G, T, lens, blk, grp, kbits, vbits, D = CASES[ci]
    if order == "tiles" and grp % 16:
        order = "natural"
    g = torch.Generator().manual_seed(T + G)
    segs = [testing.kivi_seg(B, H, T, D, lens, kbits, vbits, blk, grp, g=g, device="cuda", order=order)]
    if mode.endswith("+dense"):
        segs.append(testing.dense_seg(B, H, 37, D, device="cuda"))
    q = torch.randn(B, H * G, D, generator=g).to("cuda", torch.float16)
    ref, ref_lse = decode_reference(q, segs)
    out = torch.full_like(q, float("nan"))
    got, lse = kernels.decode_attention(q, segs, out=out, return_lse=True)
    live = ref_lse.isfinite() if mode.endswith("+dense") else torch.tensor(lens, device="cuda")[:, None] > 0
    live = live.expand(B, H * G)
    err = (got.float() - ref.float())[live].norm() / ref.float()[live].norm()
    assert err < 1e-3, err.item()
    assert not torch.isnan(got).any()
    assert torch.allclose(lse[live], ref_lse.float()[live], atol=2e-3, rtol=1e-4)
    assert (got[~live] == 0).all()
    assert torch.equal(kernels.decode_attention(q, segs), got)
