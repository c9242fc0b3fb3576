"""XQuant: per-layer bits, data-free calibration folded into scale/zero, cross-layer codes without copies."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.layouts import unpack
from kernels.reference import dequantize_segment
from mmkv.attention import mmkv_attention
from mmkv.cache import MMKVCache
from mmkv.methods.xquant import XQuant
from mmkv.spec import CacheSpec

H, D, HQ, L = 3, 64, 9, 6


class Attn(torch.nn.Module):
    is_causal = True


def fill(spec, t=300, seed=0):
    cache = MMKVCache(CacheSpec.parse(spec), num_layers=L, head_dim=D)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, H, t, D, generator=g)
    for layer in range(L):  # adjacent layers alike, as the paper observes for real models
        k = base * 2 + 0.3 * torch.randn(1, H, t, D, generator=g) + layer * 0.1
        v = base + 0.3 * torch.randn(1, H, t, D, generator=g)
        cache.update(k, v, layer)
    cache.finalize()
    return cache


def test_equivalent_bits_follow_appendix_a():
    assert XQuant(kq=30, vq=2, km=32, vm=16).equivalent_bits(32) == pytest.approx(1.375)
    assert XQuant(kq=28, vq=2, km=30, vm=14).equivalent_bits(30) == pytest.approx(41 / 30)
    assert CacheSpec.parse("text=xquant:kq=25,vq=0,km=30,vm=0").text.equivalent_bits(30) == pytest.approx(70 / 60)


def test_config_that_does_not_fit_the_model_raises():
    with pytest.raises(ValueError, match="kq=31 does not fit a model with 30 layers"):
        CacheSpec.parse("text=xquant:kq=31").text.equivalent_bits(30)
    with pytest.raises(ValueError, match="does not fit a model with 6 layers"):
        MMKVCache("text=xquant:kq=30,vq=2,km=32,vm=16", num_layers=L, head_dim=D)
    with pytest.raises(ValueError, match="eta1"):
        CacheSpec.parse("text=xquant:eta1=0.7")


def test_plan_bits_and_sharing():
    plan = XQuant(kq=4, vq=1, km=2, vm=4).plan(L)
    assert [p["k_bits"] for p in plan] == [2, 2, 2, 2, 1, 1]
    assert [p["k_shared"] for p in plan] == [False, False, False, True, False, True]
    assert [p["v_bits"] for p in plan] == [2, 1, 1, 1, 1, 1]
    assert [p["v_shared"] for p in plan] == [False] * 5 + [True]


def test_odd_layers_read_the_even_layers_codes_without_copying():
    cache = fill("text=xquant:kq=4,vq=1,km=2,vm=4,eta1=0,eta2=0 window=32 sinks=4")
    own = cache.layers[3].text
    assert own.k_codes is None and own.v_codes is not None  # layer 3 shares keys only
    seg = cache.layers[3].segments()[-1]
    assert seg.k_codes is cache.layers[2].text.k_codes  # a pointer, not a copy
    assert not torch.equal(seg.k_scale, cache.layers[2].text.k_scale)  # its own scale/zero
    from mmkv.cache import segments as S

    lens = cache.layers[2].text_len
    n = lens[0]
    key_codes = H * n * D * 2 // 8  # layer 2's 2-bit key codes: what layer 3 does not hold
    assert S.used_nbytes(cache.layers[2].text, lens) - S.used_nbytes(own, lens) == key_codes


def test_calibration_moves_the_endpoints_inwards():
    eta = 1 / 6
    plain = fill("text=xquant:kq=0,vq=0,km=6,vm=6,eta1=0,eta2=0 window=32 sinks=4")
    cal = fill(f"text=xquant:kq=0,vq=0,km=6,vm=6,eta1={eta},eta2=0 window=32 sinks=4")
    a, b = plain.layers[0].text, cal.layers[0].text
    assert torch.equal(a.k_codes, b.k_codes)  # codes untouched
    s, z = a.k_scale.float(), a.k_zero.float()
    assert torch.allclose(b.k_zero.float(), z + eta * s, atol=2e-3, rtol=2e-3)
    assert torch.allclose(b.k_scale.float(), (1 - 2 * eta) * s, atol=2e-3, rtol=2e-3)


def test_weighted_average_variant_makes_both_layers_read_the_same_codes():
    cache = fill("text=xquant:kq=6,vq=6,km=0,vm=0,share=average,gamma0=0.5 window=32 sinks=4")
    even, odd = cache.layers[0].segments()[-1], cache.layers[1].segments()[-1]
    assert odd.k_codes is even.k_codes and odd.v_codes is even.v_codes
    dom = fill("text=xquant:kq=6,vq=6,km=0,vm=0 window=32 sinks=4").layers[0].text
    assert not torch.equal(unpack(dom.k_codes, 2, 2), unpack(even.k_codes, 2, 2))  # the average changed them


@pytest.mark.parametrize("spec", ["text=xquant:kq=4,vq=1,km=2,vm=4 window=32",
                                  "text=xquant:kq=3,vq=0,km=0,vm=0,eta1=0.1,eta2=0.04 window=16 sinks=0"])
def test_decode_attention_over_shared_layers_equals_dense_over_dequantized(spec):
    cache = fill(spec)
    q = torch.randn(1, HQ, 1, D)
    for layer in range(L):
        kn, vn = torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
        keys, values = cache.update(kn, vn, layer)
        out, _ = mmkv_attention(Attn(), q, keys, values, None, scaling=1 / math.sqrt(D))
        ks, vs = zip(*[dequantize_segment(s) for s in cache.layers[layer].segments()])
        lens = [int(s.lens[0]) for s in cache.layers[layer].segments()]
        kk = torch.cat([k[0, :, :n] for k, n in zip(ks, lens)], 1).repeat_interleave(HQ // H, 0)[None]
        vv = torch.cat([v[0, :, :n] for v, n in zip(vs, lens)], 1).repeat_interleave(HQ // H, 0)[None]
        ref = F.scaled_dot_product_attention(q, kk, vv)
        assert ((out[0, 0] - ref[0, :, 0]).norm() / ref.norm()).item() < 1e-3
    eff = cache.effective_bits()["text"]
    assert 0 < eff < 3.0


def test_agreement_measure_separates_shared_from_independent_codes():
    from eval.studies.xquant_agreement import _compare

    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 4, (4000,), generator=g)
    same = _compare(a, a.clone(), 2)
    assert same["equal"] == 1.0 and same["absdiff_le1"] == 1.0 and same["top_bit_equal"] == 1.0
    b = torch.randint(0, 4, (4000,), generator=g)
    ind = _compare(a, b, 2)
    assert abs(ind["equal"] - ind["equal_chance"]) < 0.03 and abs(ind["equal_chance"] - 0.25) < 0.02
    assert abs(ind["top_bit_equal"] - ind["top_bit_chance"]) < 0.03 and abs(ind["absdiff_le1"] - 0.625) < 0.03
    assert abs(ind["absdiff_le1_chance"] - 0.625) < 0.02


@pytest.mark.parametrize("spec", ["text=xquant:kq=6,vq=0,km=0,vm=0,eta1=0.25,eta2=0.05 window=0 sinks=0",
                                  "text=xquant:kq=6,vq=6,km=6,vm=0 window=0 sinks=0"])
def test_shared_layers_match_an_independent_computation_head_by_head(spec):
    """eval.studies.xquant_layers' pairing check on 3 KV heads: every shared layer, read through the cache, equals
    the paper's formulas computed again (codes of layer l-1, own calibrated scale/zero); rolling the partner's heads
    by one (a head mix-up) does not."""
    from eval.studies.xquant_layers import fill_cache, pairing_check

    g = torch.Generator().manual_seed(3)
    t = 256
    base = torch.randn(t, H, D, generator=g)
    ks = [base * 2 + 0.3 * torch.randn(t, H, D, generator=g) + layer * 0.1 for layer in range(L)]
    vs = [base + 0.3 * torch.randn(t, H, D, generator=g) for _ in range(L)]
    cache = fill_cache(spec, ks, vs, D)
    res = pairing_check(CacheSpec.parse(spec).text, ks, vs, cache, t)
    assert res["shared"] and res["equal_share"] > 0.999
    assert res["equal_share_heads_rolled"] < 0.9
