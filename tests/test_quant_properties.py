"""Property-based tests (Hypothesis) of the quantizers' invariants on random shapes, bit-widths and dtypes.

For every min/max quantizer the definition (CalibQuant arXiv 2502.14882 Eq. 3-4; KIVI arXiv 2402.02750 Sec. 3;
SKVQ arXiv 2405.06219 Eq. 2) gives, with ``s = (max - min) / (2^b - 1)`` rounded to fp16 and ``z = min`` in fp16:

* every code lies in ``[0, 2^b - 1]`` and packs/unpacks losslessly;
* ``|code * s + z - x| <= s / 2`` (plus the fp16 rounding of s and z) for every valid x: the round-trip error
  bound per bits;
* the stored zero is the range's minimum and ``z + (2^b - 1) s`` its maximum (scale/zero folding), padding
  never widens a range;
* XQuant's calibrated endpoints (Eq. 12-13) sit exactly ``eta`` of the range inside the plain ones.

``max_examples`` stays small and ``deadline=None``: the suite runs on two CPU cores.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.layouts import pack, pack_ternary, per_byte, unpack, unpack_ternary
from mmkv.methods.quant import channel_quantize, minmax_codes, token_group_quantize
from mmkv.methods.skvq_quant import dequant_range, levels_of
from mmkv.methods.xquant import calibrate

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
BITS = st.sampled_from([1, 2, 4, 8])


def sample(seed, shape, dtype, scale):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + torch.randn(1, generator=g) * scale).to(dtype)


def fp16_slack(lo, hi):
    """How far fp16 rounding of scale and zero can move a reconstruction (relative 2^-11 of each, times levels)."""
    return (hi.abs() + lo.abs() + (hi - lo).abs()) * 2e-3 + 1e-6


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), bits=BITS, n=st.integers(1, 40), d=st.integers(1, 12), dtype=DTYPES,
       scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_minmax_codes_range_and_round_trip_bound(seed, bits, n, d, dtype, scale):
    x = sample(seed, (n, d), dtype, scale).float()
    lo, hi = x.amin(0, keepdim=True), x.amax(0, keepdim=True)
    codes, s, z = minmax_codes(x, lo, hi, bits)
    levels = (1 << bits) - 1
    assert codes.dtype == torch.uint8 and int(codes.max()) <= levels
    sf, zf = s.float(), z.float()
    assert torch.allclose(zf, lo, rtol=1e-3, atol=1e-7)  # the zero is the minimum...
    # ...and z + (2^b - 1) s the maximum, up to fp16 rounding of s: relative 2^-11, or the subnormal step 2^-24
    # once the range is tiny (a 1e-3 range at 8 bits has s ~ 4e-6, below fp16's normal range)
    sub = levels * 2.0**-24
    assert torch.allclose(zf + levels * sf, hi, rtol=2e-3, atol=sub + 1e-6 + 2e-3 * float((hi - lo).abs().max()))
    err = (codes.float() * sf + zf - x).abs()
    assert (err <= sf / 2 + fp16_slack(lo, hi) + sub).all()


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), bits=BITS, dim=st.integers(0, 2), rows=st.integers(1, 3),
       cols=st.integers(1, 5))
def test_pack_unpack_round_trip(seed, bits, dim, rows, cols):
    per = per_byte(bits)
    shape = [rows, cols, 2]
    shape[dim] *= per
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.uint8)
    packed = pack(codes, bits, dim)
    assert packed.shape[dim] == shape[dim] // per
    assert torch.equal(unpack(packed, bits, dim), codes)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), d=st.integers(1, 23))
def test_ternary_pack_round_trip(seed, d):
    codes = torch.randint(0, 3, (2, d), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_ternary(codes)
    assert packed.shape[-1] == -(-d // 5) and int(packed.max()) <= 242
    assert torch.equal(unpack_ternary(packed, d), codes)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), bits=BITS, nb=st.integers(1, 3), block=st.sampled_from([8, 16]),
       cut=st.integers(0, 15), dtype=DTYPES)
def test_channel_quantize_ranges_ignore_padding(seed, bits, nb, block, cut, dtype):
    """Per (block, channel) ranges over valid tokens only: huge values in the padding change nothing."""
    t = nb * block
    n = max(1, t - cut)
    x = sample(seed, (1, 2, t, 4), dtype, 3.0).float()
    padded = x.clone()
    padded[:, :, n:] = 1e4
    lens = torch.tensor([n])
    c1, s1, z1 = channel_quantize(x, lens, bits, block)
    c2, s2, z2 = channel_quantize(padded, lens, bits, block)
    assert torch.equal(s1, s2) and torch.equal(z1, z2) and torch.equal(c1[:, :, :n], c2[:, :, :n])
    assert int(c1.max()) <= (1 << bits) - 1
    xb = x[:, :, :n]
    s = s1.float().repeat_interleave(block, 2)[:, :, :n]
    z = z1.float().repeat_interleave(block, 2)[:, :, :n]
    err = (c1[:, :, :n].float() * s + z - xb).abs()
    assert (err <= s / 2 + 2e-3 * (xb.abs().amax() + 1)).all()


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), bits=BITS, t=st.integers(1, 9), group=st.sampled_from([4, 8, 16]),
       ng=st.integers(1, 3), dtype=DTYPES)
def test_token_group_quantize_bounds(seed, bits, t, group, ng, dtype):
    x = sample(seed, (1, 2, t, group * ng), dtype, 2.0).float()
    codes, s, z = token_group_quantize(x, bits, group)
    assert s.shape == (1, 2, t, ng) and int(codes.max()) <= (1 << bits) - 1
    xg = x.reshape(1, 2, t, ng, group)
    assert torch.allclose(z.float(), xg.amin(-1), rtol=1e-3, atol=1e-6)
    deq = codes.reshape(1, 2, t, ng, group).float() * s.float()[..., None] + z.float()[..., None]
    assert ((deq - xg).abs() <= s.float()[..., None] / 2 + 2e-3 * (xg.abs().amax() + 1)).all()


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), bits=st.sampled_from([1, 1.5, 2, 3, 4, 8]), fp8=st.booleans(),
       alpha=st.floats(0.5, 1.0))
def test_skvq_fake_quant_bound_and_levels(seed, bits, fp8, alpha):
    x = sample(seed, (1, 1, 6, 16), torch.float32, 2.0)
    lo, hi = x.amin(-1, keepdim=True) * alpha, x.amax(-1, keepdim=True) * alpha
    deq = dequant_range(x, lo, hi, bits, fp8)
    levels = levels_of(bits)
    assert levels == {1: 1, 1.5: 2, 2: 3, 3: 7, 4: 15, 8: 255}[bits]
    step = (hi - lo) / levels
    rel = 0.07 if fp8 else 2e-3  # E4M3 keeps 3 mantissa bits
    inside = (x >= lo) & (x <= hi)
    slack = step / 2 + rel * (hi.abs() + lo.abs() + (hi - lo)) + 1e-6
    assert ((deq - x).abs() <= slack)[inside].all()
    assert (deq >= lo - slack).all() and (deq <= hi + slack).all()  # clipping: nothing outside [lo, hi]


@SETTINGS
@given(s=st.floats(1e-3, 10.0), z=st.floats(-10.0, 10.0), eta=st.floats(0.0, 0.49), bits=st.sampled_from([1, 2]))
def test_xquant_calibrated_endpoints_sit_eta_inside(s, z, eta, bits):
    """Eq. 12-13 (mmkv folds in fp32, stores fp16): the lowest level moves up by eta of the range, the highest down by as much."""
    st_, zt = torch.tensor([s], dtype=torch.float64), torch.tensor([z], dtype=torch.float64)
    s2, z2 = calibrate(st_, zt, eta, bits)
    levels = (1 << bits) - 1
    width = s * levels
    assert z2.item() == pytest.approx(z + eta * width, rel=1e-6, abs=1e-6)  # computed in fp32
    assert (z2 + levels * s2).item() == pytest.approx(z + (1 - eta) * width, rel=1e-6, abs=1e-6)  # computed in fp32
