"""The CPU decode path (``kernels/decode/cpu.py``) against the torch reference it replaces on the CPU.

Random, odd-sized inputs: ragged ``lens`` (rows with no token at all included), GQA groups 1-8, head_dim 64 and
128, every layout (dense fp32/fp16, KIVI/XQuant at 1/2/4 bits, channel-wise with one or several scale blocks,
calibrated channel segments, SKVQ, AlignedKV) and blocks small enough that a segment is read in several. The
fused CPU attention accumulates in another order than the reference: outputs agree to 2e-5 relative (fp32).
One row with one new token over a short history takes the compiled one-row path instead (tests/test_cpu_row.py);
here it is switched off, so these inputs reach the block path they test.
"""

from __future__ import annotations

import pytest
import torch

import kernels
import kernels.decode.cpu as cpu
import kernels.decode.cpu_join as cpu_join
import kernels.decode.cpu_native as cpu_native
import kernels.decode.cpu_row as cpu_row
from kernels.layouts import unpack
from kernels.reference import attention_over_segments, decode_reference
from kernels.testing import aligned_seg, channel_seg, dense_seg, kivi_seg, map_tensors, skvq_seg
from mmkv.attention import causal_partial
from mmkv.methods.alignedkv import AlignedKV

TOL = 2e-5


@pytest.fixture(autouse=True)
def _block_path(monkeypatch):
    monkeypatch.setattr(cpu_row, "ROW_TOKENS", 0)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def lse_close(a, b) -> bool:
    fin = torch.isfinite(b)
    return bool(torch.equal(fin, torch.isfinite(a)) and torch.allclose(a[fin], b[fin], atol=1e-4, rtol=1e-5))


def close(got, want):
    """The compiled loops round ``code * scale + zero`` once (a fused multiply-add), torch twice: 1e-6 of O(1)."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def layer(B, H, D, g):
    lens = [[301, 0, 170][:B], [96, 50, 1][:B], [200, 50, 7][:B], [256, 3, 129][:B]]
    return [
        dense_seg(B, H, 4, D, [4] * B, dtype=torch.float32, g=g),  # sinks
        kivi_seg(B, H, 301, D, lens[0], g=g),
        kivi_seg(B, H, 200, D, lens[2], k_bits=1, v_bits=4, block=64, group=16, g=g),
        kivi_seg(B, H, 96, D, lens[1], v_bits=1, group=4, g=g),  # groups of half a byte: not in lanes
        channel_seg(B, H, 96, D, 2, lens[1], None, g=g),  # one scale block (read whole)
        channel_seg(B, H, 256, D, 4, lens[3], None, block=32, g=g),  # several blocks (read in blocks)
        channel_seg(B, H, 200, D, 1, lens[2], (0.0, 3.0), g=g),  # calibrated: the reference
        skvq_seg(B, H, 77, D, lens[1], g=g),
        aligned_seg(B, H, 65, D, [65, 64, 2][:B], AlignedKV(block=32).quantize, g=g),  # reads its own bits
        dense_seg(B, H, 37, D, [37, 1, 20][:B], g=g),  # fp16 window
    ]


@pytest.fixture(params=["native", "torch"])
def dequant(request, monkeypatch):
    """Both ways the CPU path dequantizes: the compiled C loops and torch operations."""
    monkeypatch.setenv("MMKV_CPU_NATIVE", "1" if request.param == "native" else "0")
    if request.param == "native" and cpu_native.library() is None:
        pytest.skip("no C compiler: the compiled loops are unavailable")
    return request.param


@pytest.mark.parametrize("B,H,G,D", [(2, 3, 3, 64), (3, 2, 4, 128), (1, 1, 8, 64), (2, 4, 1, 64)],
                         ids=["smollm2-9x3", "gqa4-d128", "gqa8", "mha"])
@pytest.mark.parametrize("block", [64, 2048], ids=["blocks-64", "blocks-2048"])
def test_cpu_path_matches_reference(B, H, G, D, block, dequant, monkeypatch):
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


def test_no_full_cache_copy(dequant, monkeypatch):
    """Quantized segments are read ``BLOCK`` tokens at a time into one reused buffer: it never holds more than one
    block of K and V, whatever the context."""
    monkeypatch.setattr(cpu, "BLOCK", 256)
    monkeypatch.setattr(cpu._LOCAL, "bufs", {}, raising=False)
    g = torch.Generator().manual_seed(11)
    seg = kivi_seg(1, 3, 4000, 64, [3999], g=g)
    q = torch.randn(1, 9, 64, generator=g)
    out, _ = cpu.decode_attention_cpu(q, [seg])
    sizes = {key[0]: b.numel() for key, b in cpu._LOCAL.bufs.items()}
    want = {torch.float32: 2 * 3 * 256 * 64}  # fp32 K and V of one block
    if dequant == "torch":  # and int32 words holding one block's key codes a byte each
        want[torch.int32] = 3 * 256 * 64 // 4
    assert sizes == want
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


@pytest.mark.parametrize("bits,group", [(1, 32), (1, 16), (2, 32), (2, 64), (4, 32), (4, 8), (2, 24)])
@pytest.mark.parametrize("d", [64, 128])
def test_compiled_value_loop(bits, group, d):
    """The compiled loop for token-wise groups, on a token slice that starts mid-buffer with a (batch, head) stride
    larger than the slice: every value is ``code * scale + zero`` of its group (computed here from ``unpack``),
    at the position ``lane_order`` names, and the un-lane index restores channel order."""
    if d % group:
        pytest.skip("groups tile the head")
    if cpu_native.library() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(bits * 1000 + d + group)
    per = 8 // bits
    packed = torch.randint(0, 256, (2, 3, 13, d // per), generator=g, dtype=torch.uint8)
    scale = torch.rand(2, 3, 13, d // group, generator=g) + 0.5
    zero = torch.randn(2, 3, 13, d // group, generator=g)
    codes = unpack(packed[:, :, 5:12], bits, dim=3).float()
    want = codes * scale[:, :, 5:12].repeat_interleave(group, -1) + zero[:, :, 5:12].repeat_interleave(group, -1)
    out = torch.full((2, 3, 9, d), float("nan"))[:, :, :7]
    got = cpu_native.dequant_groups(packed[:, :, 5:12], scale[:, :, 5:12].contiguous(),
                                    zero[:, :, 5:12].contiguous(), bits, group, out)
    order = cpu_native.lane_order(bits, d)
    assert sorted(order.tolist()) == list(range(d))
    close(got, want[..., order])
    close(got.index_select(-1, cpu._unlane_index(bits, d)), want)


@pytest.mark.parametrize("bits,block", [(1, 32), (2, 32), (4, 64), (8, 32)])
def test_compiled_token_loop(bits, block):
    """The compiled loop for codes packed along tokens (keys), from a block-aligned row mid-buffer, fewer tokens
    than whole blocks: ``code * scale + zero`` of the token's block, the rest of the output untouched (NaN)."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(bits * 7 + block)
    per = 8 // bits
    packed = torch.randint(0, 256, (2, 3, 4 * block // per, 64), generator=g, dtype=torch.uint8)
    scale = torch.rand(2, 3, 4, 64, generator=g) + 0.5
    zero = torch.randn(2, 3, 4, 64, generator=g)
    n = 2 * block - 5
    codes = unpack(packed[:, :, block // per:], bits, dim=2).float()[:, :, :n]
    blk = torch.arange(n) // block
    want = codes * scale[:, :, 1:][:, :, blk] + zero[:, :, 1:][:, :, blk]
    out = torch.full((2, 3, 2 * block, 64), float("nan"))
    got = cpu_native.dequant_tokens(packed[:, :, block // per:], scale[:, :, 1:].contiguous(),
                                    zero[:, :, 1:].contiguous(), bits, block, n, out)
    close(got, want)
    assert out[:, :, n:].isnan().all()


def test_compiled_loops_refuse_other_layouts():
    """A layout the loops would read wrongly (codes whose (batch, head) rows are not at one stride, fp16 output)
    is refused with an error, never read."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler")
    codes = torch.zeros(2, 3, 8, 16, dtype=torch.uint8).transpose(0, 1)
    s = torch.ones(3, 2, 8, 2)
    with pytest.raises(ValueError, match="layout"):
        cpu_native.dequant_groups(codes, s, s, 2, 32, torch.empty(3, 2, 8, 64))
    with pytest.raises(ValueError, match="layout"):
        cpu_native.dequant_groups(codes.transpose(0, 1), s.transpose(0, 1).contiguous(), s.transpose(0, 1).contiguous(),
                                  2, 32, torch.empty(2, 3, 8, 64, dtype=torch.float16))


def test_compiled_loops_switch_off(monkeypatch):
    """``MMKV_CPU_NATIVE=0`` gives back the torch operations, at any time."""
    monkeypatch.setenv("MMKV_CPU_NATIVE", "0")
    assert cpu_native.library() is None


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_token_packed_codes_word_path(bits):
    """Keys packed along tokens, read as int32 words (four channels at once) from a row slice mid-buffer: equal to
    ``unpack`` along tokens, and to the byte path on a row whose width is not a multiple of 4."""
    g = torch.Generator().manual_seed(bits)
    packed = torch.randint(0, 256, (2, 3, 9, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(cpu._tokens_unpacked(packed, bits, 2, 7), unpack(packed[:, :, 2:7], bits, dim=2))
    odd = packed[..., :63]
    assert cpu._words(odd) is None
    assert torch.equal(cpu._tokens_unpacked(odd, bits, 2, 7), unpack(odd[:, :, 2:7], bits, dim=2))


def test_lanes_only_where_groups_hold_whole_bytes(monkeypatch):
    """Values go through the compiled loop (lane order) only with whole bytes per group and an fp32 buffer."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(3)
    assert cpu._lanes_fit(kivi_seg(1, 2, 64, 64, [64], v_bits=2, group=16, g=g), torch.float32)
    assert not cpu._lanes_fit(kivi_seg(1, 2, 64, 64, [64], v_bits=2, group=16, g=g), torch.bfloat16)
    assert not cpu._lanes_fit(kivi_seg(1, 2, 64, 64, [64], v_bits=1, group=4, g=g), torch.float32)
    assert not cpu._lanes_fit(kivi_seg(1, 2, 64, 64, [64], v_bits=8, group=16, g=g), torch.float32)
    monkeypatch.setenv("MMKV_CPU_NATIVE", "0")
    assert not cpu._lanes_fit(kivi_seg(1, 2, 64, 64, [64], v_bits=2, group=16, g=g), torch.float32)


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


def test_block_tokens_bounded_by_bytes(monkeypatch):
    """A block holds up to BLOCK tokens, and at most BLOCK_BYTES of fp32 K + V but never fewer than MIN_BLOCK
    tokens; always a multiple of the segment's scale block."""
    g = torch.Generator().manual_seed(5)
    small = kivi_seg(1, 3, 64, 64, [64], g=g)  # 1536 bytes a token: BLOCK_BYTES holds 10922 -> 10240
    big = kivi_seg(8, 8, 64, 128, [64] * 8, g=g)  # 64 KiB a token: fewer than MIN_BLOCK fit
    assert cpu._block_tokens(small, torch.float32) == 10240
    assert cpu._block_tokens(small, torch.bfloat16) == cpu.BLOCK
    assert cpu._block_tokens(big, torch.float32) == cpu.MIN_BLOCK
    monkeypatch.setattr(cpu, "BLOCK", 64)
    assert cpu._block_tokens(small, torch.float32) == 64


@pytest.mark.parametrize("join,calls", [(1024, 1), (8, 2)], ids=["joined", "too-long-to-join"])
def test_single_row_dense_segments_joined(join, calls, monkeypatch):
    """One row's dense segments only (one of them empty; the longest fp16, so no room past its tokens in the
    compute dtype) are attended as one copy, or each on its own past ``JOIN_TOKENS``: both equal the reference."""
    monkeypatch.setattr(cpu_join, "JOIN_TOKENS", join)
    g = torch.Generator().manual_seed(23)
    segs = [dense_seg(1, 3, 4, 64, [4], dtype=torch.float32, g=g),
            dense_seg(1, 3, 16, 64, [0], dtype=torch.float32, g=g), dense_seg(1, 3, 37, 64, [29], g=g)]
    assert segs[2].k.dtype == torch.float16
    q = torch.randn(1, 9, 64, generator=g)
    seen = []
    real = cpu._attend
    monkeypatch.setattr(cpu, "_attend", lambda *a: seen.append(1) or real(*a))
    out, lse = cpu.decode_attention_cpu(q, segs, 0.1)
    ref, ref_lse = decode_reference(q, segs, 0.1)
    assert rel(out, ref) < TOL
    assert lse_close(lse, ref_lse) and len(seen) == calls


def _one_row_host(kind, g):
    """One row's host segment (the longest read in blocks, or a dense one) for the join test."""
    if kind == "kivi":
        return kivi_seg(1, 3, 301, 64, [299], g=g)
    if kind == "skvq":
        return skvq_seg(1, 3, 203, 64, [203], v_bits=1.5, g=g)
    if kind == "channel-whole":  # one scale block: read whole, no room
        return channel_seg(1, 3, 96, 64, 2, [90], None, g=g)
    cap = 300 if kind == "dense-slack" else 260
    return dense_seg(1, 3, cap, 64, [260], dtype=torch.float32, g=g)


@pytest.mark.parametrize("kind,calls", [("kivi", 5), ("skvq", 4), ("channel-whole", 3), ("dense-slack", 1),
                                        ("dense-full", 3)])
def test_single_row_tails_join_the_host(kind, calls, monkeypatch):
    """One row: the sinks' and the window's tokens go after the host's last block (in its channel positions:
    KIVI's lanes, SKVQ's permuted positions) or into a dense host's capacity past its tokens, one fused call in
    all; a host without room (read whole, or full) leaves them to calls of their own. Equal to the reference. Blocks
    of 64 tokens: the tails join the last one."""
    monkeypatch.setattr(cpu_join, "JOIN_TOKENS", 8)
    monkeypatch.setattr(cpu, "BLOCK", 64)
    if kind == "skvq" and cpu_native.library() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(len(kind))
    segs = [dense_seg(1, 3, 4, 64, [4], dtype=torch.float32, g=g), _one_row_host(kind, g),
            dense_seg(1, 3, 40, 64, [33], dtype=torch.float32, g=g)]
    q = torch.randn(1, 12, 64, generator=g)
    seen = []
    real = cpu._attend
    monkeypatch.setattr(cpu, "_attend", lambda *a: seen.append(a[2].shape[2]) or real(*a))
    out, lse = cpu.decode_attention_cpu(q, segs, 0.1)
    ref, ref_lse = decode_reference(q, segs, 0.1)
    assert rel(out, ref) < TOL and lse_close(lse, ref_lse)
    assert len(seen) == calls
    if kind == "dense-slack":  # the tails' tokens now lie past the host's own
        assert torch.equal(segs[1].k[:, :, 260:264], segs[0].k) and torch.equal(segs[1].v[:, :, 264:297],
                                                                                 segs[2].v[:, :, :33])


def test_inference_tensors_are_not_written_outside_inference_mode():
    """A dense host made under ``torch.inference_mode`` and read outside it: its capacity cannot be written there,
    so the tails are attended on their own (no error)."""
    g = torch.Generator().manual_seed(31)
    with torch.inference_mode():
        segs = [dense_seg(1, 3, 2000, 64, [1500], dtype=torch.float32, g=g),
                dense_seg(1, 3, 40, 64, [33], dtype=torch.float32, g=g)]
    q = torch.randn(1, 9, 64, generator=g)
    out, _ = cpu.decode_attention_cpu(q, segs, 0.1)
    assert rel(out, decode_reference(q, segs, 0.1)[0]) < TOL


def test_cached_index_tables_stay_on_the_host_whatever_the_default_device():
    # made first under torch.set_default_device("meta") (the multi-GPU tests do that), a cached table used to stay
    # on the meta device and break every later CPU decode of the process
    from kernels.decode import cpu, cpu_native, cpu_planes

    cpu._UNLANE.clear()
    cpu_planes._ORDER.clear()
    torch.set_default_device("meta")
    try:
        tables = [cpu_native.lane_order(2, 64), cpu._unlane_index(1, 64), cpu_planes.block_order(8, 24),
                  cpu_planes.skvq_positions(1.5, 10)]
    finally:
        torch.set_default_device(None)
    assert all(t.device.type == "cpu" for t in tables)
    assert torch.equal(cpu._unlane_index(1, 64), torch.argsort(cpu_native.lane_order(1, 64)))
