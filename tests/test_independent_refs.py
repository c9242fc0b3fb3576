"""Independent fp64 references, one per method (issue 33, item 3): nothing here imports mmkv's dequantizers.

Each test quantizes the *original* K/V itself, in float64, straight from the paper's formula (scales and zeros
rounded to their fp16 storage, codes rounded against the stored values, as the layouts specify), reads the
stored bits with its own unpacking, and checks mmkv's stored scale/zero/codes and its decode attention against
that. A constant folded wrongly into a scale or zero (XQuant's eta, SKVQ's alpha, CalibQuant's calibration) shows
here even though ``dequantize_segment`` and the decode path would agree with each other.

Papers: CalibQuant arXiv 2502.14882 (Sec. 2.1 Eq. 3-4, Sec. 2.3 g(x)); KIVI arXiv 2402.02750 (Sec. 3); XQuant
(data-free calibration Eq. 12-13, cross-layer sharing Sec. 3.3; the cross-layer KV paper by Yang et al., 2025);
SKVQ arXiv 2405.06219 (Sec. 3.1 Eq. 2); AQUA-KV "Cache Me If You Must" (Shutova et al., 2025; Alg. 3);
AlignedKV (Tan et al., 2024; "Dynamic Quantization" bit planes).
"""

import math

import numpy as np
import pytest
import torch

from kernels.reference import aligned_attention, dequantize_segment
from mmkv.attention import mmkv_attention
from mmkv.cache import MMKVCache
from mmkv.methods.alignedkv import AlignedKV
from mmkv.methods.aquakv_codec import Predictors, decode, encode
from mmkv.methods.aquakv_quant import Quantizer
from mmkv.methods.calibquant import CalibQuant
from mmkv.methods.eden_grids import GRIDS
from mmkv.methods.skvq import SKVQLayer
from mmkv.methods.xquant import calibrate
from mmkv.spec import CacheSpec

F64 = torch.float64
H, D, HQ = 2, 32, 4


def f16(x):
    return x.to(torch.float16).to(F64)


def unpack_bits(p: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Byte j holds items j*per .. j*per+per-1, item i in bits [i*bits, (i+1)*bits) (least significant first)."""
    per, mask = 8 // bits, (1 << bits) - 1
    p = p.to(torch.int64).movedim(dim, -1)
    out = torch.stack([(p >> (i * bits)) & mask for i in range(per)], -1).flatten(-2)
    return out.movedim(-1, dim)


def rtn(x, lo, hi, bits):
    """Min/max round-to-nearest (Eq. 3-4): fp16 scale and zero, codes against them -> (codes, scale, zero) fp64."""
    levels = (1 << bits) - 1
    s, z = f16((hi - lo) / levels), f16(lo)
    codes = torch.round((x - z) / torch.where(s > 0, s, 1.0)).clamp(0, levels)
    return codes, s, z


def ref_attention(q, parts, scale):
    """fp64 decode attention: ``q [Hq, D]``; parts: (K [H, n, D], V [H, n, D], (tau1, tau2) or None)."""
    g = q.shape[0] // parts[0][0].shape[0]
    out = []
    for hq in range(q.shape[0]):
        logits, values = [], []
        for k, v, calib in parts:
            x = k[hq // g].to(F64) @ q[hq].to(F64) * scale
            if calib is not None and x.numel() > 1 and x.max() > x.min():
                gam, dlt = x.min(), x.max()  # CalibQuant Sec. 2.3: [gamma, delta] -> [gamma - tau1, delta - tau2]
                x = (dlt - gam + calib[0] - calib[1]) / (dlt - gam) * (x - gam) + gam - calib[0]
            logits.append(x)
            values.append(v[hq // g].to(F64))
        p = torch.softmax(torch.cat(logits), 0)
        out.append(p @ torch.cat(values))
    return torch.stack(out)


class Attn(torch.nn.Module):
    is_causal = True


def decode_step(cache, layer, k1, v1, q):
    keys, values = cache.update(k1, v1, layer)
    out, _ = mmkv_attention(Attn(), q[None, :, None], keys, values, None, scaling=1 / math.sqrt(D))
    return out[0, 0].to(F64)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def data(t, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, H, t, D, generator=g) * 2 + torch.randn(1, H, 1, D, generator=g) * 3
    v = torch.randn(1, H, t, D, generator=g)
    q = torch.randn(HQ, D, generator=g) * spread
    return k, v, q


# --- CalibQuant -------------------------------------------------------------------------------------------------
def test_calibration_is_on_exactly_at_one_and_two_bits():
    """Sec. 2.3 targets the low-bit endpoints: on for b = 1 and 2 with the released (tau1, tau2) = (0, 3), off above."""
    assert {b: CalibQuant(bits=b).calib for b in (1, 2, 4, 8)} == {1: (0.0, 3.0), 2: (0.0, 3.0), 4: None, 8: None}
    assert CalibQuant(bits=2, calibrate=False).calib is None
    assert CalibQuant(bits=2, tau1=1.0, tau2=2.0).calib == (1.0, 2.0)


@pytest.mark.parametrize("bits,value_axis,clip", [(1, "channel", "off"), (1, "channel", "authors"),
                                                 (2, "channel", "authors"), (2, "global", "authors"),
                                                 (4, "channel", "authors")])
def test_calibquant_visual_decode_against_fp64_paper_reference(bits, value_axis, clip):
    """30 text + 45 visual tokens: channel-wise codes per (head, channel) over the span, dequantized
    ``code * (beta - alpha) / (2^b - 1) + alpha``; logits of the visual span calibrated for b <= 2. The range is
    ``[alpha, beta]`` = min/max (the paper), or with the authors' released clip (the default) ``[c min, c max]``,
    c = 0.5 for K and 0.3 for V at 1 bit (none at 2+ bits), values outside it saturating."""
    k, v, q = data(76, seed=bits, spread=3.0)  # large logits: calibration (range - 3) matters
    vis = torch.zeros(1, 75, dtype=torch.bool)
    vis[0, 10:55] = True
    cache = MMKVCache(CacheSpec.parse(f"visual=calibquant:bits={bits},value_axis={value_axis},clip={clip} text=fp16 "
                                      "window=8"), 1)
    cache.set_inputs(None, vis)
    cache.update(k[:, :, :75], v[:, :, :75], 0)
    out = decode_step(cache, 0, k[:, :, 75:], v[:, :, 75:], q)

    xk, xv = k[0, :, 10:55].to(F64), v[0, :, 10:55].to(F64)
    c_k, c_v = (0.5, 0.3) if clip == "authors" and bits == 1 else (1.0, 1.0)
    ck, sk, zk = rtn(xk, c_k * xk.amin(1, keepdim=True), c_k * xk.amax(1, keepdim=True), bits)
    vdims = (1, 2) if value_axis == "global" else (1,)
    cv, sv, zv = rtn(xv, c_v * xv.amin(vdims, keepdim=True), c_v * xv.amax(vdims, keepdim=True), bits)
    seg = cache.layers[0].visual[0]
    got = unpack_bits(seg.k_codes, bits, dim=2)[0, :, :45]
    assert (got == ck).double().mean() > 0.999
    assert torch.allclose(seg.k_scale[0, :, 0].to(F64), sk[:, 0]) and torch.allclose(seg.k_zero[0, :, 0].to(F64), zk[:, 0])
    assert torch.allclose(seg.v_scale[0, :, 0].to(F64), sv[:, 0].expand(H, D))
    kd, vd = ck * sk + zk, cv * sv + zv
    if c_k == 1.0:
        assert (kd - xk).abs().max() <= sk.max() / 2 * 1.01 + 1e-3  # within half a step of the original
    else:  # clipped: the codes saturate at the clipped ends, which every dequantized key equals
        assert torch.all((kd - zk).abs().le(1e-9) | (kd - (zk + sk)).abs().le(1e-9))
        assert (ck == 0).any() and (ck == 1).any() and torch.all((xk < zk) <= (ck == 0))
    text = torch.cat([torch.arange(10), torch.arange(55, 76)])
    calib = (0.0, 3.0) if bits <= 2 else None
    want = ref_attention(q, [(k[0][:, text], v[0][:, text], None), (kd, vd, calib)], 1 / math.sqrt(D))
    assert rel(out, want) < 2e-3
    if bits <= 2:  # the calibrated answer is far from the uncalibrated one: the check above can tell them apart
        plain = ref_attention(q, [(k[0][:, text], v[0][:, text], None), (kd, vd, None)], 1 / math.sqrt(D))
        assert rel(plain, want) > 20 * rel(out, want)


# --- KIVI and XQuant (text: keys per channel in blocks of `group` tokens, values per token in channel groups) ------
def kivi_ref(xk, xv, k_bits, v_bits, group, eta_k=0.0, eta_v=0.0, codes_from=None):
    """fp64 KIVI dequantization of ``[H, n, D]`` (n a multiple of group), with XQuant's Eq. 12-13 calibration
    ``z' = z + eta * s * (2^B - 1)``, ``s' = (1 - 2 eta) s`` on fp16 scale/zero, and optionally the key codes of
    another layer (``codes_from``: its original keys) read with this layer's own scale and zero."""
    h, n, d = xk.shape
    kb = xk.reshape(h, n // group, group, d)
    ck, sk, zk = rtn(kb, kb.amin(2, keepdim=True), kb.amax(2, keepdim=True), k_bits)
    if codes_from is not None:
        ob = codes_from.reshape(h, n // group, group, d)
        ck, _, _ = rtn(ob, ob.amin(2, keepdim=True), ob.amax(2, keepdim=True), k_bits)
    lk = (1 << k_bits) - 1
    if eta_k:
        sk, zk = f16((1 - 2 * eta_k) * sk), f16(zk + eta_k * sk * lk)
    vg = xv.reshape(h, n, d // group, group)
    cv, sv, zv = rtn(vg, vg.amin(3, keepdim=True), vg.amax(3, keepdim=True), v_bits)
    lv = (1 << v_bits) - 1
    if eta_v:
        sv, zv = f16((1 - 2 * eta_v) * sv), f16(zv + eta_v * sv * lv)
    return (ck * sk + zk).reshape(h, n, d), (cv * sv + zv).reshape(h, n, d)


def text_parts(cache, layer, k, v, n_text, sinks):
    """The fp16 part (sinks + window, read raw) of a row after `n_text` tokens left the window."""
    lay = cache.layers[layer]
    dn = lay.dense_len[0]
    return (lay.dense.k[0, :, :dn], lay.dense.v[0, :, :dn], None), (k[0, :, sinks : sinks + n_text], v[0, :, sinks : sinks + n_text])


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_kivi_decode_against_fp64_reference(bits):
    k, v, q = data(101, seed=10 + bits)
    cache = MMKVCache(CacheSpec.parse(f"text=kivi:bits={bits},group=16 window=8 sinks=3"), 1)
    cache.update(k[:, :, :100], v[:, :, :100], 0)
    out = decode_step(cache, 0, k[:, :, 100:], v[:, :, 100:], q)
    n = (100 - 3 - 8) // 16 * 16
    dense, (xk, xv) = text_parts(cache, 0, k, v, n, 3)
    kd, vd = kivi_ref(xk.to(F64), xv.to(F64), bits, bits, 16)
    assert torch.equal(dense[0][:, :3], k[0, :, :3])
    want = ref_attention(q, [dense, (kd, vd, None)], 1 / math.sqrt(D))
    assert rel(out, want) < 1e-4


def test_xquant_eq_12_13_by_hand():
    """z' = z + eta * s * (2^B - 1), s' = (1 - 2 eta) s: s = 0.5, z = -1, eta = 0.1."""
    s, z = torch.tensor([0.5], dtype=F64), torch.tensor([-1.0], dtype=F64)
    for bits, zero in ((1, -0.95), (2, -0.85), (4, -0.25)):
        s2, z2 = calibrate(s, z, 0.1, bits)
        assert s2.item() == pytest.approx(0.4) and z2.item() == pytest.approx(zero), bits
    assert calibrate(s, z, 0.0, 2) == (s, z)


@pytest.mark.parametrize("kq,vq,eta1,eta2", [(0, 0, 1 / 6, 0.045), (4, 4, 1 / 6, 0.045), (3, 1, 0.1, 0.2)])
def test_xquant_calibrated_and_shared_layers_against_fp64_reference(kq, vq, eta1, eta2):
    """4 layers, keys shared from layer 2 on, values from layer 3: each layer's decode output against fp64
    attention over K/V dequantized with the calibrated endpoints of Eq. 12-13 (odd shared layers: the previous
    layer's codes, their own scale and zero)."""
    layers, t, sinks, window, group = 4, 77, 2, 8, 16
    spec = f"text=xquant:kq={kq},vq={vq},km=2,vm=3,eta1={eta1},eta2={eta2},group={group} window={window} sinks={sinks}"
    cache = MMKVCache(CacheSpec.parse(spec), num_layers=layers, head_dim=D)
    ks, vs, g = [], [], torch.Generator().manual_seed(kq * 10 + vq)
    base = torch.randn(1, H, t, D, generator=g)
    for l in range(layers):  # neighbouring layers alike (their codes are shared)
        ks.append(base * 2 + 0.3 * torch.randn(1, H, t, D, generator=g) + 0.1 * l)
        vs.append(base + 0.3 * torch.randn(1, H, t, D, generator=g))
        cache.update(ks[l][:, :, :-1], vs[l][:, :, :-1], l)
    cache.finalize()
    n = (t - 1 - sinks - window) // group * group
    q = torch.randn(HQ, D, generator=g)
    for l in range(layers):
        shared_k, shared_v = l >= 2 and l % 2 == 1, l >= 3 and l % 2 == 1
        kb = 2 if (l - 1 if shared_k else l) < kq else 1
        vb = 2 if (l - 1 if shared_v else l) < vq else 1
        eta = {1: eta1, 2: eta2}
        out = decode_step(cache, l, ks[l][:, :, -1:], vs[l][:, :, -1:], q)
        dense, (xk, xv) = text_parts(cache, l, ks[l], vs[l], n, sinks)
        kd, vd = kivi_ref(xk.to(F64), xv.to(F64), kb, vb, group, eta[kb], eta[vb],
                          codes_from=ks[l - 1][0, :, sinks : sinks + n].to(F64) if shared_k else None)
        if shared_v:  # values read the previous layer's codes too: rebuild them from its values
            pv = vs[l - 1][0, :, sinks : sinks + n].to(F64).reshape(H, n, D // group, group)
            cv, _, _ = rtn(pv, pv.amin(3, keepdim=True), pv.amax(3, keepdim=True), vb)
            own = xv.to(F64).reshape(H, n, D // group, group)
            _, sv, zv = rtn(own, own.amin(3, keepdim=True), own.amax(3, keepdim=True), vb)
            lv = (1 << vb) - 1
            vd = (cv * f16((1 - 2 * eta[vb]) * sv) + f16(zv + eta[vb] * sv * lv)).reshape(H, n, D)
        want = ref_attention(q, [dense, (kd, vd, None)], 1 / math.sqrt(D))
        assert rel(out, want) < 1e-4, l


# --- SKVQ: per-token groups in a reordered channel order, clipping alpha folded into scale and zero ----------------
@pytest.mark.parametrize("k_bits,v_bits", [(2, 2), (3, 1.5), (4, 1)])
def test_skvq_clipped_reordered_groups_against_fp64_reference(k_bits, v_bits):
    """Eq. 2: lo = alpha * min, hi = alpha * max per (token, group) in the stored (permuted) channel order; the
    dequantized tensor comes back in natural order."""
    group, t = 16, 24
    g = torch.Generator().manual_seed(k_bits)
    x = torch.randn(1, H, t, D, generator=g) * 2
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(H)])
    alpha = torch.rand(H, D // group, generator=g) * 0.4 + 0.6
    lay = SKVQLayer(k_bits=k_bits, v_bits=v_bits, group=group, reorder=True, clip=True, groups="fixed")
    lay.layer_idx, lay.tables = 0, {"k_perm": perm, "v_perm": perm, "k_alpha": alpha, "v_alpha": alpha}
    seg = lay.quantize(x, x, torch.tensor([t]))
    stored = torch.stack([x[0, h][:, perm[h]] for h in range(H)]).to(F64)  # [H, T, D] in stored order
    sg = stored.reshape(H, t, D // group, group)
    a = alpha.to(F64)[:, None, :, None]
    for bits, codes, hi, scale, zero in ((k_bits, seg.k_codes, seg.k_hi, seg.k_scale, seg.k_zero),
                                         (v_bits, seg.v_codes, seg.v_hi, seg.v_scale, seg.v_zero)):
        levels = 2 if bits == 1.5 else (1 << int(bits)) - 1
        s, z = f16((sg.amax(3, keepdim=True) - sg.amin(3, keepdim=True)) * a / levels), f16(sg.amin(3, keepdim=True) * a)
        assert torch.equal(scale[0].to(F64), s[..., 0]) and torch.equal(zero[0].to(F64), z[..., 0])
        if bits == 1.5:  # five base-3 digits per byte
            p = codes[0].to(torch.int64)
            c = torch.stack([(p // 3**i) % 3 for i in range(5)], -1).flatten(-2)[..., :D]
        elif bits == 3:  # a 2-bit plane of the low bits, a 1-bit plane of the high bit
            c = unpack_bits(codes[0], 2, 2) | (unpack_bits(hi[0], 1, 2) << 2)
        else:
            c = unpack_bits(codes[0], int(bits), 2)
        want = torch.round((sg - z) / s).clamp(0, levels).reshape(H, t, D)
        assert (c.to(F64) == want).double().mean() > 0.999
        deq = c.to(F64).reshape(H, t, D // group, group) * s + z
        inside = (sg >= z) & (sg <= z + levels * s)  # inside the clipped range: within half a step
        assert inside.double().mean() > 0.5
        assert ((deq - sg).abs() <= s / 2 + 1e-3)[inside].all()
        natural = torch.empty(H, t, D, dtype=F64)
        for h in range(H):
            natural[h][:, perm[h]] = deq[h].reshape(t, D)
        mk, mv = dequantize_segment(seg)  # mmkv's dequantizer, only compared against
        assert torch.allclose((mk if codes is seg.k_codes else mv)[0].to(F64), natural, atol=1e-5)


# --- AQUA-KV: residual codes over a linear prediction from the previous layer (Alg. 3) ----------------------------
def hadamard(gsize, seed):
    """diag(signs) H_g / sqrt(g), Sylvester's H, signs +-1 drawn from `seed` (the documented recipe)."""
    h = np.array([[1.0]])
    while h.shape[0] < gsize:
        h = np.block([[h, h], [h, -h]])
    signs = torch.randint(0, 2, (gsize,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return signs[:, None] * torch.from_numpy(h) / math.sqrt(gsize)


def pow2_group(c):
    g = 1
    while c % (2 * g) == 0 and 2 * g <= 1024:
        g *= 2
    return g


def sylvester(g):
    h = np.array([[1.0]])
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    return torch.from_numpy(h)


def higgs_dequant(codes, scale, bits):
    """HIGGS (AQUA-KV's HiggsQuantizer): pair index = low code | high code << bits; x = H (norm * point) / g."""
    idx = codes[..., 0::2] | (codes[..., 1::2] << bits)
    grid = torch.tensor(GRIDS[bits], dtype=F64)
    c = codes.shape[-1]
    g = pow2_group(c)
    y = grid[idx].reshape(*idx.shape[:-1], c // g, g) * scale.to(F64)[..., None]
    return (y @ sylvester(g) / g).flatten(-2)


@pytest.mark.parametrize("bits,channels", [(2, 192), (3, 96), (4, 1024), (2, 2048)])
def test_higgs_codes_are_the_nearest_grid_points_of_the_rotated_normalized_groups(bits, channels):
    x = torch.randn(300, channels, generator=torch.Generator().manual_seed(bits + channels)) * 3
    c = Quantizer(bits, 64, "higgs").encode(x)
    g = pow2_group(channels)
    xg = x.to(F64).reshape(300, channels // g, g)
    assert torch.equal(c.scale.to(F64), f16(xg.norm(dim=-1)))
    y = (xg @ sylvester(g)) / f16(xg.norm(dim=-1))[..., None]
    grid = torch.tensor(GRIDS[bits], dtype=F64)
    want = ((y.reshape(-1, 1, 2) - grid[None]) ** 2).sum(-1).argmin(-1).reshape(300, -1)
    codes = unpack_bits(c.planes[0], 2, -1) | (unpack_bits(c.planes[1], 1, -1) << 2) if bits == 3 else \
        unpack_bits(c.planes[0], bits, -1)
    got = codes[..., 0::2] | (codes[..., 1::2] << bits)
    assert (got == want).double().mean() > 0.999  # fp32 vs fp64 scores may flip a near tie
    assert torch.allclose(Quantizer(bits, 64, "higgs").decode(c).to(F64), higgs_dequant(codes, c.scale, bits),
                          atol=1e-4)


def aqua_dequant(c, bits, group, kind, seed=0):
    if bits == 3:
        codes = unpack_bits(c.planes[0], 2, -1) | (unpack_bits(c.planes[1], 1, -1) << 2)
    else:
        codes = unpack_bits(c.planes[0], bits, -1)
    if kind == "higgs":
        return higgs_dequant(codes, c.scale, bits)
    xg = codes.to(F64).reshape(*codes.shape[:-1], -1, group) * c.scale.to(F64)[..., None] + c.zero.to(F64)[..., None]
    if kind == "hadamard":
        xg = xg @ hadamard(group, seed).T
    return xg.flatten(-2)


@pytest.mark.parametrize("bits,kind", [(2, "uniform"), (3, "hadamard"), (4, "uniform"), (2, "hadamard"),
                                       (2, "higgs"), (3, "higgs")])
def test_aquakv_layer_decode_against_fp64_reference(bits, kind):
    c, group, n = 64, 16, 20
    g = torch.Generator().manual_seed(bits)
    pred = Predictors(torch.randn(1, c, c, generator=g) / 8, torch.randn(1, c, generator=g),
                      torch.randn(1, 2 * c, c, generator=g) / 8, torch.randn(1, c, generator=g))
    q = Quantizer(bits, group, kind)
    k0, v0 = torch.randn(n, c, generator=g) * 2, torch.randn(n, c, generator=g)
    k1, v1 = k0 @ pred.k_weight[0] + 0.3 * torch.randn(n, c, generator=g), torch.randn(n, c, generator=g)
    kq0, vq0, kh0, vh0 = encode(0, k0, v0, None, pred, q, q)
    kq1, vq1, _, _ = encode(1, k1, v1, (kh0, vh0), pred, q, q)
    # layer 0: plain codes; layer 1: K^ = Q^-1(K_q) + K^_0 W_k + b_k, V^ = Q^-1(V_q) + [V^_0 ; K^] W_v + b_v
    rk0, rv0 = aqua_dequant(kq0, bits, group, kind), aqua_dequant(vq0, bits, group, kind)
    w = {n_: t.to(F64) for n_, t in pred.tensors().items()}
    rk1 = aqua_dequant(kq1, bits, group, kind) + rk0 @ w["k_weight"][0] + w["k_bias"][0]
    rv1 = aqua_dequant(vq1, bits, group, kind) + torch.cat([rv0, rk1], -1) @ w["v_weight"][0] + w["v_bias"][0]
    dk0, dv0 = decode(0, kq0, vq0, None, pred, q, q)
    dk1, dv1 = decode(1, kq1, vq1, (dk0, dv0), pred, q, q)
    for got, want in ((dk0, rk0), (dv0, rv0), (dk1, rk1), (dv1, rv1)):
        assert torch.allclose(got.to(F64), want, atol=1e-4, rtol=1e-4)
    if kind == "higgs":  # no step to bound: the grid is not uniform (its error is pinned in test_aquakv.py)
        return
    # the residual is what was quantized: each reconstruction within half a step (of its own rotated range)
    step = max(float(kq1.scale.max()), float(vq1.scale.max()))
    bound = step / 2 * (math.sqrt(group) if kind == "hadamard" else 1) + 1e-3
    assert (rk1 - k1.to(F64)).abs().max() <= bound


# --- AlignedKV: exact fp16 in bit planes; a partial read keeps the planes read and fills 100... -----------------
def planes_to_words(hi, mid, low):
    """[.., NB, D, block] hi bytes, [.., block/2] nibble pairs (token 2i low nibble, 2i+1 high) -> uint16 words."""
    def nib(p):
        p = p.to(torch.int64)
        return torch.stack((p & 15, p >> 4), -1).flatten(-2)
    return (hi.to(torch.int64) << 8) | (nib(mid) << 4) | nib(low)


def words_to_f16(w):
    return torch.from_numpy(w.numpy().astype(np.uint16).view(np.float16).astype(np.float64))


@pytest.mark.parametrize("force", [8, 12, 16])
def test_alignedkv_planes_and_uniform_reads_against_fp64_reference(force):
    block, t = 32, 50
    g = torch.Generator().manual_seed(force)
    k = (torch.randn(1, H, t, D, generator=g) * 3).half()
    v = torch.randn(1, H, t, D, generator=g).half()
    seg = AlignedKV(block=block).quantize(k, v, torch.tensor([t]))
    keep, fill = {8: (0xFF00, 0x80), 12: (0xFFF0, 0x8), 16: (0xFFFF, 0)}[force]
    kv = []
    for x, planes in ((k, (seg.k_hi, seg.k_mid, seg.k_low)), (v, (seg.v_hi, seg.v_mid, seg.v_low))):
        w = planes_to_words(*planes)[0]  # [H, NB, D, block]
        full = words_to_f16(w).permute(0, 1, 3, 2).reshape(H, -1, D)[:, :t]
        assert torch.equal(full, x[0].to(F64))  # storage is exact
        kv.append(words_to_f16((w & keep) | fill).permute(0, 1, 3, 2).reshape(H, -1, D)[:, :t])
    seg.force_bits = force
    q = torch.randn(1, HQ, D, generator=g)
    out, _, lk, _ = aligned_attention(q, seg, 1 / math.sqrt(D))
    want = ref_attention(q[0], [(kv[0], kv[1], None)], 1 / math.sqrt(D))
    assert rel(out[0].to(F64), want) < 1e-5
    assert int(lk.min()) == int(lk.max()) == force
