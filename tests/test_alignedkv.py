"""AlignedKV: exact bit-plane storage, the precision-alignment rules on hand-made cases, bits-read accounting, the
method's spec and bytes, and the cache end to end on SmolLM2 (CPU: decode reads through the torch reference of the
aligned read). Kernel-vs-reference tests live in test_alignedkv_kernel.py (Triton interpreter)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels.layouts import AlignedSeg, DenseSeg, bits_fp16, fp16_bits, join_planes, split_planes
from kernels.reference import (
    aligned_attention,
    attention_over_segments,
    bits_read,
    decode_reference,
    dequant_aligned,
    key_levels,
    level_of_gap,
    output_estimate,
    value_levels,
    value_levels_paper,
)
from mmkv.cache import MMKVCache
from mmkv.methods import get_method
from mmkv.methods.alignedkv import AlignedKV
from mmkv.paths import EXCERPT
from mmkv.spec import CacheSpec, parse_method


def special_fp16(n: int, g: torch.Generator) -> torch.Tensor:
    """Random fp16 over the whole finite range: normals of every exponent, subnormals, +-0, +-65504."""
    bits = torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int32)
    bits = torch.where(((bits >> 10) & 31) == 31, bits & ~(1 << 14), bits)  # no inf/NaN: drop exponent 31
    x = bits_fp16(bits)
    extra = torch.tensor([0.0, -0.0, 65504.0, -65504.0, 6.0e-8, -6.0e-8, 6.1e-5, 1.0, -1.0], dtype=torch.float16)
    return torch.cat([x, extra])


def kv_like(b, h, t, d, g, outliers=True):
    """K with per-channel magnitudes spread over binades (the columnar pattern of real keys), V normal."""
    scale = torch.exp2(torch.randint(-4, 5, (1, 1, 1, d), generator=g).float()) if outliers else 1.0
    return (torch.randn(b, h, t, d, generator=g) * scale).half(), torch.randn(b, h, t, d, generator=g).half()


# ---------------------------------------------------------------------------------------------------------------
# storage
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [32, 64, 128])
def test_planes_roundtrip_is_bit_exact(block):
    g = torch.Generator().manual_seed(block)
    vals = special_fp16(2 * 3 * 2 * block * 8 - 9, g)
    x = vals[torch.randperm(len(vals), generator=g)].reshape(2, 3, 2 * block, 8)
    hi, mid, low, colmax = split_planes(x, block)
    assert hi.shape == (2, 3, 2, 8, block) and mid.shape == low.shape == (2, 3, 2, 8, block // 2)
    back = join_planes(hi, mid, low)
    assert torch.equal(fp16_bits(back), fp16_bits(x))  # bitwise: -0.0, subnormals and 65504 included
    assert torch.equal(fp16_bits(join_planes(hi, mid, low, torch.full_like(colmax, 16))), fp16_bits(x))


def test_method_pads_odd_lengths_and_dequantizes_exactly():
    g = torch.Generator().manual_seed(1)
    k, v = kv_like(2, 3, 63, 64, g)
    seg = AlignedKV(block=32).quantize(k.float(), v.float(), torch.tensor([63, 20]))
    assert seg.k_hi.shape[2] * seg.block == 64
    kd, vd = dequant_aligned(seg)
    assert torch.equal(kd[:, :, :63].half(), k) and torch.equal(vd[:, :, :63].half(), v)


def test_partial_reads_fill_with_one_then_zeros():
    x = torch.tensor([1.0, -1.0, 1.0 + 1023 / 1024, 3.0e-7], dtype=torch.float16).reshape(1, 1, 1, 4)
    x = x.expand(1, 1, 32, 4).contiguous()
    hi, mid, low, _ = split_planes(x, 32)
    bits = fp16_bits(x[0, 0, 0])
    for level, keep, fill in ((8, 0xFF00, 0x80), (12, 0xFFF0, 0x8), (16, 0xFFFF, 0)):
        read = join_planes(hi, mid, low, torch.full((1, 1, 1, 4), level))
        assert torch.equal(fp16_bits(read[0, 0, 0]), (bits & keep) | fill), level
    # the 100... fill is the midpoint of the bits not read: error at most half of their range
    read8 = join_planes(hi, mid, low, torch.full((1, 1, 1, 4), 8)).float()[0, 0, 0, :3]
    assert torch.all((read8 - x.float()[0, 0, 0, :3]).abs() <= x.float()[0, 0, 0, :3].abs() * 2.0**-3)


def test_colmax_counts_valid_tokens_only():
    x = torch.full((2, 1, 32, 2), 0.5, dtype=torch.float16)
    x[0, 0, 20, 0] = 1000.0  # valid in row 0
    x[1, 0, 20, 0] = 1000.0  # padding in row 1 (lens 10)
    _, _, _, colmax = split_planes(x, 32, torch.tensor([32, 10]))
    e = lambda v: (fp16_bits(torch.tensor(v, dtype=torch.float16)) >> 10).item()  # noqa: E731
    assert colmax[0, 0, 0].tolist() == [e(1000.0), e(0.5)]
    assert colmax[1, 0, 0].tolist() == [e(0.5), e(0.5)]


def test_out_of_fp16_range_raises():
    k = torch.ones(1, 1, 32, 16)
    k[0, 0, 3, 5] = 1.0e6
    with pytest.raises(ValueError, match="fp16 range"):
        AlignedKV().quantize(k, torch.ones_like(k), torch.tensor([32]))


# ---------------------------------------------------------------------------------------------------------------
# rules on hand-made cases
# ---------------------------------------------------------------------------------------------------------------


def field(e: int) -> int:
    """fp16 exponent field of a block whose largest |x| is in [2**e, 2**(e+1))."""
    return e + 15


def test_gap_to_bits():
    gaps = torch.tensor([-3, 0, 3, 4, 7, 8, 20])
    assert level_of_gap(gaps).tolist() == [16, 16, 16, 12, 12, 8, 8]


def test_rule1_keys_align_to_the_largest_addend():
    # channel: |q|, block max |k| -> product binade: 4+4, 3+1 (gap 4), 0-0 (gap 8), 2+3 (gap 3), q = 0
    q = torch.tensor([16.0, 8.0, 1.0, 4.0, 0.0]).reshape(1, 1, 1, 5)
    colmax = torch.tensor([field(4), field(1), field(0), field(3), field(7)], dtype=torch.uint8).reshape(1, 1, 1, 5)
    assert key_levels(q, colmax)[0, 0, 0, 0].tolist() == [16, 12, 8, 16, 8]
    # scaling q scales every addend: nothing changes; subnormal blocks count as 2**-14
    assert key_levels(q * 2.0**-20, colmax)[0, 0, 0, 0].tolist() == [16, 12, 8, 16, 8]
    sub = torch.tensor([field(-14), 0], dtype=torch.uint8).reshape(1, 1, 1, 2)
    assert key_levels(torch.ones(1, 1, 1, 2), sub)[0, 0, 0, 0].tolist() == [16, 16]


def test_rule2_values_align_to_the_output_estimate():
    # O_est channel d ~ 2**0; block 0 max p = 1/2 (floor log2 = -1), block 1 p = 2**-5.5 (floor -6), block 2 2**-12
    logp = torch.tensor([-1.0, -5.5, -12.0]).reshape(1, 1, 1, 3)
    o_est = torch.tensor([1.5, 1.5]).reshape(1, 1, 1, 2)
    colmax = torch.tensor([[field(0), field(3)]] * 3, dtype=torch.uint8).reshape(1, 1, 3, 2)
    lv = value_levels(logp, o_est, colmax)[0, 0, 0]
    # addend bound floor(log2 p) + e + 1: block 0 -> 0 / 3, block 1 -> -5 / -2, block 2 -> -11 / -8; gap = 0 - that
    assert lv.tolist() == [[16, 16], [12, 16], [8, 8]]
    # a zero estimate (E = -127) can only ask for more bits
    assert value_levels(logp, torch.zeros(1, 1, 1, 2), colmax)[0, 0, 0].tolist() == [[16, 16]] * 3


def test_paper_rule_binade_thresholds_by_hand():
    """values=paper (the authors' value kernel): T_d = E(sum p|v|) - 1 - e_d; 16 bits if log2 max p > T - 1, 12 if
    T - 2 < log2 max p <= T - 1, else 8. Here o_abs in [1, 2) (E = 0) and |v| < 2**0 (field 14, e = -1): T = 0."""
    logp = torch.tensor([-0.5, -1.0, -1.5, -2.0, -2.5, -9.0]).reshape(1, 1, 1, 6)
    o_abs = torch.tensor([1.5]).reshape(1, 1, 1, 1)
    colmax = torch.full((1, 1, 6, 1), field(-1), dtype=torch.uint8)
    # p = 2**-0.5 > 2**(T-1) -> 16; p = 2**-1 = 2**(T-1) and 2**-1.5 -> 12; p = 2**-2 = 2**(T-2) and below -> 8
    assert value_levels_paper(logp, o_abs, colmax)[0, 0, 0, :, 0].tolist() == [16, 12, 12, 8, 8, 8]
    # T moves with each term: o_abs 8x larger (E = 3) -> T = 3, every gap >= 3.5 -> 8; o_abs 8x smaller (E = -3)
    # -> T = -3 and a block 4x larger (e = 1) -> T = -2: only log2 p = -9 is >= 2 binades below -> 8; zero -> 16
    assert value_levels_paper(logp, o_abs * 8, colmax)[0, 0, 0, :, 0].tolist() == [8] * 6
    assert value_levels_paper(logp, o_abs / 8, colmax)[0, 0, 0, :, 0].tolist() == [16] * 5 + [8]
    assert value_levels_paper(logp, o_abs, colmax + 2)[0, 0, 0, :, 0].tolist() == [16] * 5 + [8]
    assert value_levels_paper(logp, torch.zeros(1, 1, 1, 1), colmax)[0, 0, 0, :, 0].tolist() == [16] * 6
    # the conservative rule on the same blocks reads more: gap = E(o) - (floor(log2 p) + e + 1) = 1, 1, 2, 2, 3, 9
    # binades, 16 bits below 4, 12 below 8
    assert value_levels(logp, o_abs, colmax)[0, 0, 0, :, 0].tolist() == [16] * 5 + [8]


def test_paper_rule_read_by_hand():
    """The whole aligned read with values=paper on a segment small enough to work out on paper (block 2, D = 2).

    q = (1, 0) and sm_scale = 1/log2(e): the log2-unit logits are k[:, 0] = 0, -1 | -3, -4 (block A | block B), so
    p = (1, 1/2, 1/8, 1/16) / (27/16): block tops p_A = 16/27 (log2 -0.755), p_B = 2/27 (log2 -3.755).
    V: channel 0 = 1 everywhere (field 15, e = 0); channel 1 = 1 in block A, 2**-4 in block B (e = -4).
    o_abs (top token of each block, V read at 8 bits = x 1.125): ch0 1.125 (p_A + p_B) = 0.75 (E = -1);
    ch1 1.125 (p_A + p_B / 16) = 0.672 (E = -1).
    T = E(o_abs) - 1 - e: block A (-2, -2); block B (-2, 2). gap = T - log2 p: A (-1.25, -1.25) -> 16, 16;
    B (1.75, 5.75) -> 12, 8. The conservative rule reads B at (16, 12) (gap 2 and 6 binades below E(o) = -1)."""
    k = torch.tensor([[0.0, 0.0], [-1.0, 0.0], [-3.0, 0.0], [-4.0, 0.0]]).reshape(1, 1, 4, 2).half()
    v = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 2**-4], [1.0, 2**-4]]).reshape(1, 1, 4, 2).half()
    q = torch.tensor([1.0, 0.0]).reshape(1, 1, 2)
    n = torch.tensor([4], dtype=torch.int32)
    seg = AlignedSeg(*split_planes(k, 2, n), *split_planes(v, 2, n), block=2, lens=n)
    assert seg.values == "paper" and AlignedKV().values == "paper"  # the default
    out, lse, lk, lv = aligned_attention(q, seg, 1 / math.log2(math.e))
    assert lv[0, 0].tolist() == [[16, 16], [12, 8]]
    assert lk[0, 0, :, 0].tolist() == [16, 16]  # channel 0 carries the logit; q_1 = 0 makes channel 1's addend 0
    w = torch.tensor([1, 1 / 2, 1 / 8, 1 / 16], dtype=torch.float64)
    p = w / w.sum()
    # block B read: 1.0 = 0x3C00 at 12 bits -> 0x3C08 = 1 + 2**-7; 2**-4 = 0x2C00 at 8 bits -> 0x2C80 = 1.125 * 2**-4
    want = [p[:2].sum() + p[2:].sum() * (1 + 2**-7), p[:2].sum() + p[2:].sum() * 1.125 * 2**-4]
    assert out.flatten().tolist() == pytest.approx([float(x) for x in want], rel=1e-6)
    assert lse.item() == pytest.approx(math.log(w.sum()), rel=1e-6)
    _, _, _, lv_c = aligned_attention(q, dataclasses.replace(seg, values="conservative"), 1 / math.log2(math.e))
    assert lv_c[0, 0].tolist() == [[16, 16], [16, 12]]


def test_paper_rule_estimates_the_sum_of_magnitudes():
    """values=paper estimates sum p |v| (sign bit dropped, as the authors' code does): opposite-signed tops do not
    cancel in the estimate."""
    v = torch.tensor([[-1.0], [0.5], [1.0], [0.5]], dtype=torch.float16).reshape(1, 1, 4, 1)
    hi = split_planes(v, 2)[0]
    x = torch.tensor([1.0, 0.0, 1.0, 0.0]).reshape(1, 1, 1, 4)  # tops: token 0 (-1) and token 2 (+1)
    lse2 = torch.tensor([math.log2(2 * 2 + 2 * 1)]).reshape(1, 1, 1)
    signed = output_estimate(x, lse2, hi, 2)
    absolute = output_estimate(x, lse2, hi, 2, absolute=True)
    assert signed.flatten().tolist() == pytest.approx([0.0])
    assert absolute.flatten().tolist() == pytest.approx([2 * (2 / 6) * 1.125])


def test_output_estimate_takes_each_blocks_top_token_at_8_bits():
    block = 4
    v = torch.tensor([[0.1], [7.0], [0.2], [0.3], [-3.0], [0.4], [0.5], [0.6]], dtype=torch.float16)
    v = v.reshape(1, 1, 8, 1).expand(1, 1, 8, 16).contiguous()
    hi, _, _, _ = split_planes(v, block)
    x = torch.tensor([0.0, 5.0, 1.0, 1.0, 4.0, 2.0, 2.0, 2.0]).reshape(1, 1, 1, 8)  # tops: token 1, token 4
    lse2 = torch.logsumexp(x / 1.4426950408889634, -1) * 1.4426950408889634
    est = output_estimate(x, lse2, hi, block)
    v8 = bits_fp16((fp16_bits(v[0, 0, :, 0]) & 0xFF00) | 0x80).float()
    want = torch.exp2(5.0 - lse2) * v8[1] + torch.exp2(4.0 - lse2) * v8[4]
    assert torch.allclose(est[0, 0, 0], want.reshape(1).expand(16), rtol=1e-6)


def test_gqa_group_reads_the_widest_need():
    d = 4
    colmax = torch.tensor([field(4), field(0), field(0), field(0)], dtype=torch.uint8).reshape(1, 1, 1, d)
    q = torch.tensor([[16.0, 1.0, 1.0, 1.0], [1.0, 16.0, 1.0, 1.0]]).reshape(1, 1, 2, d)
    per_head = key_levels(q, colmax)[0, 0, :, 0]
    assert per_head.tolist() == [[16, 8, 8, 8], [16, 16, 12, 12]]
    k = torch.zeros(1, 1, 32, d, dtype=torch.float16)
    k[..., 0], k[..., 1:] = 17.0, 1.5
    seg = AlignedKV(block=32).quantize(k, k.clone(), torch.tensor([32]))
    _, _, lk, _ = aligned_attention(q.reshape(1, 2, d), seg)
    assert lk[0, 0, 0].tolist() == [16, 16, 12, 12]


def test_rules_switch_off_and_floor():
    g = torch.Generator().manual_seed(4)
    k, v = kv_like(1, 2, 96, 32, g)
    seg = AlignedKV(block=32).quantize(k, v, torch.tensor([90]))
    q = torch.randn(1, 4, 32, generator=g) * 4
    _, _, lk, lv = aligned_attention(q, seg)
    assert set(lk.unique().tolist()) > {16}  # the data exercises narrower reads
    for kw, want_k, want_v in ((dict(keys="full"), {16}, None), (dict(values="full"), None, {16}),
                               (dict(min_bits=12), {12, 16}, {12, 16}), (dict(force_bits=8), {8}, {8})):
        _, _, lk2, lv2 = aligned_attention(q, dataclasses.replace(seg, **kw))
        if want_k is not None:
            assert set(lk2.unique().tolist()) <= want_k, kw
        if want_v is not None:
            assert set(lv2.unique().tolist()) <= want_v, kw


# ---------------------------------------------------------------------------------------------------------------
# accounting and full-precision equivalence
# ---------------------------------------------------------------------------------------------------------------


def test_bits_read_accounting():
    levels = torch.tensor([[16, 8], [12, 12], [0, 0]], dtype=torch.uint8).reshape(1, 1, 3, 2)
    # 40 valid tokens of block 32: 32 tokens of block 0 and 8 of block 1; block 2 holds none
    want = (32 * (16 + 8) + 8 * (12 + 12)) / (40 * 2)
    assert bits_read(levels, torch.tensor([40]), 32) == pytest.approx(want)
    g = torch.Generator().manual_seed(6)
    k, v = kv_like(2, 3, 100, 32, g)
    seg = AlignedKV(block=32).quantize(k, v, torch.tensor([100, 0]))
    _, lse, lk, lv = aligned_attention(torch.randn(2, 3, 32, generator=g), seg)
    assert torch.all(lk[1] == 0) and torch.all(lv[1] == 0) and torch.isneginf(lse[1]).all()
    assert torch.all(lk[0, :, :4] > 0) and 8 <= bits_read(lk, seg.lens, 32) <= 16


def test_sixteen_bits_everywhere_is_exact_fp16_attention():
    g = torch.Generator().manual_seed(7)
    k, v = kv_like(2, 3, 150, 64, g)
    lens = torch.tensor([150, 77])
    seg = AlignedKV(min_bits=16).quantize(k, v, lens)
    q = torch.randn(2, 9, 64, generator=g)
    out, lse, lk, lv = aligned_attention(q, seg)
    ref, ref_lse = attention_over_segments(q.unsqueeze(2), [DenseSeg(k, v, lens)])
    # the same fp16 values: only fp32 rounding differs (exp2 in log2 units vs exp)
    assert ((out - ref.squeeze(2)).norm() / ref.norm()).item() < 1e-5
    assert torch.allclose(lse, ref_lse.squeeze(2), rtol=1e-6, atol=1e-5)
    assert bits_read(lk, lens, 64) == 16 and bits_read(lv, lens, 64) == 16


def test_cpu_decode_path_uses_the_aligned_read(monkeypatch):
    """kernels.decode_attention on CPU (no interpreter) reads an AlignedSeg as the kernel would, merged with the
    other segments; attention_over_segments (prefill/extend reference) stays at full precision."""
    import kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(8)
    k, v = kv_like(2, 3, 128, 64, g)
    seg = AlignedKV().quantize(k, v, torch.tensor([128, 90]))
    dense = DenseSeg(*kv_like(2, 3, 5, 64, g, outliers=False), torch.tensor([5, 2], dtype=torch.int32))
    q = torch.randn(2, 9, 64, generator=g) * 3
    out, lse = kernels.decode_attention(q, [dense, seg], return_lse=True)
    want, want_lse = decode_reference(q, [dense, seg])
    # the method's planes are contiguous, so the compiled CPU loops read them (fp32 sums in their own order: ~2e-6
    # relative; a strided plane used to fall back to the torch reference itself)
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-4)
    o_seg, l_seg, _, _ = aligned_attention(q, seg)
    o_d, l_d = attention_over_segments(q.unsqueeze(2), [dense])
    w = torch.softmax(torch.stack([l_d.squeeze(2), l_seg]), 0)
    assert torch.allclose(out, w[0, ..., None] * o_d.squeeze(2) + w[1, ..., None] * o_seg, rtol=1e-4, atol=1e-5)
    full = attention_over_segments(q.unsqueeze(2), [dense, seg])[0].squeeze(2)
    assert not torch.equal(out, full)  # the aligned read is not the full-precision one


# ---------------------------------------------------------------------------------------------------------------
# method: spec, validation, bytes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["alignedkv", "alignedkv:block=32", "alignedkv:block=128,values=full,min_bits=12",
                                  "alignedkv:values=conservative",
                                  "alignedkv:keys=full,min_bits=16"])
def test_spec_roundtrip(text):
    m = parse_method(text, "text")
    assert str(m) == text and parse_method(str(m), "text") == m
    spec = CacheSpec.parse(f"visual={text} text={text} window=0 sinks=0")
    assert CacheSpec.parse(str(spec)).text == m and spec.visual == m
    assert get_method("alignedkv") is AlignedKV


@pytest.mark.parametrize("bad,match", [("block=48", r"allowed values: \[32, 64, 128\]"),
                                       ("values=rule2", r"allowed values: \['paper', 'conservative', 'full'\]"),
                                       ("min_bits=10", r"allowed values: \[8, 12, 16\]"),
                                       ("keys=rule2", r"allowed values: \['rule1', 'full'\]")])
def test_bad_parameters_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_method(f"alignedkv:{bad}", "text")


def test_head_dim_check():
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        MMKVCache("text=alignedkv", num_layers=2, head_dim=80)


def test_cache_bytes_are_16_bits_plus_colmax():
    h, d, layers = 3, 64, 2
    cache = MMKVCache("text=alignedkv window=0 sinks=0", num_layers=layers, head_dim=d)
    g = torch.Generator().manual_seed(9)
    for layer in range(layers):
        cache.update(*kv_like(1, h, 300, d, g), layer)
    cache.finalize()
    seg = cache.layers[0].text
    assert isinstance(seg, AlignedSeg) and cache.layers[0].text_len == [256]
    assert cache.effective_bits()["text"] == pytest.approx(16 + 8 / 64)
    assert cache.nbytes_by_modality(used=True)["text"] == layers * 2 * h * 256 * (2 * d + d / 64)


def test_visual_span_and_decode_through_the_cache(monkeypatch):
    """Visual tokens may use alignedkv too: the span becomes one AlignedSeg (exact), decode merges it with text."""
    import kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(10)
    cache = MMKVCache("visual=alignedkv:block=32 text=alignedkv:block=32 window=8 sinks=2", num_layers=1, head_dim=32)
    k, v = kv_like(2, 2, 120, 32, g)
    visual = torch.zeros(2, 120, dtype=torch.bool)
    visual[:, 10:60] = True
    cache.set_inputs(torch.ones(2, 120, dtype=torch.long), visual)
    cache.update(k, v, 0)
    cache.finalize()
    layer = cache.layers[0]
    (vis,) = layer.visual
    assert isinstance(vis, AlignedSeg) and vis.lens.tolist() == [50, 50]
    assert torch.equal(dequant_aligned(vis)[0][:, :, :50].half(), k[:, :, 10:60])
    assert isinstance(layer.text, AlignedSeg) and layer.text_len == [32, 32]  # 70 text - 2 sinks - 8 window = 60: 1 block
    q = torch.randn(2, 4, 32, generator=g)
    out = kernels.decode_attention(q, layer.segments())
    assert torch.allclose(out, decode_reference(q, layer.segments())[0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# end to end on SmolLM2
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_scores_through_the_aligned_cache(smollm2):
    """50 WikiText-2 tokens scored token by token (every prediction a decode step over the AlignedKV segment): the
    exact read (min_bits=16) matches a parallel model-dtype pass up to fp16 storage; the aligned read matches it."""

    import torch.nn.functional as F

    from mmkv import Engine

    eng = Engine(smollm2)
    text = (EXCERPT / "test.txt").read_text()[:2000]
    ids = eng.tokenizer(text, return_tensors="pt").input_ids[:, :50]
    with torch.inference_mode():
        logits = eng.model(input_ids=ids).logits[0, :-1].float()
    parallel = F.cross_entropy(logits, ids[0, 1:]).item()
    exact_s, aligned_s = "text=alignedkv:block=32,min_bits=16 window=0 sinks=0", "text=alignedkv:block=32 window=0 sinks=0"
    res = {s: eng.score(ids, spec=s) for s in (exact_s, aligned_s)}
    nll = {s: r["nll"] / r["tokens"] for s, r in res.items()}
    assert math.isfinite(nll[aligned_s]) and abs(nll[exact_s] - parallel) < 5e-3 * parallel
    assert abs(nll[aligned_s] - nll[exact_s]) < 5e-3 * nll[exact_s]
    stats = res[aligned_s]["stats"]
    assert stats["effective_bits"]["text"] == pytest.approx(16.25)
    assert stats["cache_tokens"]["text"] == 32  # 49 tokens fed: one whole block of 32 left the window
