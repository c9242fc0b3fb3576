"""mmkv/cache/segments.py: capacity, growth, row writes and byte counts of segment layouts, by hand (and the two
small cache rules built on them: positions.py's tiling for the benchmarks, layer.py's crop for chat turns and its
graph-replay step count, cache.py's fp16 baseline bytes, placement.py's per-device bytes on one device).

Per the layout text of kernels/reference.py: a packed byte holds ``8 // bits`` tokens along dim 2, a scale/zero
row covers ``block`` tokens, a dense segment holds one token per index; ``lens`` is int32 ``[B]``.
"""

from __future__ import annotations

import pytest
import torch

from kernels.layouts import ChannelSeg, DenseSeg, KiviSeg
from mmkv.cache import MMKVCache, placement
from mmkv.cache.positions import TextPositions
from mmkv.cache.segments import (
    capacity,
    empty_like_layout,
    grow,
    move_tokens,
    nbytes,
    shrink,
    token_fields,
    used_nbytes,
    write_row,
)


def channel_seg(b=1, h=1, t=16, d=2, bits=2, block=8):
    per = 8 // bits
    codes = torch.arange(b * h * (t // per) * d, dtype=torch.uint8).reshape(b, h, t // per, d)
    sc = torch.ones(b, h, t // block, d, dtype=torch.float16)
    return ChannelSeg(codes, sc, sc.clone(), codes.clone(), sc.clone(), sc.clone(), bits, block,
                      torch.zeros(b, dtype=torch.int32))


def test_token_fields_say_how_many_tokens_one_index_covers():
    assert token_fields(DenseSeg(torch.zeros(1), torch.zeros(1), torch.zeros(1))) == [("k", 1), ("v", 1)]
    assert token_fields(channel_seg(bits=2, block=8)) == [("k_codes", 4), ("k_scale", 8), ("k_zero", 8),
                                                          ("v_codes", 4), ("v_scale", 8), ("v_zero", 8)]
    z = torch.zeros(1, 1, 1, 1)
    kivi = KiviSeg(z, z, z, z, z, z, 1, 4, 32, 32, torch.zeros(1, dtype=torch.int32))
    assert token_fields(kivi) == [("k_codes", 8), ("k_scale", 32), ("k_zero", 32),
                                  ("v_codes", 1), ("v_scale", 1), ("v_zero", 1)]
    # XQuant's reading layer holds no key codes of its own: those fields are left out
    shared = KiviSeg(None, None, None, z, z, z, 1, 2, 32, 32, torch.zeros(1, dtype=torch.int32))
    assert token_fields(shared) == [("v_codes", 1), ("v_scale", 1), ("v_zero", 1)]
    with pytest.raises(TypeError):
        token_fields(object())


def test_capacity_counts_tokens_of_the_first_field():
    assert capacity(channel_seg(t=16, bits=2)) == 16          # 4 bytes x 4 tokens
    assert capacity(channel_seg(t=16, bits=1, block=16)) == 16  # 2 bytes x 8 tokens
    assert capacity(DenseSeg(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), torch.zeros(1))) == 5


def test_nbytes_counts_every_tensor_once_and_stride_zero_axes_as_one_element():
    seg = channel_seg(b=1, h=1, t=16, d=2, bits=2, block=8)
    # codes 4x2 uint8 = 8 B each (K and V); scale/zero 2x2 fp16 = 8 B each (four of them); lens 4 B
    assert nbytes(seg) == 8 + 8 + 4 * 8 + 4
    # V scale/zero shared over D (stride 0): one fp16 per block -> 2 x 2 B each instead of 8
    g = channel_seg(b=1, h=1, t=16, d=2, bits=2, block=8)
    g.v_scale = torch.ones(1, 1, 2, 1, dtype=torch.float16).expand(1, 1, 2, 2)
    g.v_zero = torch.ones(1, 1, 2, 1, dtype=torch.float16).expand(1, 1, 2, 2)
    assert nbytes(g) == 8 + 8 + 2 * 8 + 2 * 4 + 4


def test_used_nbytes_counts_valid_tokens_only():
    # dense fp16, D = 2: 4 B per token per tensor; rows of 3 and 5 tokens -> 8 tokens x 2 tensors x 4 B
    k = torch.zeros(2, 1, 6, 2, dtype=torch.float16)
    assert used_nbytes(DenseSeg(k, k.clone(), torch.zeros(2, dtype=torch.int32)), [3, 5]) == 64
    # channel 2-bit block 8, D = 2, one row of 16 tokens: codes 4 B x 2 per 4 tokens (K, V), scale/zero 2 x 2 B
    # per 8 tokens (four tensors): 16 tokens -> 2 * 8 + 4 * 2 * 4 = 48
    assert used_nbytes(channel_seg(t=16), [16]) == 48


def test_grow_keeps_contents_and_rounds_capacity_up_to_whole_indices():
    seg = channel_seg(t=16, bits=2, block=8)
    assert grow(seg, 16) is seg and grow(seg, 10) is seg
    big = grow(seg, 17)   # 17 tokens -> ceil(17/4) = 5 code bytes, ceil(17/8) = 3 scale rows
    assert big.k_codes.shape == (1, 1, 5, 2) and big.k_scale.shape == (1, 1, 3, 2)
    assert torch.equal(big.k_codes[:, :, :4], seg.k_codes) and big.k_codes[:, :, 4:].eq(0).all()
    assert torch.equal(big.v_zero[:, :, :2], seg.v_zero) and big.v_zero[:, :, 2:].eq(0).all()
    assert big.bits == 2 and big.block == 8 and big.lens is seg.lens


def test_shrink_keeps_the_first_tokens_in_a_compact_copy():
    seg = channel_seg(t=16, bits=2, block=8)
    small = shrink(seg, 5)  # ceil(5/4) = 2 code bytes, ceil(5/8) = 1 scale row
    assert small.k_codes.shape == (1, 1, 2, 2) and small.k_scale.shape == (1, 1, 1, 2)
    assert torch.equal(small.k_codes, seg.k_codes[:, :, :2])
    small.k_codes.fill_(255)
    assert seg.k_codes.max() < 255  # a copy, not a view


def test_write_row_copies_whole_units_at_an_aligned_offset():
    dst = channel_seg(b=2, t=16, bits=2, block=8)
    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
        getattr(dst, name).zero_()
    src = channel_seg(b=1, t=8, bits=2, block=8)
    write_row(dst, 1, 8, src, 0, 8)  # tokens 8..15 of row 1 = code bytes 2..3, scale row 1
    assert torch.equal(dst.k_codes[1, :, 2:4], src.k_codes[0, :, :2])
    assert dst.k_codes[1, :, :2].eq(0).all() and dst.k_codes[0].eq(0).all()
    assert torch.equal(dst.v_scale[1, :, 1:2], src.v_scale[0, :, :1]) and dst.v_scale[1, :, 0].eq(0).all()
    # a partial unit is written whole (ceil): 5 tokens = 2 code bytes and 1 scale row
    dst2 = channel_seg(b=1, t=16, bits=2, block=8)
    dst2.k_codes.zero_()
    write_row(dst2, 0, 0, src, 0, 5)
    assert torch.equal(dst2.k_codes[0, :, :2], src.k_codes[0, :, :2]) and dst2.k_codes[0, :, 2:].eq(0).all()
    with pytest.raises(ValueError):
        write_row(dst, 0, 4, src, 0, 4)  # token 4 is inside a scale block of 8


def test_move_tokens_shifts_a_dense_row_left_even_when_ranges_overlap():
    k = torch.arange(6.0).reshape(1, 1, 6, 1)
    seg = DenseSeg(k, k * 10, torch.tensor([6], dtype=torch.int32))
    move_tokens(seg, 0, 2, 1, 4)  # tokens 2..5 -> 1..4
    assert seg.k.flatten().tolist() == [0, 2, 3, 4, 5, 5]
    assert seg.v.flatten().tolist() == [0, 20, 30, 40, 50, 50]


def test_empty_like_layout_has_the_example_layout_zeroed_with_a_new_capacity():
    ex = channel_seg(b=1, t=16, bits=2, block=8)
    ex.v_scale = torch.ones(1, 1, 2, 1, dtype=torch.float16).expand(1, 1, 2, 2)  # stride-0 D: made real
    e = empty_like_layout(ex, 3, 20)
    assert e.k_codes.shape == (3, 1, 5, 2) and e.k_codes.dtype == torch.uint8 and e.k_codes.eq(0).all()
    assert e.k_scale.shape == (3, 1, 3, 2) and e.k_scale.dtype == torch.float16
    assert e.v_scale.shape == (3, 1, 3, 2) and e.v_scale.stride(-1) == 1
    assert e.lens.tolist() == [0, 0, 0] and e.lens.dtype == torch.int32
    assert e.bits == 2 and e.block == 8


def test_text_positions_tile_repeats_row_zero():
    p = TextPositions()
    assert p.tile(3).pos is None
    p.record(2, 3, torch.tensor([[1, 1, 1], [0, 1, 1]]), None, "cpu")  # row 1 is left-padded by one token
    assert p.lens == [3, 2] and p.next == [3, 2]
    t = p.tile(3)
    assert t.pos.shape == (3, p.pos.shape[1])
    assert t.pos[:, :3].tolist() == [[0, 1, 2]] * 3
    assert t.lens == [3, 3, 3] and t.next == [3, 3, 3]


def test_crop_drops_the_newest_window_tokens_but_never_sinks_or_flushed_ones():
    cache = MMKVCache("window=16 sinks=4", num_layers=2)
    fresh = cache.layers[0]
    fresh.crop(0)  # nothing stored, nothing asked: fine
    with pytest.raises(ValueError, match="fp16 window"):
        fresh.crop(1)
    k = torch.randn(2, 1, 10, 8)
    for i in (0, 1):
        cache.update(k, k.clone(), i)
    layer = cache.layers[0]
    layer.finalize()
    assert layer.dense_len == [10, 10] and layer.seen == 10
    for i in (0, 1):
        cache.layers[i].positions = TextPositions()
        cache.layers[i].positions.record(2, 10, None, None, "cpu")
    layer.crop(1)
    assert layer.dense_len == [9, 9] and layer.seen == 9
    assert layer.dense.lens.dtype == torch.int32 and layer.dense.lens.tolist() == [9, 9]
    assert layer.positions.next == [9, 9]
    cache.layers[1].crop(1)   # only layer 0 crops the shared positions
    assert cache.layers[1].positions.next == [10, 10]
    layer.crop(5)             # 9 - 4 sinks = 5 tokens may still go
    assert layer.dense_len == [4, 4] and layer.seen == 4
    with pytest.raises(ValueError, match="fp16 window"):
        layer.crop(1)         # the 4 sinks stay
    layer.crop(0)
    assert layer.dense_len == [4, 4]


def test_decode_steps_free_counts_the_appends_before_the_first_flush():
    # KIVI group 32, window 16, sinks 4: a row of n dense tokens flushes at the append that makes n - 4 >= 16 + 32,
    # i.e. at n = 52; steps are free only while the fp16 segment also has room (no growth).
    cache = MMKVCache("text=kivi:bits=2,group=32 window=16 sinks=4", num_layers=1, head_dim=32)
    layer = cache.layers[0]
    assert layer.decode_steps_free() == 0 and cache.decode_steps_free() == 0  # nothing stored yet
    cache.update(torch.randn(1, 1, 30, 32), torch.randn(1, 1, 30, 32), 0)
    cache.finalize()
    assert layer.decode_steps_free() == min(capacity(layer.dense) - 30, 21)
    cache.update(torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32), 0)  # 31 tokens: the segment grows
    cache.finalize()
    assert capacity(layer.dense) >= 52
    assert layer.decode_steps_free() == 20 == cache.decode_steps_free()
    for _ in range(20):
        cache.update(torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32), 0)
        cache.finalize()
        assert not any(layer.text_len)  # no text segment yet: nothing flushed
    assert layer.dense_len == [51] and layer.decode_steps_free() == 0
    cache.update(torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32), 0)
    cache.finalize()
    assert layer.text_len == [32] and layer.dense_len == [20]
    cache.set_inputs(torch.ones(1, 1, dtype=torch.long), None)
    assert cache.decode_steps_free() == 0  # a forward with a mask never replays a graph


def test_advance_decode_and_reset_keep_the_host_side_counters():
    cache = MMKVCache("window=16 sinks=4", num_layers=2)
    for i in (0, 1):
        cache.update(torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), i)
    cache.finalize()
    cache.advance_decode()
    assert [(l.seen, l.dense_len) for l in cache.layers] == [(6, [6, 6]), (6, [6, 6])]
    shared = TextPositions()
    shared.record(2, 5, None, None, "cpu")
    for l in cache.layers:
        l.positions = shared
    cache.layers[1].reset()
    assert cache.layers[1].seen == 0 and cache.layers[1].dense is None and cache.layers[1].positions is shared
    assert shared.lens == [5, 5]  # only layer 0 resets the shared positions
    cache.layers[0].reset()
    assert shared.lens == [] and shared.pos is None and cache.layers[0].positions is shared


def test_fp16_baseline_and_per_device_bytes_on_one_device():
    # fp32 K/V on CPU (what a CPU model runs in): 2 layers x (K + V) x 1 head x D 8 = 32 elements per token,
    # 4 bytes each, 10 tokens per row, 2 rows
    cache = MMKVCache("window=16 sinks=4", num_layers=2)
    assert placement.layer_devices(cache) == [None, None] and cache.fp16_equivalent_bytes() == 0
    for i in (0, 1):
        cache.update(torch.randn(2, 1, 10, 8), torch.randn(2, 1, 10, 8), i)
    cache.finalize()
    assert cache.elements_per_token() == 32
    assert cache.fp16_equivalent_bytes() == 4 * 20 * 32
    assert cache.nbytes_by_device() == {"cpu": cache.nbytes()}
    assert cache.nbytes_by_device(used=True) == {"cpu": cache.nbytes(used=True)} == {"cpu": 4 * 20 * 32}
    assert placement.layer_devices(cache) == [torch.device("cpu")] * 2
    seg = cache.layers[0].dense
    assert placement.to_device(seg, "cpu") is seg and placement.segment_device(seg) == torch.device("cpu")
    assert [n for n, _ in placement.tensors(seg)] == ["k", "v", "lens"]


def test_effective_bits_of_an_empty_cache_are_zero_and_modalities_add_up():
    cache = MMKVCache("visual=calibquant:bits=2 window=4 sinks=1", num_layers=1)
    assert cache.effective_bits() == {"visual": 0.0, "text": 0.0, "fp16": 0.0, "total": 0.0}
    assert cache.layers[0].get_mask_sizes(3) == (3, 0)
    # two requests' worth of visual spans in one prefill: 8 + 8 visual tokens, 4 text tokens, 1 row
    visual = torch.tensor([[False, True, True, True, True, True, True, True, True,
                            False, True, True, True, True, True, True, True, True, False, False]])
    cache.set_inputs(torch.ones(1, 20, dtype=torch.long), visual)
    cache.update(torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8), 0)
    cache.finalize()
    assert cache.tokens_by_modality() == {"visual": 16, "text": 0, "fp16": 4}
    assert cache.layers[0].get_mask_sizes(1) == (21, 0)
    eb = cache.effective_bits()
    assert eb["fp16"] == 32.0     # fp32 K/V on CPU: 32 bits per element
    by = cache.nbytes_by_modality(used=True)
    assert eb["total"] == pytest.approx(8 * sum(by.values()) / (20 * 16))
    cache.set_inputs(None, None)
    assert cache._valid is None


def test_text_positions_crop_and_bytes():
    p = TextPositions()
    assert p.nbytes() == 0 and p.nbytes(used=True) == 0
    p.record(1, 5, None, None, "cpu")
    v = p.version
    p.crop(2)
    assert p.version == v + 1 and p.lens == [3] and p.next == [3]
    p.crop(7)                                      # more than held: lens stop at 0, next goes on counting
    assert p.lens == [0] and p.next == [-4]
    assert p.nbytes(used=True) == 0 and p.nbytes() == 4 * p.pos.numel() == 4 * 64
