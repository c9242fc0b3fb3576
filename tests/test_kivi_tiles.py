"""KIVI/XQuant values in tile order (``KiviSeg.v_order == "tiles"``, ``kernels.layouts.tile_channels``): the packing
the post-scaled GPU text kernel reads. On CPU: the permutation puts every 16-channel tensor-core tile in one group,
repacking round-trips exactly, bytes do not change, and the reference and every CPU decode path read a tile-order
segment to the result they give for the same codes in natural order; whole caches (KIVI, XQuant with shared and
averaged codes) flushed in tile order decode like the natural-order ones."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kernels
from kernels import testing
from kernels.decode.cpu import history_attention_cpu
from kernels.layouts import (
    KiviSeg,
    natural_values,
    order_index,
    pack,
    reorder_values,
    tile_channels,
    to_tile_order,
    unpack,
)
from kernels.reference import decode_reference, dequantize_segment
from kernels.switches import interpreted
from mmkv.cache import MMKVCache
from mmkv.cache import segments as S
from mmkv.spec import CacheSpec


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_tile_channels_is_a_permutation_whose_tiles_are_16_consecutive_channels(d):
    perm = tile_channels(d)
    assert sorted(perm.tolist()) == list(range(d))
    # the GPU kernel's A fragment: lane row r holds stored slots (d/8) r + c, and its 16-row tile t takes the slots
    # c in {2t, 2t + 1} of all 8 lane rows (rows r and r + 8 of the tile)
    for t in range(d // 16):
        slots = [(d // 8) * r + c for r in range(8) for c in (2 * t, 2 * t + 1)]
        assert sorted(perm[slots].tolist()) == list(range(16 * t, 16 * t + 16))


def test_tile_channels_rejects_a_head_dim_it_cannot_tile():
    with pytest.raises(ValueError, match="multiple of 16"):
        tile_channels(72)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("t", [1, 31, 33, 100])
def test_repack_round_trips_exactly(bits, t):
    g = torch.Generator().manual_seed(bits * 1000 + t)
    codes = torch.randint(0, 1 << bits, (2, 3, t, 128), generator=g, dtype=torch.uint8)
    tiled = pack(to_tile_order(codes), bits, dim=3)
    assert tiled.shape == pack(codes, bits, dim=3).shape and tiled.dtype == torch.uint8
    back = reorder_values(unpack(tiled, bits, dim=3), "tiles", "natural")
    assert torch.equal(back, codes)
    assert torch.equal(reorder_values(codes, "natural", "natural"), codes)


@pytest.mark.parametrize("d", [16, 128])
def test_order_index_is_made_once_per_device(d):
    """The permutation and its inverse, kept per (head_dim, device): a captured decode step that un-permutes values
    then copies nothing from the host."""
    fwd, inv = order_index(d, "cpu"), order_index(d, "cpu", inverse=True)
    assert torch.equal(fwd, tile_channels(d)) and torch.equal(fwd[inv], torch.arange(d))
    assert order_index(d, torch.device("cpu")) is fwd and order_index(d, "cpu", inverse=True) is inv


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_natural_values_can_be_captured_in_a_cuda_graph():
    """The Triton fallback of the text kernel reads tile-order values through ``natural_values``: after one eager
    call (as ``mmkv/graphs.py`` makes the first decode step) a graph capture of it must not fail."""
    seg = testing.kivi_seg(1, 2, 77, 128, 77, 2, 2, 32, 32, g=torch.Generator().manual_seed(3), order="tiles",
                           device="cuda")
    want = natural_values(seg).v_codes.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = natural_values(seg).v_codes
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def _pair(B, H, T, D, lens, kb, vb, blk, grp, seed):
    a = testing.kivi_seg(B, H, T, D, lens, kb, vb, blk, grp, g=torch.Generator().manual_seed(seed), order="natural")
    b = testing.kivi_seg(B, H, T, D, lens, kb, vb, blk, grp, g=torch.Generator().manual_seed(seed), order="tiles")
    return a, b


def test_natural_values_undoes_the_tile_order_on_a_partial_block():
    a, b = _pair(2, 2, 45, 64, [45, 7], 2, 1, 32, 16, 0)  # 45 tokens: one whole flush block and a partial one
    assert b.v_order == "tiles" and not torch.equal(a.v_codes, b.v_codes)
    n = natural_values(b)
    assert n.v_order == "natural" and torch.equal(n.v_codes, a.v_codes)
    assert natural_values(a) is a
    assert torch.equal(n.k_codes, a.k_codes) and n.v_scale is b.v_scale


def test_byte_counts_do_not_change():
    a, b = _pair(2, 3, 96, 128, [96, 50], 2, 2, 32, 32, 1)
    assert S.nbytes(a) == S.nbytes(b)
    assert S.used_nbytes(a, [96, 50]) == S.used_nbytes(b, [96, 50])
    assert [(n, getattr(a, n).shape) for n, _ in a.token_fields()] == \
           [(n, getattr(b, n).shape) for n, _ in b.token_fields()]


def test_an_unknown_order_is_a_clear_error():
    a, _ = _pair(1, 1, 32, 64, [32], 2, 2, 32, 32, 2)
    with pytest.raises(ValueError, match="v_order"):
        dataclasses.replace(a, v_order="lanes")


def test_layout_helpers_keep_the_order():
    _, b = _pair(1, 2, 64, 64, [64], 2, 2, 32, 32, 3)
    assert S.grow(b, 256).v_order == "tiles"
    assert S.shrink(b, 32).v_order == "tiles"
    assert S.empty_like_layout(b, 2, 64).v_order == "tiles"


def test_value_order_rule(monkeypatch):
    """Tile order only where the post-scaled GPU kernel reads it: CUDA, head_dim 128, groups a multiple of 16,
    1- or 2-bit codes; never with ``MMKV_KIVI_TILES=0``. (The checks that need a GPU come after these.)"""
    from kernels.decode.plan import kivi_value_order

    assert kivi_value_order(2, 2, 32, 32, 128, "cpu") == "natural"
    assert kivi_value_order(2, 2, 32, 32, 64, "cuda") == "natural"  # head_dim 64 measured slower (the docstring)
    assert kivi_value_order(2, 2, 32, 8, 128, "cuda") == "natural"
    assert kivi_value_order(4, 2, 32, 32, 128, "cuda") == "natural"
    assert kivi_value_order(2, 4, 32, 32, 128, "cuda") == "natural"
    monkeypatch.setenv("MMKV_KIVI_TILES", "0")
    assert kivi_value_order(2, 2, 32, 32, 128, "cuda") == "natural"
    monkeypatch.setenv("MMKV_KIVI_TILES", "yes")
    with pytest.raises(ValueError, match="MMKV_KIVI_TILES must be 0, 1 or all, got yes"):
        kivi_value_order(2, 2, 32, 32, 128, "cuda")


CPU_CASES = [  # B, H, G, T, lens, block, group, K bits, V bits, D
    (2, 2, 4, 133, [133, 40], 32, 32, 2, 2, 128), (1, 3, 3, 97, [97], 32, 16, 2, 1, 64),
    (3, 1, 8, 200, [1, 199, 64], 64, 64, 1, 1, 128), (2, 2, 2, 70, [70, 0], 32, 128, 4, 2, 128),
]


@pytest.mark.parametrize("case", CPU_CASES)
def test_reference_and_cpu_paths_read_a_tile_order_segment_alike(case, monkeypatch):
    B, H, G, T, lens, blk, grp, kb, vb, D = case
    a, b = _pair(B, H, T, D, lens, kb, vb, blk, grp, T)
    ka, va = dequantize_segment(a)
    kb_, vb_ = dequantize_segment(b)
    assert torch.equal(ka, kb_) and torch.equal(va, vb_)
    q = torch.randn(B, H * G, D, generator=torch.Generator().manual_seed(5))
    ref, lse = decode_reference(q, [a])
    got, got_lse = decode_reference(q, [b])
    assert torch.equal(ref, got) and torch.equal(lse, got_lse)
    for row in range(B):  # one row, one token: the compiled one-row loop where it applies (cpu_row.partition)
        o1 = kernels.decode_attention(q[row:row + 1], [_row(a, row)])
        o2 = kernels.decode_attention(q[row:row + 1], [_row(b, row)])
        assert torch.equal(o1, o2)
    o1, o2 = kernels.decode_attention(q, [a]), kernels.decode_attention(q, [b])  # the block path
    assert torch.equal(o1, o2)
    live = torch.tensor(lens) > 0
    # the CPU path accumulates in fp32 (1e-4); under TRITON_INTERPRET=1 the Triton kernels run instead, with fp16
    # operands as on the GPU (measured ~1.7e-4 relative; 2e-3 is the GPU tests' fp16 bound)
    tol = 2e-3 if interpreted() else 1e-4
    assert ((o2 - ref.to(o2.dtype))[live].norm() / ref[live].norm()) < tol
    qq = torch.randn(B, H * G, 3, D, generator=torch.Generator().manual_seed(6))  # several query tokens
    h1, l1 = history_attention_cpu(qq, [a], 1 / math.sqrt(D))
    h2, l2 = history_attention_cpu(qq, [b], 1 / math.sqrt(D))
    assert torch.equal(h1, h2) and torch.equal(l1, l2)
    if not interpreted():  # under the interpreter decode_attention runs the Triton kernels, not the CPU reader
        monkeypatch.setenv("MMKV_CPU_REFERENCE", "1")
        assert torch.equal(kernels.decode_attention(q, [b]), ref.to(q.dtype))


def _row(seg: KiviSeg, r: int) -> KiviSeg:
    return dataclasses.replace(seg, **{n: getattr(seg, n)[r:r + 1] for n, _ in seg.token_fields()},
                               lens=seg.lens[r:r + 1])


H, D, HQ, L = 3, 64, 9, 4


def _fill(spec, tiles: bool, monkeypatch, t=150):
    """A whole cache flushed with the value order forced (CPU stands in for the GPU, where tile order is the rule)."""
    import mmkv.methods.kivi as kivi_mod
    import mmkv.methods.xquant as xq_mod

    order = (lambda *a: "tiles") if tiles else (lambda *a: "natural")
    monkeypatch.setattr(kivi_mod, "kivi_value_order", order)
    monkeypatch.setattr(xq_mod, "kivi_value_order", order)
    cache = MMKVCache(CacheSpec.parse(spec), num_layers=L, head_dim=D)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, H, t, D, generator=g)
    for layer in range(L):
        cache.update(base + 0.3 * torch.randn(1, H, t, D, generator=g),
                     base + 0.3 * torch.randn(1, H, t, D, generator=g), layer)
    cache.finalize()
    return cache


@pytest.mark.parametrize("spec", ["text=kivi:bits=2,group=32 window=16 sinks=0",
                                  "text=xquant:kq=4,vq=1,km=2,vm=2 window=16 sinks=0",
                                  "text=xquant:kq=4,vq=4,km=0,vm=0,share=average,gamma0=0.5 window=16 sinks=0"])
def test_caches_flushed_in_tile_order_decode_like_natural_ones(spec, monkeypatch):
    nat = _fill(spec, False, monkeypatch)
    til = _fill(spec, True, monkeypatch)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(1))
    for layer in range(L):
        sn, st = nat.layers[layer].segments(), til.layers[layer].segments()
        kivi = [s for s in st if isinstance(s, KiviSeg)]
        assert kivi and all(s.v_order == "tiles" for s in kivi)  # shared layers take the partner's order
        assert S.nbytes(nat.layers[layer].text) == S.nbytes(til.layers[layer].text)
        for a, b in zip(sn, st, strict=True):
            ka, va = dequantize_segment(a)
            kb, vb = dequantize_segment(b)
            assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert torch.equal(kernels.decode_attention(q, sn), kernels.decode_attention(q, st))
