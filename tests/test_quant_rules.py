"""Quantization rules of mmkv/methods (quant.py's min/max quantizer, CalibQuant's spans and clipping, XQuant's
weighted-average codes, SKVQ's dequantization) on values worked by hand.

mmkv/methods/quant.py: min/max uniform quantization (CalibQuant Eq. 3-4, KIVI Sec. 3).
``code = clamp(round((x - lo) / scale), 0, 2^b - 1)``, ``scale = (hi - lo) / (2^b - 1)``, ``zero = lo``, both stored
in fp16; ranges are taken over valid tokens only. The mutation smoke (tests/test_mutation_smoke.py) mutates this
module against this file, so it stays fast: pure torch, tiny tensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels.layouts import pack, unpack
from mmkv.methods.alignedkv import AlignedKV
from mmkv.methods.calibquant import CalibQuant
from mmkv.methods.quant import (
    channel_quantize,
    masked_minmax,
    minmax_codes,
    pad_tokens,
    token_group_quantize,
    token_valid,
)
from mmkv.methods.skvq_quant import dequant_range
from mmkv.methods.xquant import XQuant, calibrate


def test_minmax_codes_round_to_nearest_level_and_clamp():
    # [lo, hi] = [0, 3] at 2 bits: 3 levels of width 1
    x = torch.tensor([0.0, 1.4, 1.6, 3.0, -5.0, 9.0])
    codes, scale, zero = minmax_codes(x, torch.tensor(0.0), torch.tensor(3.0), 2)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [0, 1, 2, 3, 0, 3]
    assert scale.dtype == torch.float16 and zero.dtype == torch.float16
    assert scale.item() == 1.0 and zero.item() == 0.0
    # [lo, hi] = [-1, 1] at 1 bit: scale 2, codes 0 below 0, 1 above (0 itself rounds half to even: 0.5 -> 0)
    codes, scale, zero = minmax_codes(torch.tensor([-1.0, -0.2, 0.2, 1.0]), torch.tensor(-1.0), torch.tensor(1.0), 1)
    assert codes.tolist() == [0, 0, 1, 1] and scale.item() == 2.0 and zero.item() == -1.0
    # 4 bits over [2, 17]: scale 1, x = 9.5 -> 7.5 rounds to 8 (half to even), x = 10.4 -> 8
    codes, scale, _ = minmax_codes(torch.tensor([9.5, 10.4, 17.0]), torch.tensor(2.0), torch.tensor(17.0), 4)
    assert codes.tolist() == [8, 8, 15] and scale.item() == 1.0


def test_minmax_codes_with_an_empty_range_give_code_zero_and_dequantize_exactly():
    codes, scale, zero = minmax_codes(torch.tensor([4.0, 4.0]), torch.tensor(4.0), torch.tensor(4.0), 2)
    assert codes.tolist() == [0, 0] and scale.item() == 0.0 and zero.item() == 4.0


def test_codes_are_computed_against_the_stored_fp16_scale_and_zero():
    # lo = 0.1 is not an fp16 number: zero is fp16(0.1) = 0.0999755859375, and x = zero + 1.5 * scale must round
    # against that stored zero (to 2), not against 0.1
    lo, hi = torch.tensor(0.1), torch.tensor(3.1)
    zero16 = float(torch.tensor(0.1, dtype=torch.float16))
    codes, scale, zero = minmax_codes(torch.tensor([zero16 + 1.5 + 1e-4]), lo, hi, 2)
    assert zero.item() == zero16 and scale.item() == 1.0
    assert codes.tolist() == [2]


def test_masked_minmax_ignores_padding_and_gives_zero_for_empty_rows():
    x = torch.tensor([[1.0, -2.0, 50.0], [7.0, 8.0, 9.0]])
    valid = torch.tensor([[True, True, False], [False, False, False]])
    lo, hi = masked_minmax(x, valid, dim=1)
    assert lo.shape == (2, 1)
    assert lo.flatten().tolist() == [-2.0, 0.0] and hi.flatten().tolist() == [1.0, 0.0]
    lo, hi = masked_minmax(x, torch.ones_like(valid), dim=1, keepdim=False)
    assert lo.tolist() == [-2.0, 7.0] and hi.tolist() == [50.0, 9.0]


def test_token_valid_marks_the_first_lens_tokens_of_each_row():
    v = token_valid(torch.tensor([2, 0, 3]), 3, "cpu")
    assert v.shape == (3, 1, 3, 1)
    assert v[:, 0, :, 0].tolist() == [[True, True, False], [False, False, False], [True, True, True]]


def test_pad_tokens_appends_zeros_up_to_a_multiple():
    x = torch.ones(1, 2, 5, 3)
    p = pad_tokens(x, 4)
    assert p.shape == (1, 2, 8, 3)
    assert p[:, :, :5].eq(1).all() and p[:, :, 5:].eq(0).all()
    same = torch.ones(1, 1, 8, 2)
    assert pad_tokens(same, 4) is same
    assert pad_tokens(torch.ones(1, 1, 1, 1), 1).shape == (1, 1, 1, 1)


def test_channel_quantize_takes_one_range_per_block_and_channel_over_valid_tokens():
    # B=1, H=1, T=4 (two blocks of 2), D=2; lens 3: token 3 (value 100) is padding
    x = torch.tensor([[0.0, 10.0], [3.0, 4.0], [1.0, -2.0], [100.0, 100.0]]).reshape(1, 1, 4, 2)
    codes, scale, zero = channel_quantize(x, torch.tensor([3]), 2, 2)
    assert codes.shape == (1, 1, 4, 2) and scale.shape == (1, 1, 2, 2)
    # block 0: channel 0 in [0, 3] (scale 1), channel 1 in [4, 10] (scale 2); block 1: one valid token each
    assert scale[0, 0].tolist() == [[1.0, 2.0], [0.0, 0.0]]
    assert zero[0, 0].tolist() == [[0.0, 4.0], [1.0, -2.0]]
    assert codes[0, 0, :3].tolist() == [[0, 3], [3, 0], [0, 0]]


def f16(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float16))


def test_clip_scales_both_ends_of_a_mixed_sign_range_toward_zero():
    # CalibQuant's released quant(): lo, hi = lo * c, hi * c. Range [-2, 6], c = 0.5 -> [-1, 3]; 1 bit: scale 4,
    # zero -1; codes round((x + 1) / 4) = round(-0.25, 0.375, 0.625, 1.75) clamped -> 0, 0, 1, 1.
    # (Shrinking about the centre would give [0, 4] and codes 0, 0, 0, 1.)
    x = torch.tensor([-2.0, 0.5, 1.5, 6.0]).reshape(1, 1, 4, 1)
    codes, scale, zero = channel_quantize(x, torch.tensor([4]), 1, 4, clip=0.5)
    assert scale.item() == 4.0 and zero.item() == -1.0
    assert codes.flatten().tolist() == [0, 0, 1, 1]


def test_clip_shifts_an_all_positive_range_toward_zero():
    # range [4, 8], c = 0.5 -> [2, 4] (not [5, 7]); 2 bits: scale 2/3, zero 2; every x >= 4 lands on the top code 3
    x = torch.tensor([4.0, 5.0, 7.0, 8.0]).reshape(1, 1, 4, 1)
    codes, scale, zero = channel_quantize(x, torch.tensor([4]), 2, 4, clip=0.5)
    assert zero.item() == 2.0 and scale.item() == f16(2 / 3)
    assert codes.flatten().tolist() == [3, 3, 3, 3]


def test_clip_authors_uses_half_for_keys_and_three_tenths_for_values_at_one_bit():
    # K and V both [-2, 0.5, 1.5, 6] in one channel. K: c = 0.5 -> [-1, 3], scale 4, zero -1.
    # V: c = 0.3 -> [-0.6, 1.8], scale 2.4, zero -0.6 (fp16); codes round((x + 0.6) / 2.4) = round(-0.58, 0.46,
    # 0.88, 2.75) clamped -> 0, 0, 1, 1.
    x = torch.tensor([-2.0, 0.5, 1.5, 6.0, 0.0, 0.0, 0.0, 0.0]).reshape(1, 1, 8, 1)
    seg = CalibQuant(bits=1, clip="authors").quantize(x, x.clone(), torch.tensor([4]))
    assert seg.k_scale.item() == 4.0 and seg.k_zero.item() == -1.0
    assert seg.v_scale.item() == f16(2.4) and seg.v_zero.item() == f16(-0.6)
    assert unpack(seg.v_codes, 1, dim=2).flatten()[:4].tolist() == [0, 0, 1, 1]
    assert unpack(seg.k_codes, 1, dim=2).flatten()[:4].tolist() == [0, 0, 1, 1]


def test_clip_authors_is_off_above_one_bit():
    # the released code sets SCALE_K = SCALE_V = 1 unless BITS_KV == 1: the 2-bit range stays [-2, 6]
    x = torch.tensor([-2.0, 0.5, 1.5, 6.0]).reshape(1, 1, 4, 1)
    seg = CalibQuant(bits=2, clip="authors").quantize(x, x.clone(), torch.tensor([4]))
    assert seg.k_zero.item() == -2.0 and seg.k_scale.item() == f16(8 / 3)
    assert seg.v_zero.item() == -2.0 and seg.v_scale.item() == f16(8 / 3)


def test_global_axis_range_is_per_row_head_and_block():
    # 2 rows x 2 blocks of 2 tokens, D = 2: each (row, block) has its own range over both channels
    x = torch.tensor([[[0.0, 1.0], [2.0, 3.0], [10.0, 11.0], [12.0, 14.0]],
                      [[-4.0, 0.0], [4.0, 0.0], [5.0, 5.0], [5.0, 6.0]]]).reshape(2, 1, 4, 2)
    _, scale, zero = channel_quantize(x, torch.tensor([4, 4]), 1, 2, global_axis=True)
    assert zero[:, 0, :, 0].tolist() == [[0.0, 10.0], [-4.0, 5.0]]
    assert scale[:, 0, :, 0].tolist() == [[3.0, 4.0], [8.0, 1.0]]
    assert torch.equal(scale[..., 0], scale[..., 1]) and torch.equal(zero[..., 0], zero[..., 1])


def test_global_axis_shares_one_range_over_all_channels_without_copies():
    x = torch.tensor([[0.0, 6.0], [2.0, 3.0]]).reshape(1, 1, 2, 2)
    codes, scale, zero = channel_quantize(x, torch.tensor([2]), 1, 2, global_axis=True)
    # one range [0, 6] for both channels: scale 6, zero 0, stored as a stride-0 view over D
    assert scale.shape == (1, 1, 1, 2) and scale.stride(-1) == 0 and zero.stride(-1) == 0
    assert scale.flatten().tolist() == [6.0, 6.0] and zero.flatten().tolist() == [0.0, 0.0]
    assert codes[0, 0].tolist() == [[0, 1], [0, 0]]


def test_token_group_quantize_takes_one_range_per_token_and_channel_group():
    # one token, D = 4 in groups of 2: [0, 2] and [-4, 4]; 2 bits -> scales 2/3 and 8/3
    x = torch.tensor([0.0, 2.0, 4.0, -4.0]).reshape(1, 1, 1, 4)
    codes, scale, zero = token_group_quantize(x, 2, 2)
    assert codes.shape == (1, 1, 1, 4) and scale.shape == (1, 1, 1, 2)
    assert codes.flatten().tolist() == [0, 3, 3, 0]
    assert zero.flatten().tolist() == [0.0, -4.0]
    assert scale.flatten().tolist() == [float(torch.tensor(2 / 3, dtype=torch.float16)),
                                        float(torch.tensor(8 / 3, dtype=torch.float16))]


def test_calibquant_quantize_spans_the_longest_row_and_clips_keys_and_values_separately():
    # 8-bit (1 token per byte): lens [1] over 3 tokens -> span 1, one block of 1 token; lens come back int32
    k = torch.arange(6.0).reshape(1, 1, 3, 2)
    seg = CalibQuant(bits=8).quantize(k, k.clone(), torch.tensor([1]))
    assert seg.lens.dtype == torch.int32 and seg.lens.tolist() == [1]
    assert seg.k_codes.shape == (1, 1, 1, 2) and seg.block == 1
    # 1-bit, 8 tokens with K in [-2, 4] per channel: clip_k 0.5 -> [-1, 2] (scale 3, zero -1); V keeps [-2, 4]
    k = torch.tensor([-2.0, 1.0, 2.0, 3.0, 4.0, 4.0, 0.0, 2.0]).reshape(1, 1, 8, 1)
    seg = CalibQuant(bits=1, clip="manual", clip_k=0.5).quantize(k, k.clone(), torch.tensor([8]))
    assert seg.k_scale.item() == 3.0 and seg.k_zero.item() == -1.0
    assert seg.v_scale.item() == 6.0 and seg.v_zero.item() == -2.0
    assert seg.block == 8 and seg.calib == (0.0, 3.0)


def test_xquant_weighted_average_writes_round_g0_even_plus_1_minus_g0_odd_into_the_partner():
    # layer 1 of 2 with km=0 reads layer 0's key codes (2-bit, kq=2); share=average, gamma0=0.25
    xq = XQuant(kq=2, vq=2, km=0, vm=2, group=16, share="average", gamma0=0.25)
    odd_layer = xq.for_layer(1, 2)
    assert odd_layer.k_shared and not odd_layer.v_shared and odd_layer.k_bits == 2
    # the odd layer's own keys: token t of every channel = t % 4 over [0, 3] -> codes t % 4 (scale 1, zero 0)
    t = torch.arange(16.0)
    k = (t % 4).reshape(1, 1, 16, 1).expand(1, 1, 16, 16).contiguous()
    v = torch.randn(1, 1, 16, 16)
    # the partner (even layer) holds 2 rows x 32 tokens; row 0 tokens 16..31 have codes 0, 3, 3, 3 repeating
    even = torch.ones(2, 1, 32, 16, dtype=torch.uint8)
    even[0, :, 16:] = torch.tensor([0, 3, 3, 3], dtype=torch.uint8).repeat(4).reshape(1, 16, 1)
    partner = SimpleNamespace(text=SimpleNamespace(k_codes=pack(even, 2, dim=2)))
    seg = odd_layer.quantize_block(SimpleNamespace(partner=partner), 0, 16, k, v)
    assert seg.k_codes is None and seg.v_codes is not None
    got = unpack(partner.text.k_codes, 2, dim=2)
    # pairs (even, odd): (0, 0) -> 0; (3, 1) -> round(0.75 + 0.75) = 2; (3, 2) -> round(2.25) = 2; (3, 3) -> 3
    assert got[0, 0, 16:, 0].tolist() == [0, 2, 2, 3] * 4
    assert got[0, :, 16:].eq(got[0, :, 16:, :1]).all()
    assert got[0, :, :16].eq(1).all() and got[1].eq(1).all()  # other tokens and rows untouched


def test_skvq_dequant_range_keeps_a_flat_group_exact():
    # hi == lo: scale 0, the code is 0 and x dequantizes to zero = lo (no 0 / 0)
    out = dequant_range(torch.tensor([3.0, 3.0]), torch.tensor(3.0), torch.tensor(3.0), 2)
    assert out.tolist() == [3.0, 3.0]
    # [0, 3] at 2 bits: scale 1, round to nearest, clamp
    out = dequant_range(torch.tensor([0.4, 1.6, 9.0]), torch.tensor(0.0), torch.tensor(3.0), 2)
    assert out.tolist() == [0.0, 2.0, 3.0]


def test_xquant_calibration_keeps_the_stored_dtype_and_eta_zero_is_the_identity():
    # Eq. 12-13 at 1 bit: s' = (1 - 2 eta) s, z' = z + eta s; fp16 in, fp16 out
    s16, z16 = torch.tensor([3.0], dtype=torch.float16), torch.tensor([-1.0], dtype=torch.float16)
    s, z = calibrate(s16, z16, 0.25, 1)
    assert s.dtype == torch.float16 and z.dtype == torch.float16
    assert s.item() == 1.5 and z.item() == -0.25
    s, z = calibrate(s16, z16, 0.0, 2)
    assert s is s16 and z is z16


def test_alignedkv_stores_exact_planes_with_its_rules_and_colmax_over_valid_tokens():
    # 2 valid tokens of 32 (one block): token 1 = 1024 (field 25) is valid, the rest is padding
    k = torch.zeros(1, 1, 3, 16)
    k[0, 0, 0], k[0, 0, 1], k[0, 0, 2] = 1.0, 1024.0, 60000.0
    seg = AlignedKV(block=32, keys="full", values="full", min_bits=12).quantize(k, k.clone(), torch.tensor([2]))
    assert (seg.keys, seg.values, seg.min_bits, seg.block) == ("full", "full", 12, 32)
    assert seg.lens.dtype == torch.int32 and seg.lens.tolist() == [2]
    assert seg.k_colmax.flatten().tolist() == [25] * 16 and seg.v_colmax.flatten().tolist() == [25] * 16
    d = AlignedKV().quantize(k, k.clone(), torch.tensor([3]))
    assert (d.keys, d.values, d.min_bits) == ("rule1", "paper", 8)
    assert d.k_colmax.flatten().tolist() == [30] * 16   # 60000 = 1.83 * 2**15: field 30


# --- AQUA-KV's HIGGS quantizer (aquakv_quant.py): the reference code's formula worked by hand -----------------
# x = [3, 4, 0, 0, 0, 0, 0, 0] (8 channels: codes pack whole bytes): one Hadamard group of 8, norm 5. Sylvester's
# H_8[j, i] = (-1)^popcount(j & i), so y = H_8 x / 5 = (3 + 4 (-1)^i) / 5 = [1.4, -0.2] four times. Nearest grid
# point (squared distance over the listed points): 2 bits: #7 (1.8599304, 0.0366686), d^2 0.268 (next #11, 0.325);
# 3 bits: #49 (1.3714426, -0.3976047), d^2 0.040; 4 bits: #145 (1.3806979, -0.2916182), d^2 0.009. Stored as two
# b-bit codes per pair, low bits first. Dequantized: H_8 (5 * [p0, p1] * 4) / 8; the even and odd index sums of
# H_8 are 4 on rows 0 and 1 (+-4 for the odd ones) and 0 elsewhere: x = [2.5 (p0 + p1), 2.5 (p0 - p1), 0, ...].
HIGGS_PAIR = {2: (7, [3, 1], [4.7414975, 4.5581545]), 3: (49, [1, 6], [2.4345946, 4.4226182]),
              4: (145, [1, 9], [2.7226991, 4.1807902])}


def test_higgs_quantizes_pairs_to_the_nearest_grid_point_after_the_hadamard_rotation():
    from kernels.layouts import unpack_planes
    from mmkv.methods.aquakv_quant import Quantizer

    x = torch.tensor([[3.0, 4.0, 0, 0, 0, 0, 0, 0]])
    for bits, (index, codes, deq) in HIGGS_PAIR.items():
        q = Quantizer(bits, 64, "higgs")
        c = q.encode(x)
        assert c.scale.item() == 5.0 and c.zero is None
        assert unpack_planes(c.planes, bits, -1)[0].tolist() == codes * 4
        assert codes[0] | codes[1] << bits == index
        assert torch.allclose(q.decode(c), torch.tensor([deq + [0.0] * 6]), atol=1e-5)


def test_higgs_group_is_1024_or_the_largest_power_of_two_dividing_the_row():
    from mmkv.methods.aquakv_quant import Quantizer, higgs_group

    assert [higgs_group(c) for c in (192, 96, 1024, 2048, 3072, 6)] == [64, 32, 1024, 1024, 1024, 2]
    # bits per value: codes plus one fp16 norm per group (no zero-point)
    assert Quantizer(2, 64, "higgs").bits_per_element(192) == 2 + 16 / 64
    assert Quantizer(3, 64, "higgs").bits_per_element(4096) == 3 + 16 / 1024


def test_higgs_zero_row_decodes_to_zero():
    from mmkv.methods.aquakv_quant import Quantizer

    q = Quantizer(2, 64, "higgs")
    c = q.encode(torch.zeros(3, 192))
    assert c.scale.eq(0).all() and q.decode(c).eq(0).all()
