"""The CPU decode path's readers of SKVQ and AlignedKV (``kernels/decode/cpu_planes.py``) against the torch
reference: random odd-sized caches, ragged ``lens`` (a row without tokens included), GQA groups 1-5, head_dim 64 and
128, blocks small enough that a segment is read in several. Attention outputs agree to 2e-5 relative (fp32, another
summation order); the compiled loops' values to 1e-6 (one fused multiply-add against torch's two roundings).
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_decode import TOL, lse_close, rel  # the CPU path's tolerances, one definition

import kernels
import kernels.decode.cpu as cpu
import kernels.decode.cpu_native as cpu_native
import kernels.decode.cpu_planes as planes
from kernels.layouts import TERNARY, join_planes
from kernels.reference import aligned_attention, decode_reference, dequant_skvq_side
from kernels.testing import aligned_seg, dense_seg, map_tensors, skvq_seg
from mmkv.methods.alignedkv import AlignedKV


def native_or_skip():
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the compiled loops are unavailable")


# (k_bits, v_bits, groups per head, equal-size groups, channel permutation, FP8 scales, head_dim)
SKVQ = [(2, 2.0, 1, True, False, False, 64),  # the bench's text=skvq: one group per head, no reorder
        (2, TERNARY, 2, False, True, True, 64),  # the paper's K2V1.5, variable groups, FP8
        (3, 4.0, 4, False, True, False, 128),
        (1, 8.0, 2, True, True, False, 128),
        (4, 3.0, 8, False, True, True, 64),
        (8, 1.0, 1, True, True, False, 64)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kb,vb,ng,fixed,perm,fp8,D", SKVQ,
                         ids=["k2v2-g1", "k2v1.5-var-fp8", "k3v4-d128", "k1v8-fixed-d128", "k4v3-g8-fp8", "k8v1"])
def test_skvq_read_in_blocks_matches_reference(kb, vb, ng, fixed, perm, fp8, D, native, monkeypatch):
    """Several blocks of 64 tokens, beside the sinks and window, with GQA: equal to the reference, whose keys and
    values are dequantized whole and un-permuted."""
    if native:
        native_or_skip()
    monkeypatch.setenv("MMKV_CPU_NATIVE", "1" if native else "0")
    monkeypatch.setattr(cpu, "BLOCK", 64)
    B, H, G = (3, 2, 5) if D == 64 else (2, 3, 3)
    g = torch.Generator().manual_seed(kb * 100 + D + ng)
    lens = [203, 0, 77][:B]
    segs = [dense_seg(B, H, 4, D, [4] * B, dtype=torch.float32, g=g),
            skvq_seg(B, H, 203, D, lens, k_bits=kb, v_bits=vb, ng=ng, fixed=fixed, perm=perm, fp8=fp8, g=g),
            dense_seg(B, H, 19, D, [19, 3, 0][:B], g=g)]
    assert planes.skvq_native(segs[1], torch.float32) == native
    q = torch.randn(B, H * G, D, generator=g)
    out, lse = cpu.decode_attention_cpu(q, segs, 0.1)
    ref, ref_lse = decode_reference(q, segs, 0.1)
    assert rel(out, ref) < TOL and lse_close(lse, ref_lse)


@pytest.mark.parametrize("kb,vb,ng,fixed,perm,fp8,D", SKVQ[:5], ids=["k2-g1", "t-var", "k3", "k1", "k4-g8"])
def test_compiled_skvq_loop(kb, vb, ng, fixed, perm, fp8, D):
    """The compiled loop on a token slice that starts mid-buffer: position ``p`` of a token row holds natural
    channel ``nat[h, p]`` of the reference's dequantization, the rows past the slice stay NaN."""
    native_or_skip()
    g = torch.Generator().manual_seed(kb + D)
    seg = skvq_seg(2, 3, 41, D, k_bits=kb, v_bits=vb, ng=ng, fixed=fixed, perm=perm, fp8=fp8, g=g)
    for side, bits in (("k", kb), ("v", vb)):
        lo, hi, s, z, p, gid = (getattr(seg, f"{side}_{n}") for n in ("codes", "hi", "scale", "zero", "perm", "gid"))
        nat, masks, unlane = planes._side_maps(p, gid, bits, D)
        assert torch.equal(nat.gather(-1, unlane), torch.arange(D).expand(3, D))
        assert sorted(planes.skvq_positions(bits, D).tolist()) == list(range(D))
        out = torch.full((2, 3, 30, D), float("nan"))
        got = planes._dequant_side(lo, hi, s, z, bits, masks, 9, 34, out)
        want = dequant_skvq_side(*[None if t is None else t[:, :, 9:34] for t in (lo, hi, s, z)], bits, p, gid)
        torch.testing.assert_close(got, want.gather(-1, nat[None, :, None, :].expand(2, 3, 25, D)), rtol=1e-6,
                                   atol=1e-6)
        assert out[:, :, 25:].isnan().all()


def aligned(B, H, T, D, lens, g, **kw):
    """An AlignedKV segment as the cache holds it: contiguous planes (``split_planes`` returns transposed views)."""
    return map_tensors(aligned_seg(B, H, T, D, lens, AlignedKV(**kw).quantize, g=g), lambda t: t.contiguous())


@pytest.mark.parametrize("B,H,G,D,kw", [
    (2, 3, 3, 64, dict(block=32)),
    (3, 2, 4, 128, dict(block=64)),
    (2, 3, 5, 64, dict(block=128, values="conservative")),
    (1, 2, 2, 64, dict(block=64, values="full", keys="full")),
    (2, 2, 1, 128, dict(block=32, min_bits=16)),
    (2, 3, 3, 64, dict(block=64, min_bits=12)),
], ids=["b32", "d128", "b128-conservative", "full", "exact", "floor12"])
def test_aligned_read_matches_reference(B, H, G, D, kw):
    """The compiled passes read each (block, channel) at the width the reference's rules choose: the same output
    and log-sum-exp, with a row that holds no token and rows that end inside a block."""
    native_or_skip()
    g = torch.Generator().manual_seed(B * 10 + D + kw["block"])
    seg = aligned(B, H, 7 * kw["block"], D, [7 * kw["block"] - 5, 0, 33][:B], g, **kw)
    q = torch.randn(B, H * G, D, generator=g)
    assert planes.aligned_native(seg, q)
    own, own_lse = planes.aligned_attention_cpu(q, seg, 0.1)
    ref, ref_lse = decode_reference(q, [seg], 0.1)
    assert rel(own, ref) < TOL and lse_close(own_lse, ref_lse)
    segs = [seg, dense_seg(B, H, 9, D, [9] * B, dtype=torch.float32, g=g)]  # merged with the window's partial
    out = torch.full_like(q, float("nan"))
    res, lse = kernels.decode_attention(q, segs, 0.1, return_lse=True, out=out)
    ref, ref_lse = decode_reference(q, segs, 0.1)
    assert res is out and rel(out, ref) < TOL and lse_close(lse, ref_lse)


@pytest.mark.parametrize("values", ["paper", "conservative"])
@pytest.mark.parametrize("min_bits", [8, 12])
def test_aligned_widths_are_the_references(values, min_bits):
    """The compiled Rule 1 and Rule 2 choose the reference's width for every (block, channel) that holds a token,
    over keys whose channels span 13 binades (every width occurs)."""
    native_or_skip()
    g = torch.Generator().manual_seed(min_bits)
    seg = map_tensors(aligned_seg(2, 3, 320, 64, [320, 100], AlignedKV(block=32, values=values,
                                                                       min_bits=min_bits).quantize, g=g, binades=6),
                      lambda t: t.contiguous())
    q = torch.randn(2, 12, 64, generator=g) * torch.exp2(torch.randint(-4, 5, (1, 1, 64), generator=g).float())
    _, _, want_k, want_v = aligned_attention(q, seg, 0.125)
    qg = q.reshape(2, 3, 4, 64)
    lk = planes._key_levels(qg, seg, 10)
    # the logits as the reference computes them, from the keys read at its widths
    x = torch.einsum("bhgd,bhtd->bhgt", qg, join_planes(seg.k_hi, seg.k_mid, seg.k_low, lk).float())
    x = (x * (0.125 * planes.LOG2E)).masked_fill(torch.arange(320) >= seg.lens[:, None, None, None], float("-inf"))
    m = x.amax(-1).clamp(min=-1e30)
    lse2 = m + torch.log2(torch.exp2(x - m[..., None]).sum(-1))
    lv = planes._value_levels(x[..., planes.block_order(32, 320)], lse2, seg)  # the passes' order of positions
    held = want_k > 0  # blocks with a valid token (the reference reports 0 elsewhere)
    assert held.sum() == 3 * 64 * (10 + 4)
    assert torch.equal(lk[held], want_k[held]) and len(set(lk[held].tolist())) == 3 - (min_bits == 12)
    assert torch.equal(lv[held], want_v[held]) and len(set(lv[held].tolist())) >= 2


@pytest.mark.parametrize("bits", [8, 12])
def test_aligned_forced_width_is_read_truncated(bits):
    """``force_bits`` (the uniform-truncation ablation) reads every block at that width, as the reference: the
    output differs from the exact read by the truncation, not by the path."""
    native_or_skip()
    g = torch.Generator().manual_seed(bits)
    seg = aligned(2, 3, 128, 64, [128, 70], g, block=32)
    seg.force_bits = bits
    q = torch.randn(2, 9, 64, generator=g)
    out, lse = planes.aligned_attention_cpu(q, seg, 0.125)
    ref, ref_lse = decode_reference(q, [seg], 0.125)
    assert rel(out, ref) < TOL and lse_close(lse, ref_lse)
    seg.force_bits = 0
    seg.min_bits = 16
    exact, _ = planes.aligned_attention_cpu(q, seg, 0.125)
    assert rel(out, exact) > 1e-4  # truncation shows: the width was honoured


def test_aligned_layout_it_cannot_read_goes_to_the_reference():
    """Planes the compiled passes cannot walk (strided views of them) or fp16 queries: the reference reads them.
    The method's own planes are contiguous (``split_planes``) and are read natively."""
    g = torch.Generator().manual_seed(4)
    seg = aligned_seg(1, 2, 64, 64, [64], AlignedKV(block=32).quantize, g=g)
    q = torch.randn(1, 4, 64, generator=g)
    assert planes.aligned_native(seg, q)
    strided = map_tensors(seg, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() == 5 else t)
    assert not torch.equal(torch.tensor(strided.k_hi.stride()), torch.tensor(seg.k_hi.stride()))
    assert not planes.aligned_native(strided, q)
    assert not planes.aligned_native(seg, q.half())
    out, _ = cpu.decode_attention_cpu(q, [strided])
    assert torch.equal(out, decode_reference(q, [strided])[0])
