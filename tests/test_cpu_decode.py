"""The CPU decode path (``kernels/decode/cpu.py``) against the torch reference it replaces on the CPU.

Random, odd-sized inputs: ragged ``lens`` (rows with no token at all included), GQA groups 1-8, head_dim 64 and
128, every layout (dense fp32/fp16, KIVI/XQuant at 1/2/4 bits, channel-wise with one or several scale blocks,
calibrated channel segments, SKVQ, AlignedKV) and blocks small enough that a segment is read in several. The
fused CPU attention accumulates in another order than the reference: outputs agree to 2e-5 relative (fp32).
"""

from __future__ import annotations

import pytest
import torch

import kernels
import kernels.decode.cpu as cpu
from kernels.layouts import unpack
from kernels.reference import attention_over_segments, decode_reference
from kernels.testing import aligned_seg, channel_seg, dense_seg, kivi_seg, map_tensors, skvq_seg
from mmkv.attention import causal_partial
from mmkv.methods.alignedkv import AlignedKV

TOL = 2e-5


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def lse_close(a, b) -> bool:
    fin = torch.isfinite(b)
    return bool(torch.equal(fin, torch.isfinite(a)) and torch.allclose(a[fin], b[fin], atol=1e-4, rtol=1e-5))


def layer(B, H, D, g):
    lens = [[301, 0, 170][:B], [96, 50, 1][:B], [200, 50, 7][:B], [256, 3, 129][:B]]
    return [
        dense_seg(B, H, 4, D, [4] * B, dtype=torch.float32, g=g),  # sinks
        kivi_seg(B, H, 301, D, lens[0], g=g),
        kivi_seg(B, H, 200, D, lens[2], k_bits=1, v_bits=4, block=64, group=16, g=g),
        channel_seg(B, H, 96, D, 2, lens[1], None, g=g),  # one scale block (read whole)
        channel_seg(B, H, 256, D, 4, lens[3], None, block=32, g=g),  # several blocks (read in blocks)
        channel_seg(B, H, 200, D, 1, lens[2], (0.0, 3.0), g=g),  # calibrated: the reference
        skvq_seg(B, H, 77, D, lens[1], g=g),
        aligned_seg(B, H, 65, D, [65, 64, 2][:B], AlignedKV(block=32).quantize, g=g),  # reads its own bits
        dense_seg(B, H, 37, D, [37, 1, 20][:B], g=g),  # fp16 window
    ]


@pytest.mark.parametrize("B,H,G,D", [(2, 3, 3, 64), (3, 2, 4, 128), (1, 1, 8, 64), (2, 4, 1, 64)],
                         ids=["smollm2-9x3", "gqa4-d128", "gqa8", "mha"])
@pytest.mark.parametrize("block", [64, 2048], ids=["blocks-64", "blocks-2048"])
def test_cpu_path_matches_reference(B, H, G, D, block, monkeypatch):
    monkeypatch.setattr(cpu, "BLOCK", block)
    g = torch.Generator().manual_seed(B * 100 + G * 10 + D + block)
    segs = layer(B, H, D, g)
    q = torch.randn(B, H * G, D, generator=g)
    out, lse = cpu.decode_attention_cpu(q, segs, 0.1)
    ref, ref_lse = decode_reference(q, segs, 0.1)
    assert rel(out, ref) < TOL
    assert lse_close(lse, ref_lse)


def test_public_api_writes_into_out():
    """``kernels.decode_attention`` on a CPU tensor takes this path and fills a NaN-prefilled ``out``."""
    g = torch.Generator().manual_seed(7)
    segs = [kivi_seg(2, 3, 133, 64, [133, 60], g=g), dense_seg(2, 3, 9, 64, [9, 9], dtype=torch.float32, g=g)]
    q = torch.randn(2, 9, 64, generator=g)
    out = torch.full_like(q, float("nan"))
    res, lse = kernels.decode_attention(q, segs, return_lse=True, out=out)
    ref, ref_lse = decode_reference(q, segs)
    assert res is out and not out.isnan().any()
    assert rel(out, ref) < TOL and lse_close(lse, ref_lse)


def test_rows_without_tokens_merge_away():
    """A row with no valid token in any segment gives out 0 and lse -inf, as the reference; in one segment only,
    the other segment alone decides it."""
    g = torch.Generator().manual_seed(3)
    a = kivi_seg(2, 3, 64, 64, [64, 0], g=g)
    b = dense_seg(2, 3, 5, 64, [0, 0], dtype=torch.float32, g=g)
    q = torch.randn(2, 9, 64, generator=g)
    out, lse = cpu.decode_attention_cpu(q, [a, b])
    assert torch.isneginf(lse[1]).all() and out[1].abs().max() == 0
    alone, alone_lse = cpu.decode_attention_cpu(q[:1], [map_tensors(a, lambda t: t[:1])])
    assert rel(out[:1], alone) < TOL and torch.allclose(lse[:1], alone_lse, atol=1e-5)


def test_no_full_cache_copy(monkeypatch):
    """Quantized segments are read ``BLOCK`` tokens at a time into one reused buffer: it never holds more than one
    block of K and V, whatever the context."""
    monkeypatch.setattr(cpu, "BLOCK", 256)
    monkeypatch.setattr(cpu._LOCAL, "bufs", {}, raising=False)
    g = torch.Generator().manual_seed(11)
    seg = kivi_seg(1, 3, 4000, 64, [3999], g=g)
    q = torch.randn(1, 9, 64, generator=g)
    out, _ = cpu.decode_attention_cpu(q, [seg])
    assert [b.numel() for b in cpu._LOCAL.bufs.values()] == [2 * 3 * 256 * 64]
    assert rel(out, decode_reference(q, [seg])[0]) < TOL


def test_reference_switch(monkeypatch):
    """``MMKV_CPU_REFERENCE=1`` gives the torch reference itself (bit for bit)."""
    monkeypatch.setenv("MMKV_CPU_REFERENCE", "1")
    g = torch.Generator().manual_seed(5)
    segs = [kivi_seg(1, 3, 70, 64, [70], g=g)]
    q = torch.randn(1, 9, 64, generator=g)
    assert torch.equal(kernels.decode_attention(q, segs), decode_reference(q, segs)[0])


def test_non_contiguous_channels():
    """K/V whose channel stride is not 1 (a transposed view): the fused op misreads them unless copied."""
    g = torch.Generator().manual_seed(9)
    k = torch.randn(1, 3, 64, 50, generator=g).transpose(2, 3)
    v = torch.randn(1, 3, 64, 50, generator=g).transpose(2, 3)
    seg = kernels.DenseSeg(k, v, torch.tensor([50], dtype=torch.int32))
    q = torch.randn(1, 9, 64, generator=g)
    assert rel(cpu.decode_attention_cpu(q, [seg])[0], decode_reference(q, [seg])[0]) < TOL


@pytest.mark.parametrize("B,H,G,D,TQ", [(2, 3, 3, 64, 5), (1, 2, 4, 128, 17)], ids=["smollm2-5", "gqa4-17"])
def test_extend_history_matches_reference(B, H, G, D, TQ, monkeypatch):
    """Several new tokens (a later chat turn, chunked scoring) over the stored history, read in blocks."""
    monkeypatch.setattr(cpu, "BLOCK", 64)
    g = torch.Generator().manual_seed(TQ * 7 + D)
    segs = layer(B, H, D, g)
    q = torch.randn(B, H * G, TQ, D, generator=g)
    out, lse = cpu.history_attention_cpu(q, segs, 0.1)
    ref, ref_lse = attention_over_segments(q, segs, 0.1)
    assert rel(out, ref) < TOL and lse_close(lse, ref_lse)


def test_extend_causal_part_matches_reference():
    """The new tokens among themselves: causal, GQA, natural-log lse (what the merge with the history needs)."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 9, 13, 64, generator=g)
    k = torch.randn(2, 3, 13, 64, generator=g)
    v = torch.randn(2, 3, 13, 64, generator=g)
    out, lse = cpu.causal_attention_cpu(q, k, v, 0.125)
    ref, ref_lse = causal_partial(q, k, v, 0.125)
    assert rel(out, ref) < TOL and torch.allclose(lse, ref_lse, atol=1e-5)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dv", [5, 8, 12], ids=["bytes", "words", "words-3"])
def test_channel_codes_word_and_byte_paths(bits, dv):
    """Codes packed along channels, read four bytes at a time (rows of a multiple of 4 bytes) or byte by byte, on a
    token slice that starts mid-buffer: both equal ``unpack``."""
    g = torch.Generator().manual_seed(bits * 10 + dv)
    packed = torch.randint(0, 256, (2, 3, 11, dv), generator=g, dtype=torch.uint8)
    got = cpu._channel_codes(packed[:, :, 3:10], bits)
    assert torch.equal(got.to(torch.uint8), unpack(packed[:, :, 3:10], bits, dim=3))


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)], ids=["fp16", "bf16"])
def test_half_queries(dtype, tol):
    """fp16 queries are computed in fp32 (fp16 CPU attention is slow), bf16 in bf16; the result comes back in the
    query's dtype and agrees with the reference to the dtype's precision."""
    g = torch.Generator().manual_seed(13)
    segs = [kivi_seg(2, 3, 95, 64, [95, 31], g=g), dense_seg(2, 3, 9, 64, [9, 4], dtype=dtype, g=g)]
    q = torch.randn(2, 9, 64, generator=g).to(dtype)
    out = kernels.decode_attention(q, segs)
    assert out.dtype == dtype and rel(out, decode_reference(q.float(), segs)[0]) < tol


def test_buffers_in_and_out_of_inference_mode():
    """A step under torch.inference_mode, then one outside it (a test, a training script): each gets a buffer it
    may write."""
    g = torch.Generator().manual_seed(17)
    seg = kivi_seg(1, 3, 100, 64, [100], g=g)
    q = torch.randn(1, 9, 64, generator=g)
    with torch.inference_mode():
        inside, _ = cpu.decode_attention_cpu(q, [seg])
    outside, _ = cpu.decode_attention_cpu(q, [seg])
    assert torch.equal(inside, outside)
