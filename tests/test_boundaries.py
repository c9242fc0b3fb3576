"""Boundary sweeps (issue 33, item 2): every place where the code rounds, splits or flushes, hit at every length.

* Bytes of every segment layout for each length 1..300 and for ragged rows, against closed forms written here
  (``ceil`` wherever a packed byte, a scale row or a block covers several tokens); effective bits of the cache.
* The fp16 window: sinks stay put, the window keeps between ``window`` and ``window + block - 1`` recent tokens,
  exactly ``floor((n - sinks - window) / block) * block`` tokens have left it, over a sweep of prompt and decode
  lengths (``sinks + window + block - 1`` tokens included).
* XQuant's per-layer plan for every ``km``/``vm`` (odd and even) against Algorithm 1's rule written here.

The references are the definitions (KIVI arXiv 2402.02750 Sec. 3; CalibQuant arXiv 2502.14882 Sec. 2.1; SKVQ
arXiv 2405.06219 Sec. 3.1; docs/CACHE.md), never mmkv's own output.
"""

import dataclasses

import pytest
import torch

from kernels.layouts import DenseSeg
from mmkv.cache import MMKVCache
from mmkv.cache import segments as S
from mmkv.methods import KIVI, CalibQuant
from mmkv.methods.alignedkv import AlignedKV
from mmkv.methods.skvq import SKVQ
from mmkv.methods.xquant import XQuant
from mmkv.spec import CacheSpec

H, D = 2, 32
LENGTHS = range(1, 301)
RAGGED = [(1, 300), (7, 0), (33, 31), (64, 65), (129, 2), (255, 256)]


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def kv(b, t, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, H, t, D, generator=g).to(dtype), torch.randn(b, H, t, D, generator=g).to(dtype)


# --- closed forms: bytes that n valid tokens of one row occupy (one layer, H heads, D channels) -----------------
def dense_bytes(n, elem=2):
    return 2 * H * D * elem * n


def channel_bytes(n, bits, block, global_v=False):
    """CalibQuant: codes packed 8/bits tokens per byte along tokens, an fp16 scale and zero per block per channel."""
    per = 8 // bits
    k = H * D * ceil(n, per) + 2 * 2 * H * D * ceil(n, block)
    v = H * D * ceil(n, per) + 2 * 2 * H * (1 if global_v else D) * ceil(n, block)
    return k + v


def kivi_bytes(n, k_bits, v_bits, group, k_codes=True):
    """KIVI: keys as CalibQuant with block = group; values per token, packed along channels, a scale and zero per
    group of channels."""
    k = (H * D * ceil(n, 8 // k_bits) if k_codes else 0) + 2 * 2 * H * D * ceil(n, group)
    v = H * n * D * v_bits // 8 + 2 * 2 * H * n * (D // group)
    return k + v


def skvq_code_bytes(bits):
    if bits == 1.5:
        return ceil(D, 5)  # five ternary digits per byte
    if bits == 3:
        return D // 4 + D // 8  # a 2-bit plane and a 1-bit plane
    return D * int(bits) // 8


def skvq_bytes(n, k_bits, v_bits, group, fp8):
    ng, s = D // min(group, D), (1 if fp8 else 2)
    return n * H * (skvq_code_bytes(k_bits) + skvq_code_bytes(v_bits) + 2 * 2 * ng * s)


def aligned_bytes(n, block):
    """AlignedKV: whole blocks of 16-bit words (8 + 4 + 4 bit planes) plus one exponent byte per block and channel."""
    return 2 * H * D * ceil(n, block) * (2 * block + 1)


def check_bytes_sweep(seg, closed, rows=1):
    for n in LENGTHS:
        lens = [n] * rows
        assert S.used_nbytes(seg, lens) == rows * closed(n), n
    if rows == 2:
        for a, b in RAGGED:
            assert S.used_nbytes(seg, [a, b]) == closed(a) + closed(b), (a, b)


CAP = 320  # capacity of the segments under test (a multiple of every block)


def test_dense_bytes_every_length():
    k, v = kv(2, CAP)
    check_bytes_sweep(DenseSeg(k, v, torch.tensor([CAP, CAP])), dense_bytes, rows=2)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("block,global_v", [(16, False), (32, True), (64, False)])
def test_channel_segment_bytes_every_length(bits, block, global_v):
    k, v = kv(2, CAP)
    seg = CalibQuant(bits=bits, block=block, value_axis="global" if global_v else "channel").quantize(
        k, v, torch.tensor([CAP, CAP]))
    check_bytes_sweep(seg, lambda n: channel_bytes(n, bits, block, global_v), rows=2)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("group", [16, 32])
def test_kivi_segment_bytes_every_length(bits, group):
    k, v = kv(2, CAP)
    seg = KIVI(bits=bits, group=group).quantize(k, v, torch.tensor([CAP, CAP]))
    check_bytes_sweep(seg, lambda n: kivi_bytes(n, bits, bits, group), rows=2)


def test_xquant_shared_segment_holds_no_key_codes():
    """A layer that reads its partner's key codes holds only its own scale/zero (XQuant Sec. 3.3.4)."""
    k, v = kv(2, CAP)
    seg = dataclasses.replace(KIVI(bits=2, group=16).quantize(k, v, torch.tensor([CAP, CAP])), k_codes=None)
    check_bytes_sweep(seg, lambda n: kivi_bytes(n, 2, 2, 16, k_codes=False), rows=2)


@pytest.mark.parametrize("k_bits,v_bits,group,fp8", [(2, 2, 16, False), (3, 1.5, 32, True), (1, 3, 128, False),
                                                    (4, 8, 16, True)])
def test_skvq_segment_bytes_every_length(k_bits, v_bits, group, fp8):
    k, v = kv(2, CAP)
    m = SKVQ(k_bits=k_bits, v_bits=v_bits, group=group, fp8=fp8, reorder=False, clip=False)
    seg = m.quantize(k, v, torch.tensor([CAP, CAP]))
    check_bytes_sweep(seg, lambda n: skvq_bytes(n, k_bits, v_bits, group, fp8), rows=2)


@pytest.mark.parametrize("block", [32, 64])
def test_aligned_segment_bytes_every_length(block):
    k, v = kv(2, CAP)
    seg = AlignedKV(block=block).quantize(k, v, torch.tensor([CAP, CAP]))
    check_bytes_sweep(seg, lambda n: aligned_bytes(n, block), rows=2)


def visual_cache(bits, lens, seed=0):
    """One layer holding, per row, one text token (an fp16 sink) then ``lens[row]`` visual tokens."""
    b, t = len(lens), max(lens) + 1
    k, v = kv(b, t, seed=seed)
    mask = torch.zeros(b, t, dtype=torch.long)
    vis = torch.zeros(b, t, dtype=torch.bool)
    for row, n in enumerate(lens):
        mask[row, t - n - 1 :] = 1  # left padding, as a batch of prompts has
        vis[row, t - n :] = True
    cache = MMKVCache(CacheSpec.parse(f"visual=calibquant:bits={bits} text=fp16"), num_layers=1)
    cache.set_inputs(mask, vis)
    cache.update(k, v, 0)
    cache.finalize()
    return cache


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_visual_effective_bits_every_length(bits):
    """CalibQuant visual spans of every length 1..300 (ragged rows of one batch; one block per row's span, padded to
    the longest span rounded up to whole bytes, App. A.2): per row ``2 * H * D * ceil(n / per)`` bytes of codes
    plus an fp16 scale and zero per channel of K and V; effective bits = 8 * bytes / (n * 2 * H * D)."""
    per = 8 // bits
    cache = visual_cache(bits, list(LENGTHS))
    used = sum(2 * H * D * ceil(n, per) + 2 * 2 * 2 * H * D for n in LENGTHS)
    assert cache.nbytes_by_modality(used=True)["visual"] == used
    tokens = sum(LENGTHS)
    eff = cache.effective_bits()
    assert eff["visual"] == pytest.approx(8 * used / (tokens * 2 * H * D), rel=1e-12)
    assert eff["fp16"] == 16.0
    assert eff["total"] == pytest.approx((8 * used + 16 * 300 * 2 * H * D) / ((tokens + 300) * 2 * H * D), rel=1e-12)


@pytest.mark.parametrize("bits", [1, 2])
def test_visual_effective_bits_one_row_at_a_time(bits):
    """One row, n = 1..40: ``(8 * ceil(n / per) + 32) / n`` bits per element (1-bit, n = 9: (16 + 32) / 9)."""
    per = 8 // bits
    for n in range(1, 41):
        eff = visual_cache(bits, [n], seed=n).effective_bits()["visual"]
        assert eff == pytest.approx((8 * ceil(n, per) + 32) / n, rel=1e-12), n
    assert visual_cache(1, [9]).effective_bits()["visual"] == pytest.approx(48 / 9)


# --- the fp16 window: sinks, window and block flushes -------------------------------------------------------------
def left_window(n, sinks, window, block):
    """Tokens that have left the fp16 window after n tokens: whole blocks of what exceeds sinks + window."""
    return max(n - min(sinks, n) - window, 0) // block * block


def check_window(layer, k, n, sinks, window, block):
    text = left_window(n, sinks, window, block)
    assert (layer.text_len[0] if layer.text is not None else 0) == text, (n, sinks, window, block)
    dense = layer.dense_len[0]
    assert dense == n - text
    kept = min(sinks, n)
    assert dense - kept < window + block or n <= kept
    if n - kept >= window:
        assert dense - kept >= window  # the window never holds fewer than `window` recent tokens
    got = layer.dense.k[0, :, :dense]
    assert torch.equal(got[:, :kept], k[0, :, :kept])  # sinks are the first tokens, in place
    assert torch.equal(got[:, kept:], k[0, :, n - (dense - kept) : n])  # then the most recent ones, in order


@pytest.mark.parametrize("sinks,window,block", [(4, 8, 16), (0, 16, 16), (3, 5, 32), (5, 0, 16)])
def test_window_after_prefill_every_prompt_length(sinks, window, block):
    k, v = kv(1, 130, seed=1)
    edge = sinks + window + block - 1  # the longest prompt that flushes nothing
    lengths = sorted(set(range(1, 130)) | {edge, edge + 1, 2 * block + sinks + window - 1})
    for n in lengths:
        cache = MMKVCache(CacheSpec.parse(f"text=kivi:bits=8,group={block} window={window} sinks={sinks}"), 1)
        cache.update(k[:, :, :n], v[:, :, :n], 0)
        cache.finalize()
        check_window(cache.layers[0], k, n, sinks, window, block)
        if n == edge:
            assert cache.layers[0].text is None and cache.layers[0].dense_len == [edge]


@pytest.mark.parametrize("sinks,window,block", [(4, 8, 16), (0, 16, 16), (3, 5, 32)])
def test_window_during_decode_every_step(sinks, window, block):
    """Prompts of several lengths (the edges included), then 2 * block + 3 single-token steps, checked after each."""
    steps = 2 * block + 3
    k, v = kv(1, sinks + window + 3 * block + steps, seed=2)
    edge = sinks + window + block - 1
    for p in sorted({1, sinks, sinks + window, edge - 1, edge, edge + 1, edge + block}):
        p = max(p, 1)
        cache = MMKVCache(CacheSpec.parse(f"text=kivi:bits=8,group={block} window={window} sinks={sinks}"), 1)
        cache.update(k[:, :, :p], v[:, :, :p], 0)
        cache.finalize()
        layer = cache.layers[0]
        for n in range(p, p + steps):
            if n > p:
                cache.update(k[:, :, n - 1 : n], v[:, :, n - 1 : n], 0)
            check_window(layer, k, n, sinks, window, block)
            # a graph may replay `free` steps only if none of them flushes
            free = layer.decode_steps_free()
            assert left_window(n + free, sinks, window, block) == left_window(n, sinks, window, block)


# --- XQuant plans: Algorithm 1's layer rule for every km / vm parity -----------------------------------------------
def plan_by_hand(L, kq, vq, km, vm):
    """XQuant Sec. 3.3.4 / Algorithm 1 (G = 2): from layer m on, an odd layer reads the codes of the layer before it
    and quantizes at that layer's bit-width; layers below q use 2 bits, the rest 1 bit."""
    rows = []
    for l in range(L):
        row = {}
        for kind, q, m in (("k", kq, km), ("v", vq, vm)):
            shared = m <= l and l % 2 == 1
            src = l - 1 if shared else l
            row[f"{kind}_bits"], row[f"{kind}_shared"] = (2 if src < q else 1), shared
        rows.append(row)
    return rows


@pytest.mark.parametrize("L", [1, 2, 5, 6, 7])
def test_xquant_plan_every_km_vm(L):
    for km in range(L + 1):
        for vm in range(L + 1):
            for kq, vq in ((0, L), (L // 2, (L + 1) // 2), (km, vm)):
                cfg = XQuant(kq=kq, vq=vq, km=km, vm=vm)
                assert cfg.plan(L) == plan_by_hand(L, kq, vq, km, vm), (L, kq, vq, km, vm)


def test_xquant_odd_start_layer_shares_from_that_layer_on():
    """km = 3, vm = 5 of 7 layers: keys shared at layers 3 and 5, values at 5 only (m itself is odd, so it shares)."""
    plan = XQuant(kq=4, vq=1, km=3, vm=5).plan(7)
    assert [p["k_shared"] for p in plan] == [False, False, False, True, False, True, False]
    assert [p["v_shared"] for p in plan] == [False, False, False, False, False, True, False]
    assert [p["k_bits"] for p in plan] == [2, 2, 2, 2, 1, 1, 1]
    # App. A: K bits 2+2+2+0+1+0+1 = 8, V bits 2+1+1+1+1+0+1 = 7 -> 15 / 14
    assert XQuant(kq=4, vq=1, km=3, vm=5).equivalent_bits(7) == pytest.approx(15 / 14)
    cache = MMKVCache("text=xquant:kq=4,vq=1,km=3,vm=5 window=16 sinks=0", num_layers=7, head_dim=D)
    assert [layer.partner is not None for layer in cache.layers] == [False, False, False, True, False, True, False]
