"""AlignedKV Triton kernel vs the torch reference of the precision-aligned read (``reference.aligned_attention``):
same widths per (block, channel), same fill, same output; alone and merged with dense segments in one
``kernels.decode_attention`` call; 16 bits everywhere equals exact fp16 attention; the benchmark's smoke mode.

CPU: Triton's interpreter, switched on before triton is imported (see tests/test_kernels.py for why: when an
earlier test module already imported triton, every test here is skipped but one, which re-runs this file in a
fresh process with TRITON_INTERPRET=1). GPU: the same file runs compiled.

Inputs are random and never zero: K with per-channel magnitudes spread over 9 binades (real keys' columnar
pattern, so Rule 1 picks 8, 12 and 16 bits), V normal, q scaled so that attention is peaked (Rule 2 picks all three
widths too; asserted). Odd sizes: 3 KV heads x 3 query heads, 63 / 150 / 577 tokens, rows of different lengths, a
row of length 0; outputs pre-filled with NaN. Thresholds: output relative L2 error < 2e-3 vs the reference (the
kernel rounds p and q to fp16 for the tensor cores, as the dense kernel does), lse within 1e-3; the widths chosen
agree on >= 99% of (block, channel) pairs (a logit within float rounding of a binade edge may flip one).
"""

from __future__ import annotations

import dataclasses
import json

import torch
from triton_switch import CUDA, fixtures, switch_on

IN_PROCESS, _WE_SET_INTERPRET = switch_on()  # before triton and the kernels are imported

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import testing  # noqa: E402
from kernels.decode.alignedkv import aligned_decode  # noqa: E402
from kernels.layouts import DenseSeg  # noqa: E402
from kernels.reference import aligned_attention, attention_over_segments, decode_reference  # noqa: E402
from mmkv.methods.alignedkv import AlignedKV  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, IN_PROCESS, _WE_SET_INTERPRET)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def aligned_seg(B, H, T, D, lens, block, g, **kw):
    """kernels.testing's AlignedKV segment (keys over 9 binades), stored by the method with these settings."""
    return testing.aligned_seg(B, H, T, D, lens, AlignedKV(block=block, **kw).quantize, g=g, device=DEV)


def dense_seg(B, H, T, D, lens, g):
    return testing.dense_seg(B, H, T, D, lens, g=g, device=DEV)


def query(B, HQ, D, g, peak=4.0):
    return testing.rand_q(B, HQ, D, g=g, device=DEV, scale=peak)


def check_against_reference(q, seg, widths_mixed=True, splits=None):
    out, lse, lk, lv = aligned_decode(q, seg, splits=splits)
    ref, ref_lse, rk, rv = aligned_attention(q.float(), seg)
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    err = rel_err(out, ref)
    assert err < 2e-3, f"relative error {err:.2e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and torch.allclose(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-4)
    for name, a, b in (("K", lk, rk), ("V", lv, rv)):
        agree = (a == b).float().mean().item()
        assert agree >= 0.99, f"{name} widths agree on {agree:.3f}"
    if widths_mixed:  # the data exercises every width on both sides
        assert {8, 12, 16} <= set(rk.unique().tolist()) and {8, 12, 16} <= set(rv.unique().tolist())
    return err


CASES = [  # (B, KV heads, query heads, tokens, head_dim, lens, block, extra method knobs)
    (2, 3, 9, 150, 64, [150, 77], 32, {}),
    (3, 2, 8, 577, 128, [577, 0, 300], 64, {}),
    (1, 4, 4, 63, 32, [63], 32, {"values": "full"}),
    (2, 1, 3, 200, 64, [130, 200], 128, {"min_bits": 12}),
    (2, 3, 9, 150, 64, [150, 77], 32, {"values": "conservative"}),
    (3, 2, 8, 577, 128, [577, 0, 300], 64, {"values": "conservative"}),
]


@pytest.mark.parametrize("B,H,HQ,T,D,lens,block,kw", CASES,
                         ids=[f"B{c[0]}-H{c[1]}x{c[2] // c[1]}-T{c[3]}-D{c[4]}-blk{c[6]}-{c[7] or 'rules'}"
                              for c in CASES])
def test_kernel_matches_aligned_reference(B, H, HQ, T, D, lens, block, kw):
    g = torch.Generator().manual_seed(T + D + block)
    seg = aligned_seg(B, H, T, D, lens, block, g, **kw)
    check_against_reference(query(B, HQ, D, g), seg, widths_mixed=not kw or kw == {"values": "conservative"})


RULE_CASES = [  # (B, KV heads, query heads, tokens, head_dim, lens, block): GQA 1, 3, 8; head_dim 64 and 128
    (3, 1, 8, 577, 128, [577, 0, 301], 64),
    (2, 3, 9, 333, 64, [333, 190], 64),
    (2, 2, 2, 259, 64, [259, 5], 32),
]


# the Rule 2 passes' loads (kernels/switches.py); vhi: V high bytes read whole in the keys pass, nibbles added after
READERS = {"ahead": {}, "in-block": {"MMKV_ALIGNED_PREFETCH": "0"}, "vhi": {"MMKV_ALIGNED_OEST": "vhi"},
           "vhi4": {"MMKV_ALIGNED_OEST": "vhi4"}}


def _repeats_vhi(reader: str, block: int) -> bool:
    """vhi4 runs its 4-token phases on blocks of 64 and 128 only; on blocks of 32 it launches exactly vhi's kernels
    (kernels/decode/alignedkv.py), so such a run would repeat vhi's."""
    return reader == "vhi4" and block % 64 != 0


RULE_RUNS = [(*c, r) for r in READERS for c in RULE_CASES if not _repeats_vhi(r, c[6])]


@pytest.mark.parametrize("B,H,HQ,T,D,lens,block,reader", RULE_RUNS,
                         ids=[f"{c[7]}-B{c[0]}-H{c[1]}x{c[2] // c[1]}-T{c[3]}-D{c[4]}-blk{c[6]}" for c in RULE_RUNS])
def test_rule_passes_every_reader(B, H, HQ, T, D, lens, block, reader, monkeypatch):
    """The Rule 2 keys and values passes match the reference with their loads one block ahead (default: colmax and
    logits of the next block, O_est's gather deferred), without (``MMKV_ALIGNED_PREFETCH=0``) and with the V high
    bytes read whole in the keys pass (``MMKV_ALIGNED_OEST=vhi``, ``alignedkv_vhi``): GQA 8, 3 and 1,
    head_dim 128 and 64, ragged rows, a row of length 0, several splits (their first and last blocks are where
    the look-ahead is clamped); blocks whose channels all read 8 value bits and blocks that read more."""
    for name, val in READERS[reader].items():
        monkeypatch.setenv(name, val)
    g = torch.Generator().manual_seed(T * 3 + D + HQ)
    seg = aligned_seg(B, H, T, D, lens, block, g)
    q = query(B, HQ, D, g)
    check_against_reference(q, seg, widths_mixed=False)
    rv = aligned_attention(q.float(), seg)[3]
    per_block = rv.amax(-1)[rv.amax(-1) > 0]
    assert (per_block == 8).any() and (per_block > 8).any(), per_block.unique()


VHI_CASES = [c for c in CASES if c[7] in ({}, {"values": "conservative"})] + [  # + GQA 4 / 2, block 128
    (2, 2, 8, 333, 128, [333, 129], 128, {}), (2, 4, 8, 201, 64, [1, 201], 64, {"min_bits": 12}),
    (2, 2, 8, 1100, 64, [1100, 517], 32, {}),  # one split: 35 blocks, widths decided 16 at a time
    (1, 2, 4, 1050, 64, [1050], 64, {"min_bits": 16})]  # every block 16 bits: chunk words with the sign bit set


VHI_RUNS = [(*c, m) for m in ("vhi", "vhi4") for c in VHI_CASES if not _repeats_vhi(m, c[6])]


@pytest.mark.parametrize("B,H,HQ,T,D,lens,block,kw,mode", VHI_RUNS,
                         ids=[f"{c[8]}-B{c[0]}-H{c[1]}x{c[2] // c[1]}-T{c[3]}-D{c[4]}-blk{c[6]}-{c[7] or 'rules'}"
                              for c in VHI_RUNS])
def test_vhi_path_matches_reference(B, H, HQ, T, D, lens, block, kw, mode, monkeypatch):
    """``MMKV_ALIGNED_OEST=vhi`` (keys pass reads the V high bytes whole, the correction pass only the nibbles of
    wider channels) and ``vhi4`` (the same on 4-token phases; blocks of 32 fall back to ``vhi``) against
    ``aligned_attention``: both value rules, GQA 4, 3, 2, blocks 32/64/128, a row of length
    0 and of 1 token, NaN-prefilled partials; the widths of both sides agree (every width occurs on both sides in
    the block 32 and 64 cases)."""
    monkeypatch.setenv("MMKV_ALIGNED_OEST", mode)
    g = torch.Generator().manual_seed(T + D + block)
    seg = aligned_seg(B, H, T, D, lens, block, g, **kw)
    check_against_reference(query(B, HQ, D, g), seg, widths_mixed=block < 128 and "min_bits" not in kw,
                            splits=1 if T > 1000 else None)


@pytest.mark.parametrize("oest", ["gather", "vhi"])  # blocks of 32: vhi4 would run vhi's kernels again
def test_mixed_with_dense_segments_in_one_call(oest, monkeypatch):
    """Sinks + AlignedKV text + recent window through kernels.decode_attention: one merge; vs decode_reference."""
    monkeypatch.setenv("MMKV_ALIGNED_OEST", oest)
    g = torch.Generator().manual_seed(21)
    B, H, HQ, D = 2, 3, 9, 64
    segs = [dense_seg(B, H, 4, D, [4, 3], g), aligned_seg(B, H, 150, D, [150, 0], 32, g),
            dense_seg(B, H, 17, D, [17, 9], g)]
    q = query(B, HQ, D, g)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEV)
    res, lse = kernels.decode_attention(q, segs, return_lse=True, out=out)
    ref, ref_lse = decode_reference(q.float(), segs)
    assert res.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    assert rel_err(out, ref) < 2e-3
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)


def test_sixteen_bits_everywhere_equals_exact_fp16_attention():
    """min_bits=16 (and force_bits=16): the kernel's output is exact fp16 attention over the same K/V, as close as
    the dense kernel over those K/V gets (both round p to fp16 for the tensor cores)."""
    g = torch.Generator().manual_seed(16)
    B, H, HQ, T, D = 2, 3, 9, 150, 64
    seg = aligned_seg(B, H, T, D, [150, 40], 32, g, min_bits=16)
    k, v = kernels.reference.dequant_aligned(seg)
    dense = DenseSeg(k[:, :, :T].half(), v[:, :, :T].half(), seg.lens)
    q = query(B, HQ, D, g)
    exact = attention_over_segments(q.float().unsqueeze(2), [dense])[0].squeeze(2)
    dense_kernel = kernels.decode_attention(q, [dense]).float()
    for s in (seg, dataclasses.replace(seg, min_bits=8, force_bits=16)):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEV)
        kernels.decode_attention(q, [s], out=out)
        assert rel_err(out, exact) < 1e-3
        assert rel_err(out, dense_kernel) < 1e-3
        _, _, lk, lv = aligned_decode(q, s)
        assert set(lk.unique().tolist()) - {0} == set(lv.unique().tolist()) - {0} == {16}  # 0: blocks past lens


def test_forced_narrow_reads_match_reference():
    g = torch.Generator().manual_seed(8)
    seg = aligned_seg(2, 3, 100, 64, [100, 33], 32, g)
    q = query(2, 9, 64, g)
    for bits in (8, 12):
        s = dataclasses.replace(seg, force_bits=bits)
        check_against_reference(q, s, widths_mixed=False)
        _, _, lk, lv = aligned_decode(q, s)
        assert set(lk.unique().tolist()) - {0} == set(lv.unique().tolist()) - {0} == {bits}


def test_benchmark_smoke(tmp_path, capsys):
    """python -m eval.bench.alignedkv_attention runs end to end in its tiny CPU mode and writes its JSON (in this
    process: the file's tests already run under the interpreter here)."""
    if CUDA:
        pytest.skip("the GPU runs the real benchmark")
    from eval.bench import alignedkv_attention

    out = tmp_path / "bench"
    assert alignedkv_attention.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads((out / "bench_alignedkv.json").read_text())
    assert data["rows"] and all(r["max_rel_err"] < 2e-2 for r in data["rows"])
    assert "| shape |" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("H,HQ,D", [(3, 9, 64), (8, 32, 128)], ids=["smollm2", "gqa8"])
@pytest.mark.parametrize("oest", ["gather", "vhi", "vhi4"])
def test_gpu_long_context(H, HQ, D, oest, monkeypatch):
    """Compiled kernel at benchmark-like sizes (many splits per row), alone and through decode_attention; both ways
    of finding O_est (``MMKV_ALIGNED_OEST``)."""
    monkeypatch.setenv("MMKV_ALIGNED_OEST", oest)
    g = torch.Generator().manual_seed(HQ)
    seg = aligned_seg(3, H, 9000, D, [9000, 8191, 1], 64, g)
    q = query(3, HQ, D, g, peak=1.0)
    check_against_reference(q, seg, widths_mixed=False)
    segs = [seg, dense_seg(3, H, 100, D, [100, 0, 7], g)]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEV)
    kernels.decode_attention(q, segs, out=out)
    assert not torch.isnan(out).any() and rel_err(out, decode_reference(q.float(), segs)[0]) < 2e-3


def test_planes_are_stored_contiguous():
    """The method stores every plane contiguous: the kernel reads them in place as 4-token words (a strided plane
    would be copied on every decode call)."""
    g = torch.Generator().manual_seed(3)
    seg = aligned_seg(2, 3, 100, 64, [100, 33], 32, g)
    assert all(getattr(seg, n).is_contiguous() for n in ("k_hi", "k_mid", "k_low", "k_colmax", "v_hi", "v_mid",
                                                          "v_low", "v_colmax"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kw", [{}, {"values": "conservative"}, {"force_bits": 12}, {"force_bits": 8},
                                {"values": "full", "min_bits": 12}],
                         ids=["paper", "conservative", "force12", "force8", "full-min12"])
def test_gpu_asm_assembly_matches_integer_path(kw, monkeypatch):
    """The inline-asm prmt assembly (compiled default) and the Triton integer path (what the interpreter checks
    against the reference above) give bit-identical outputs, lse and widths: ragged rows, a row of 3 tokens."""
    g = torch.Generator().manual_seed(99)
    seg = dataclasses.replace(aligned_seg(3, 2, 1000, 128, [1000, 517, 3], 64, g), **kw)
    q = query(3, 8, 128, g)
    res = {}
    for env in ("1", "0"):
        monkeypatch.setenv("MMKV_ALIGNED_ASM", env)
        res[env] = aligned_decode(q, seg)
    assert not torch.isnan(res["1"][0]).any()
    for a, b in zip(res["1"], res["0"], strict=True):
        assert torch.equal(a, b)
    check_against_reference(q, seg, widths_mixed=False)
