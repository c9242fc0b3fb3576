"""The torch references of kernels/reference.py (and mmkv/attention.py's causal partial, which the extend path merges
with the reference's history partial) against values worked out by hand from their definitions.

Every expected number below is written out from the layout text at the top of kernels/reference.py or from the
paper's formula (CalibQuant Eq. 4 and Sec. 2.3; softmax attention; log-sum-exp merging), never from mmkv's output.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.layouts import (
    AlignedSeg,
    ChannelSeg,
    DenseSeg,
    KiviSeg,
    pack,
    pack_planes,
    pack_ternary,
    per_byte,
    plane_bits,
    split_planes,
    unpack,
    unpack_planes,
    unpack_ternary,
)
from kernels.reference import (
    _LOG2E,
    _fp16_exp,
    aligned_attention,
    attention_over_segments,
    bits_read,
    calibrate_logits,
    decode_attention_ref,
    decode_reference,
    dequant_channel,
    dequant_token_groups,
    dequantize_segment,
    key_levels,
    level_of_gap,
    merge_partials,
    output_estimate,
    rms_norm,
    rotary,
    segment_logits,
    silu_mul,
    value_levels,
)
from mmkv.attention import causal_partial, mmkv_attention


def tokens(values, dtype=torch.uint8):
    """``[1, 1, T, 1]``: one row, one head, T tokens of one channel."""
    return torch.tensor(values, dtype=dtype).reshape(1, 1, -1, 1)


def test_per_byte_is_eight_over_bits_and_rejects_unpackable_widths():
    assert [per_byte(b) for b in (1, 2, 4, 8)] == [8, 4, 2, 1]
    for bad in (0, 3, 5, 16):
        with pytest.raises(ValueError):
            per_byte(bad)


@pytest.mark.parametrize("bits,codes,byte", [
    (1, [1, 0, 1, 1, 0, 0, 0, 1], 1 + 4 + 8 + 128),          # token i in bit i
    (2, [1, 2, 3, 0], 1 + (2 << 2) + (3 << 4) + (0 << 6)),   # = 57
    (2, [3, 3, 3, 3], 255),
    (4, [5, 12], 5 + 12 * 16),                               # = 197
    (8, [200], 200),
])
def test_pack_puts_token_i_of_byte_j_in_bits_i_times_bits(bits, codes, byte):
    packed = pack(tokens(codes), bits, dim=2)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 1, 1, 1)
    assert int(packed) == byte
    assert unpack(packed, bits, dim=2).flatten().tolist() == codes


def test_pack_along_channels_and_negative_dims_pack_the_named_axis():
    # two bytes along the last axis: channels 0..3 and 4..7 (bits=2)
    codes = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.uint8).reshape(1, 1, 1, 8)
    want = [0 + (1 << 2) + (2 << 4) + (3 << 6), 3 + (2 << 2) + (1 << 4) + (0 << 6)]  # 228, 27
    for dim in (3, -1):
        p = pack(codes, 2, dim=dim)
        assert p.shape == (1, 1, 1, 2) and p.flatten().tolist() == want
        assert unpack(p, 2, dim=dim).flatten().tolist() == codes.flatten().tolist()
    with pytest.raises(ValueError):
        pack(torch.zeros(1, 1, 3, 1, dtype=torch.uint8), 2, dim=2)  # 3 tokens, 4 per byte


def test_three_bit_codes_are_a_two_bit_low_plane_and_a_one_bit_high_plane():
    assert plane_bits(3) == (2, 1)
    assert plane_bits(2) == (2,) and plane_bits(8) == (8,)
    with pytest.raises(ValueError):
        plane_bits(5)
    codes = tokens([5, 2, 7, 0, 1, 6, 3, 4])  # 101 010 111 000 001 110 011 100
    low, high = pack_planes(codes, 3, dim=2)
    lo = [1, 2, 3, 0, 1, 2, 3, 0]       # c & 3
    hi = [1, 0, 1, 0, 0, 1, 0, 1]       # c >> 2
    assert low.flatten().tolist() == [lo[0] + (lo[1] << 2) + (lo[2] << 4) + (lo[3] << 6),
                                      lo[4] + (lo[5] << 2) + (lo[6] << 4) + (lo[7] << 6)]
    assert high.flatten().tolist() == [sum(h << i for i, h in enumerate(hi))]
    assert unpack_planes((low, high), 3, dim=2).flatten().tolist() == [5, 2, 7, 0, 1, 6, 3, 4]


def test_dequant_channel_is_code_times_block_scale_plus_block_zero():
    # 2-bit, block 4: tokens 0..3 use (scale 0.5, zero -1), tokens 4..7 use (scale 2, zero 10)
    codes = pack(tokens([0, 1, 2, 3, 3, 2, 1, 0]), 2, dim=2)
    scale = torch.tensor([0.5, 2.0]).reshape(1, 1, 2, 1)
    zero = torch.tensor([-1.0, 10.0]).reshape(1, 1, 2, 1)
    x = dequant_channel(codes, scale, zero, 2, 4)
    assert x.flatten().tolist() == [-1.0, -0.5, 0.0, 0.5, 16.0, 14.0, 12.0, 10.0]


def test_dequant_token_groups_is_code_times_group_scale_plus_group_zero():
    # one token, 4 channels, 4-bit, groups of 2 channels: (scale 1, zero 0) then (scale 0.25, zero 3)
    codes = pack(torch.tensor([3, 15, 4, 8], dtype=torch.uint8).reshape(1, 1, 1, 4), 4, dim=3)
    scale = torch.tensor([1.0, 0.25]).reshape(1, 1, 1, 2)
    zero = torch.tensor([0.0, 3.0]).reshape(1, 1, 1, 2)
    x = dequant_token_groups(codes, scale, zero, 4, 2)
    assert x.flatten().tolist() == [3.0, 15.0, 4.0, 5.0]


def test_dequantize_segment_reads_each_layout_with_its_own_axes():
    k = torch.tensor([1.5, -2.0]).reshape(1, 1, 2, 1).half()
    dense = DenseSeg(k, -k, torch.tensor([2], dtype=torch.int32))
    dk, dv = dequantize_segment(dense)
    assert dk.dtype == torch.float32 and dk.flatten().tolist() == [1.5, -2.0] and dv.flatten().tolist() == [-1.5, 2.0]

    one = torch.ones(1, 1, 1, 1)
    # 1-bit channel codes over 8 tokens: K codes 10110000, V codes 01000000; K (scale 2, zero 1), V (scale 3, zero 0)
    ch = ChannelSeg(pack(tokens([1, 0, 1, 1, 0, 0, 0, 0]), 1, 2), 2 * one, one,
                    pack(tokens([0, 1, 0, 0, 0, 0, 0, 0]), 1, 2), 3 * one, 0 * one, 1, 8,
                    torch.tensor([8], dtype=torch.int32))
    ck, cv = dequantize_segment(ch)
    assert ck.flatten().tolist() == [3, 1, 3, 3, 1, 1, 1, 1]
    assert cv.flatten().tolist() == [0, 3, 0, 0, 0, 0, 0, 0]

    # KIVI: keys channel-wise (2-bit, block 4), values token-wise (2-bit, group 4 over D=4)
    kc = pack(torch.tensor([0, 1, 2, 3], dtype=torch.uint8).reshape(1, 1, 4, 1).expand(1, 1, 4, 4), 2, dim=2)
    vc = pack(torch.tensor([3, 2, 1, 0], dtype=torch.uint8).reshape(1, 1, 1, 4).expand(1, 1, 4, 4), 2, dim=3)
    kv = KiviSeg(kc, torch.full((1, 1, 1, 4), 0.5), torch.full((1, 1, 1, 4), 1.0),
                 vc, torch.full((1, 1, 4, 1), 2.0), torch.full((1, 1, 4, 1), -1.0), 2, 2, 4, 4,
                 torch.tensor([4], dtype=torch.int32))
    kk, kvv = dequantize_segment(kv)
    assert kk[0, 0, :, 0].tolist() == [1.0, 1.5, 2.0, 2.5] and kk[0, 0, 2].tolist() == [2.0] * 4
    assert kvv[0, 0, 1].tolist() == [5.0, 3.0, 1.0, -1.0]
    with pytest.raises(TypeError):
        dequantize_segment(object())


def test_calibration_maps_gamma_delta_onto_gamma_minus_tau1_delta_minus_tau2():
    x = torch.tensor([[0.0, 1.0, 4.0, 100.0]])
    valid = torch.tensor([[True, True, True, False]])  # the last entry must not widen [gamma, delta] = [0, 4]
    # tau1=0, tau2=3: g(x) = (4 - 3)/4 * x = x/4
    assert calibrate_logits(x, valid, 0.0, 3.0)[0, :3].tolist() == [0.0, 0.25, 1.0]
    # tau1=1, tau2=3: g(x) = (4 + 1 - 3)/4 * (x - 0) + 0 - 1 = x/2 - 1
    assert calibrate_logits(x, valid, 1.0, 3.0)[0, :3].tolist() == [-1.0, -0.5, 1.0]
    # gamma = 2 (shifted range): g(x) = (4 + 1 - 2)/4 * (x - 2) + 2 - 1
    y = torch.tensor([[2.0, 4.0, 6.0]])
    assert calibrate_logits(y, torch.ones_like(y, dtype=torch.bool), 1.0, 2.0)[0].tolist() == [1.0, 2.5, 4.0]
    # no range (one valid token, or all equal): left as is
    z = torch.tensor([[3.0, 7.0]])
    assert calibrate_logits(z, torch.tensor([[True, False]]), 1.0, 3.0).tolist() == [[3.0, 7.0]]
    assert calibrate_logits(torch.tensor([[5.0, 5.0]]), torch.ones(1, 2, dtype=torch.bool), 1.0, 3.0).tolist() == [[5.0, 5.0]]
    # gamma/delta are per query (last axis only), and a range narrower than 1 is still a range:
    # rows [0, 0.5] and [10, 14] with tau1 = 0, tau2 = 0.25 -> ratios 0.5 and 0.9375
    rows = torch.tensor([[[0.0, 0.5]], [[10.0, 14.0]]])
    got = calibrate_logits(rows, torch.ones_like(rows, dtype=torch.bool), 0.0, 0.25)
    assert got.flatten().tolist() == pytest.approx([0.0, 0.25, 10.0, 13.75])


@pytest.mark.parametrize("w,want", [
    (2.0, [0.0, 0.25, 0.5]),  # below: the paper's slope (2 - 3) / 2 < 0 would reverse the order; floored to 1/4
    (3.09, [0.0, 0.38625, 0.7725]),  # just above the paper's zero (slope 0.03, flat): floored to 1/4
    (4.0, [0.0, 0.5, 1.0]),  # at the threshold 4 (tau2 - tau1) / 3: the paper's slope is 1/4 itself
    (6.0, [0.0, 1.5, 3.0]),  # above: the paper's map, slope 1/2
])
def test_calibration_slope_is_floored_at_one_quarter(w, want):
    x = torch.tensor([[0.0, w / 2, w]])
    assert calibrate_logits(x, torch.ones_like(x, dtype=torch.bool), 0.0, 3.0)[0].tolist() == pytest.approx(want)
    # shifted range and tau1 > 0: [1, 2, 3], tau = (0.5, 3): slope (2 + 0.5 - 3) / 2 < 0 -> 1/4 (x - 1) + 1 - 0.5
    y = torch.tensor([[1.0, 2.0, 3.0]])
    assert calibrate_logits(y, torch.ones_like(y, dtype=torch.bool), 0.5, 3.0)[0].tolist() == [0.5, 0.75, 1.0]


def _dense(keys, values, lens=None):
    k = torch.tensor(keys, dtype=torch.float32).reshape(1, 1, -1, 1)
    v = torch.tensor(values, dtype=torch.float32).reshape(1, 1, -1, 1)
    n = k.shape[2] if lens is None else lens
    return DenseSeg(k, v, torch.tensor([n], dtype=torch.int32))


def test_attention_is_softmax_over_every_valid_token_of_every_segment():
    # q = 1, sm_scale = 1: logits [0, ln 3] -> p = [1/4, 3/4]; values [4, 8] -> out = 1 + 6 = 7, lse = ln 4
    q = torch.ones(1, 1, 1, 1)
    out, lse = attention_over_segments(q, [_dense([0.0, math.log(3)], [4.0, 8.0])], sm_scale=1.0)
    assert out.shape == (1, 1, 1, 1) and lse.shape == (1, 1, 1)
    assert out.item() == pytest.approx(7.0) and lse.item() == pytest.approx(math.log(4))
    # the same two keys split over two segments, plus a padding token (lens 1) that must not count
    split = [_dense([0.0, 50.0], [4.0, 1000.0], lens=1), _dense([math.log(3)], [8.0])]
    out2, lse2 = attention_over_segments(q, split, sm_scale=1.0)
    assert out2.item() == pytest.approx(7.0) and lse2.item() == pytest.approx(math.log(4))
    # default sm_scale is 1/sqrt(D): D = 4, q . k = 2 * ln 3 -> logit ln 3
    q4 = torch.full((1, 1, 1, 4), 0.5)
    k4 = torch.zeros(1, 1, 2, 4)
    k4[0, 0, 1] = math.log(3)
    v4 = torch.tensor([4.0, 8.0]).reshape(1, 1, 2, 1).expand(1, 1, 2, 4)
    out4, _ = attention_over_segments(q4, [DenseSeg(k4, v4, torch.tensor([2], dtype=torch.int32))])
    assert out4.flatten().tolist() == pytest.approx([7.0] * 4)


def test_query_heads_share_their_kv_head_and_empty_rows_give_zero_and_minus_inf():
    # 2 query heads over 1 KV head: head 0 has q = 0 (uniform: mean 6), head 1 has q = 1 (out 7 as above)
    q = torch.tensor([0.0, 1.0]).reshape(1, 2, 1, 1)
    out, lse = attention_over_segments(q, [_dense([0.0, math.log(3)], [4.0, 8.0])], sm_scale=1.0)
    assert out.flatten().tolist() == pytest.approx([6.0, 7.0])
    assert lse.flatten().tolist() == pytest.approx([math.log(2), math.log(4)])
    o, l = attention_over_segments(torch.ones(1, 1, 1, 1), [_dense([1.0], [5.0], lens=0)], sm_scale=1.0)
    assert o.item() == 0.0 and l.item() == float("-inf")
    d = decode_attention_ref(torch.ones(1, 1, 1), [_dense([0.0, math.log(3)], [4.0, 8.0])], sm_scale=1.0)
    assert d.shape == (1, 1, 1) and d.item() == pytest.approx(7.0)
    # D = 4 with sm_scale given (not the default 1/2): q . k = 4 ln 3 / 4 -> logit ln 3 at sm_scale 1/4
    k4 = torch.zeros(1, 1, 2, 4)
    k4[0, 0, 1] = math.log(3)
    v4 = torch.tensor([4.0, 8.0]).reshape(1, 1, 2, 1).expand(1, 1, 2, 4)
    d4 = decode_attention_ref(torch.ones(1, 1, 4), [DenseSeg(k4, v4, torch.tensor([2], dtype=torch.int32))], 0.25)
    assert d4.shape == (1, 1, 4) and d4.flatten().tolist() == pytest.approx([7.0] * 4)


def test_calibrated_segment_attends_with_calibrated_logits():
    # 1-bit ChannelSeg over 2 tokens (block 8): keys 0 and 4 (scale 4, zero 0); calib (0, 3) maps logits [0, 4]
    # onto [0, 1] -> p = [1, e] / (1 + e); values 0 and 1 -> out = e / (1 + e)
    one = torch.ones(1, 1, 1, 1)
    kc = pack(tokens([0, 1, 0, 0, 0, 0, 0, 0]), 1, 2)
    seg = ChannelSeg(kc, 4 * one, 0 * one, kc, one, 0 * one, 1, 8, torch.tensor([2], dtype=torch.int32), (0.0, 3.0))
    out, lse = attention_over_segments(torch.ones(1, 1, 1, 1), [seg], sm_scale=1.0)
    assert out.item() == pytest.approx(math.e / (1 + math.e))
    assert lse.item() == pytest.approx(math.log(1 + math.e))


def test_merge_weights_each_partial_by_its_share_of_the_total_exp_mass():
    # partial A: lse ln 1, out 1; partial B: lse ln 3, out 3 -> (1 * 1 + 3 * 3) / 4 = 2.5
    a, b = torch.tensor([[1.0]]), torch.tensor([[3.0]])
    merged = merge_partials([a, b], [torch.tensor([0.0]), torch.tensor([math.log(3)])])
    assert merged.flatten().tolist() == pytest.approx([2.5])
    # an empty partial (lse -inf) weighs nothing
    merged = merge_partials([a, b], [torch.tensor([float("-inf")]), torch.tensor([0.0])])
    assert merged.flatten().tolist() == pytest.approx([3.0])


def test_decode_reference_equals_one_softmax_and_handles_no_segments():
    q = torch.ones(1, 1, 1)
    out, lse = decode_reference(q, [_dense([0.0], [4.0]), None, _dense([math.log(3)], [8.0])], sm_scale=1.0)
    assert out.item() == pytest.approx(7.0) and lse.item() == pytest.approx(math.log(4))
    out, lse = decode_reference(q, [], sm_scale=1.0)
    assert out.item() == 0.0 and lse.item() == float("-inf")


def test_ternary_bytes_are_five_base_three_digits():
    codes = torch.tensor([[1, 2, 0, 1, 2, 2, 1]], dtype=torch.uint8)  # D = 7: bytes (1,2,0,1,2) and (2,1,0,0,0)
    p = pack_ternary(codes)
    assert p.flatten().tolist() == [1 + 2 * 3 + 0 * 9 + 1 * 27 + 2 * 81, 2 + 1 * 3]  # 196, 5
    u = unpack_ternary(p, 7)
    assert u.dtype == torch.uint8 and u.flatten().tolist() == [1, 2, 0, 1, 2, 2, 1]
    assert pack_ternary(torch.tensor([[2, 2, 2, 2, 2]], dtype=torch.uint8)).dtype == torch.uint8
    assert pack_ternary(torch.full((1, 5), 2, dtype=torch.uint8)).flatten().tolist() == [242]


def test_causal_partial_lets_each_new_token_see_itself_and_earlier_ones_only():
    # 2 query heads over 1 KV head, 3 new tokens, D = 1, scale 1; keys [0, ln 2, ln 3], values [6, 12, 18]
    q = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]).reshape(1, 2, 3, 1)
    k = torch.tensor([0.0, math.log(2), math.log(3)]).reshape(1, 1, 3, 1)
    v = torch.tensor([6.0, 12.0, 18.0]).reshape(1, 1, 3, 1)
    out, lse = causal_partial(q.half(), k.half(), v.half(), 1.0)
    assert out.dtype == torch.float32 and out.shape == (1, 2, 3, 1)
    # head 0 (q = 0): running means 6, 9, 12; head 1: weights 1, 2, 3 -> 6, (6 + 24) / 3, (6 + 24 + 54) / 6
    assert out[0, 0, :, 0].tolist() == pytest.approx([6.0, 9.0, 12.0], rel=1e-3)
    assert out[0, 1, :, 0].tolist() == pytest.approx([6.0, 10.0, 14.0], rel=1e-3)
    assert lse[0, 0].tolist() == pytest.approx([0.0, math.log(2), math.log(3)], abs=1e-3)
    assert lse[0, 1].tolist() == pytest.approx([0.0, math.log(3), math.log(6)], abs=1e-3)


def test_segment_logits_expand_query_heads_and_mark_padding():
    # 2 query heads over 1 KV head, D = 1, sm_scale 0.5: logits q * k / 2; the second token is padding (lens 1)
    q = torch.tensor([2.0, -4.0]).reshape(1, 2, 1, 1)
    x, valid, v = segment_logits(q, _dense([3.0, 5.0], [7.0, 9.0], lens=1), 0.5)
    assert x.shape == (1, 2, 1, 2) and valid.shape == (1, 1, 1, 2) and v.shape == (1, 2, 2, 1)
    assert x.flatten().tolist() == [3.0, 5.0, -6.0, -10.0]
    assert valid.flatten().tolist() == [True, False]
    assert v[0, :, :, 0].tolist() == [[7.0, 9.0], [7.0, 9.0]]


def test_rms_norm_divides_by_the_root_mean_square_then_weights():
    x = torch.tensor([[3.0, 4.0]])  # mean of squares 12.5
    out = rms_norm(x, torch.tensor([1.0, 2.0]), 0.0)
    r = math.sqrt(12.5)
    assert out.flatten().tolist() == pytest.approx([3 / r, 8 / r])
    out = rms_norm(x, torch.ones(2), 2.5)  # eps inside the root: sqrt(15)
    assert out.flatten().tolist() == pytest.approx([3 / math.sqrt(15), 4 / math.sqrt(15)])
    h = rms_norm(x.half(), torch.ones(2, dtype=torch.half), 0.0)
    assert h.dtype == torch.float16


def test_rotary_rotates_each_half_pair_by_its_angle():
    # D = 4: pairs (x0, x2) and (x1, x3) rotate: x * cos + cat(-x2, x1) * sin
    q = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    k = torch.tensor([1.0, 0.0, 0.0, 0.0]).reshape(1, 1, 1, 4)
    c, s_ = math.cos(0.5), math.sin(0.5)
    cos = torch.tensor([c, 1.0, c, 1.0]).reshape(1, 1, 4)
    sin = torch.tensor([s_, 0.0, s_, 0.0]).reshape(1, 1, 4)
    rq, rk = rotary(q, k, cos, sin)
    assert rq.flatten().tolist() == pytest.approx([1 * c - 3 * s_, 2.0, 3 * c + 1 * s_, 4.0])
    assert rk.flatten().tolist() == pytest.approx([c, 0.0, s_, 0.0])


def test_silu_mul_is_gate_times_sigmoid_gate_times_up():
    out = silu_mul(torch.tensor([0.0, 1.0, -2.0]), torch.tensor([5.0, 3.0, 2.0]))
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    assert out.tolist() == pytest.approx([0.0, 1 * sig(1) * 3, -2 * sig(-2) * 2])


# ---- AlignedKV (kernels/reference.py's precision-aligned read): Rules 1 and 2 worked through by hand ------------

def test_level_of_gap_and_the_fp16_block_exponent():
    assert level_of_gap(torch.tensor([-3, 0, 3, 4, 7, 8, 30])).tolist() == [16, 16, 16, 12, 12, 8, 8]
    # colmax is the block's largest fp16 exponent field: |x| < 2**(field - 15 + 1); subnormals (0) as field 1
    assert _fp16_exp(torch.tensor([0, 1, 2, 15, 30], dtype=torch.uint8)).tolist() == [-14, -14, -13, 0, 15]


def test_rule_1_aligns_every_addend_of_q_dot_k_to_the_largest():
    # q exponents 0 everywhere; block fields 15, 12, 11, 7 -> addend exponents 1, -2, -3, -7 -> gaps 0, 3, 4, 8
    qg = torch.ones(1, 1, 1, 4)
    colmax = torch.tensor([15, 12, 11, 7], dtype=torch.uint8).reshape(1, 1, 1, 4)
    assert key_levels(qg, colmax).flatten().tolist() == [16, 16, 12, 8]


def test_rule_2_aligns_each_p_times_v_addend_to_the_output_estimate():
    # largest p of the block 1/2 (log2 -1), |v| < 2 (field 15): addend exponent -1 + 0 + 1 = 0; o_est exponents
    # 3, 4, 7, 8 -> gaps 3, 4, 7, 8
    logp = torch.tensor([-1.0]).reshape(1, 1, 1, 1)
    o_est = torch.tensor([8.0, 16.0, 128.0, 256.0]).reshape(1, 1, 1, 4)
    colmax = torch.full((1, 1, 1, 4), 15, dtype=torch.uint8)
    assert value_levels(logp, o_est, colmax).flatten().tolist() == [16, 12, 12, 8]


def test_output_estimate_weights_each_blocks_top_token_read_at_8_bits():
    # log2 logits [0, 1 | -inf, 2]: block tops are tokens 1 and 3; lse2 = log2(1 + 2 + 4); their V high bytes
    # 0x3C (1.0) and 0x40 (2.0) read at 8 bits with the next bit set: 1.125 and 2.25
    x = torch.tensor([0.0, 1.0, float("-inf"), 2.0]).reshape(1, 1, 1, 4)
    lse2 = torch.tensor([math.log2(7)]).reshape(1, 1, 1)
    v_hi = torch.tensor([[0x00, 0x3C], [0x7B, 0x40]], dtype=torch.uint8).reshape(1, 1, 2, 1, 2)
    o = output_estimate(x, lse2, v_hi, 2)
    assert o.flatten().tolist() == pytest.approx([(2 * 1.125 + 4 * 2.25) / 7])
    # a row without any valid token estimates 0
    none = output_estimate(torch.full((1, 1, 1, 4), float("-inf")), torch.full((1, 1, 1), float("-inf")), v_hi, 2)
    assert none.flatten().tolist() == [0.0]


def test_bits_read_average_over_valid_tokens_only():
    levels = torch.tensor([16, 8], dtype=torch.uint8).reshape(1, 1, 2, 1)
    assert bits_read(levels, torch.tensor([3]), 2) == pytest.approx((16 * 2 + 8 * 1) / 3)
    assert bits_read(levels, torch.tensor([0]), 2) == 0.0
    assert bits_read(levels, torch.tensor([1]), 2) == 16.0  # one valid element


def test_split_planes_needs_whole_even_blocks_and_takes_colmax_over_valid_tokens():
    with pytest.raises(ValueError):
        split_planes(torch.ones(1, 1, 3, 1, dtype=torch.half), 3)
    with pytest.raises(ValueError):
        split_planes(torch.ones(1, 1, 6, 1, dtype=torch.half), 4)
    x = torch.tensor([1.0, 1024.0]).reshape(1, 1, 2, 1).half()   # fields 15 and 25; token 1 is padding
    assert split_planes(x, 2, torch.tensor([1]))[3].flatten().tolist() == [15]
    assert split_planes(x, 2)[3].flatten().tolist() == [25]


def _aligned_seg(lens=4, **kw):
    """D = 2, two blocks of 2 tokens. K: channel 0 = 0, 0 | -5, -5; channel 1 = 1 + 2**-10 everywhere. V = 1."""
    k = torch.tensor([[0.0, 1 + 2**-10]] * 2 + [[-5.0, 1 + 2**-10]] * 2).reshape(1, 1, 4, 2).half()
    v = torch.ones(1, 1, 4, 2, dtype=torch.half)
    n = torch.tensor([lens], dtype=torch.int32)
    return AlignedSeg(*split_planes(k, 2, n), *split_planes(v, 2, n), block=2, lens=n, **kw)


def test_aligned_read_follows_rules_1_and_2_by_hand():
    # q = (1, 2**-8), sm_scale = 1/log2(e): logits in log2 units are q . k_read exactly.
    # Rule 1, block A: fields (0 -> 1, 15), addends (0 - 14 + 1, -8 + 0 + 1) = (-13, -7) -> gaps (6, 0) -> (12, 16)
    #         block B: fields (17, 15), addends (0 + 2 + 1, -7) = (3, -7) -> gaps (0, 10) -> (16, 8)
    # K read: 0 at 12 bits = 0x0008 = 2**-21; 1 + 2**-10 (0x3C01) at 8 bits = 0x3C80 = 1.125
    q = torch.tensor([1.0, 2**-8]).reshape(1, 1, 2)
    out, lse, lk, lv = aligned_attention(q, _aligned_seg(values="conservative"), 1 / _LOG2E)
    assert lk[0, 0].tolist() == [[12, 16], [16, 8]]
    xa = 2**-21 + 2**-8 * (1 + 2**-10)
    xb = -5 + 2**-8 * 1.125
    lse2 = math.log2(2 * 2**xa + 2 * 2**xb)
    # Rule 2: log2 of each block's top p: xa - lse2 = -1.04 (floor -2), xb - lse2 = -6.04 (floor -7); O_est =
    # 1.125 * (2**(xa - lse2) + 2**(xb - lse2)) = 0.5625 (exponent -1); |v| < 2 (field 15): addends -1 and -6
    # -> gaps 0 and 5 -> block A 16 bits, block B 12 bits (1.0 = 0x3C00 read as 0x3C08 = 1 + 2**-7)
    assert math.floor(xa - lse2) == -2 and math.floor(xb - lse2) == -7
    assert lv[0, 0].tolist() == [[16, 16], [12, 12]]
    want = (2 * 2**xa * 1.0 + 2 * 2**xb * (1 + 2**-7)) / (2 * 2**xa + 2 * 2**xb)
    assert out.flatten().tolist() == pytest.approx([want, want], rel=1e-6)
    assert lse.item() == pytest.approx(lse2 * math.log(2), rel=1e-6)


def test_aligned_read_switches_full_forced_and_empty_blocks():
    q = torch.tensor([1.0, 2**-8]).reshape(1, 1, 2)
    _, _, lk, lv = aligned_attention(q, _aligned_seg(keys="full", values="full"), 1 / _LOG2E)
    assert lk.flatten().tolist() == [16] * 4 and lv.flatten().tolist() == [16] * 4
    _, _, lk, lv = aligned_attention(q, _aligned_seg(force_bits=8), 1 / _LOG2E)
    assert lk.flatten().tolist() == [8] * 4 and lv.flatten().tolist() == [8] * 4
    _, _, lk, lv = aligned_attention(q, _aligned_seg(min_bits=16), 1 / _LOG2E)
    assert lk.flatten().tolist() == [16] * 4 and lv.flatten().tolist() == [16] * 4
    # only block A valid: block B reads nothing (level 0); V of block A: one block, top p 1/2 -> gap 0 -> 16
    out, lse, lk, lv = aligned_attention(q, _aligned_seg(lens=2), 1 / _LOG2E)
    assert lk[0, 0, 1].tolist() == [0, 0] and lv[0, 0, 1].tolist() == [0, 0]
    assert out.flatten().tolist() == pytest.approx([1.0, 1.0])
    xa = 2**-21 + 2**-8 * (1 + 2**-10)
    assert lse.item() == pytest.approx(math.log(2) + xa * math.log(2), rel=1e-6)
    # no valid token at all: output 0, lse -inf, nothing read
    out, lse, lk, lv = aligned_attention(q, _aligned_seg(lens=0), 1 / _LOG2E)
    assert out.flatten().tolist() == [0.0, 0.0] and lse.item() == float("-inf")
    assert lk.flatten().tolist() == [0] * 4 and lv.flatten().tolist() == [0] * 4


def test_fp16_bit_patterns_are_unsigned_16_bit_ints():
    from kernels.layouts import bits_fp16, fp16_bits
    b = fp16_bits(torch.tensor([1.0, -1.0, -2.0]))   # fp32 in: rounded to fp16 first
    assert b.dtype == torch.int32 and b.tolist() == [0x3C00, 0xBC00, 0xC000]
    assert bits_fp16(b).tolist() == [1.0, -1.0, -2.0]


class _Module:  # what transformers hands an attention function
    is_causal = True
    num_key_value_groups = 1


def _softmax_attention(q, k, v, scale, allowed):
    """fp64 softmax attention written out: q, k, v [B, H, T, D]; allowed [B, Tq, Tk] bool."""
    x = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    x = x.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(x, -1), v.double()).transpose(1, 2)


def test_untagged_and_prefill_keys_get_exact_causal_attention_with_the_mask_and_scale_given():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 3, 4, generator=g) for _ in range(3))
    allowed = torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 3, 3).clone()
    allowed[1, :, 0] = False                      # row 1: token 0 is padding
    allowed[1, 0, 0] = True                       # (its own query row keeps one key, as transformers' masks do)
    want = _softmax_attention(q, k, v, 0.3, allowed)
    out, _ = mmkv_attention(_Module(), q, k, v, allowed[:, None], scaling=0.3)
    assert out.shape == (2, 3, 1, 4)
    assert torch.allclose(out.double(), want, atol=1e-6)
    tagged = k.clone()
    tagged._mmkv = (None, "prefill")
    out, _ = mmkv_attention(_Module(), q, tagged, v, allowed[:, None], scaling=0.3)
    assert torch.allclose(out.double(), want, atol=1e-6)
