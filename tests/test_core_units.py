"""Unit tests written to kill mutmut's survivors in the cache, positions, attention, spec and method modules
(docs/TESTING.md). Expected values are computed by hand, in closed form, or by an fp64 reference in this file,
never by the code path under test."""

from __future__ import annotations

import pytest
import torch

from kernels.layouts import DenseSeg
from mmkv.cache import MMKVCache
from mmkv.cache import placement as PL
from mmkv.cache import segments as S
from mmkv.cache.positions import TextPositions
from mmkv.engine import _count_spans


def test_count_spans_of_a_leading_span():
    assert _count_spans(torch.tensor([1, 0, 0, 1])) == 2


# --- mmkv/cache/positions.py ------------------------------------------------------------------------------------


def test_positions_prefill_counts_padding_out_and_visual_in():
    p = TextPositions()
    assert p.nbytes() == 0 and p.nbytes(used=True) == 0 and p.version == 0
    valid = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    visual = torch.tensor([[0, 0, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    p.record(2, 5, valid.long(), visual.long(), "cpu")
    # row 0: real tokens at ranks 0..3, visual ranks 1, 2: text keeps ranks 0 and 3
    # row 1: ranks 0..4, visual rank 0: text 1..4
    assert p.version == 1 and p.lens == [2, 4] and p.next == [4, 5]
    assert p.pos.dtype == torch.int32 and p.pos.shape == (2, 64)
    assert p.take(0, 0, 2).tolist() == [0, 3] and p.take(1, 0, 4).tolist() == [1, 2, 3, 4]
    assert p.take(1, 1, 2).dtype == torch.int64
    # a decode step: one real text token per row at its next position
    p.record(2, 1, None, None, "cpu")
    assert p.version == 2 and p.lens == [3, 5] and p.next == [5, 6]
    assert p.take(0, 0, 3).tolist() == [0, 3, 4] and p.take(1, 4, 1).tolist() == [5]
    # an extend with every token valid and no visual mask
    p.record(2, 2, None, None, "cpu")
    assert p.lens == [5, 7] and p.next == [7, 8]
    assert p.take(0, 3, 2).tolist() == [5, 6] and p.take(1, 5, 2).tolist() == [6, 7]
    assert p.nbytes(used=True) == 4 * 12 and p.nbytes() == 4 * 2 * 64


def test_positions_one_token_forward_with_a_mask_is_not_a_decode_step():
    p = TextPositions()
    p.record(1, 3, None, None, "cpu")
    p.record(1, 1, torch.tensor([[0]]), None, "cpu")  # a padded single token: counts nothing
    assert p.lens == [3] and p.next == [3]
    p.record(1, 1, None, torch.tensor([[1]]), "cpu")  # one visual token: counted, not recorded
    assert p.lens == [3] and p.next == [4]
    p.record(1, 1, None, None, "cpu")
    assert p.take(0, 0, 4).tolist() == [0, 1, 2, 4]


def test_positions_grow_by_half_and_keep_what_was_there():
    p = TextPositions()
    p.record(1, 70, None, None, "cpu")
    assert p.pos.shape[1] == 70  # max(t, 64)
    p.record(1, 1, None, None, "cpu")
    assert p.pos.shape[1] == 105  # 70 * 3 // 2 (> 71)
    p.record(1, 200, None, None, "cpu")
    assert p.pos.shape[1] == 271  # exactly what is needed when that beats * 3 // 2 (157)
    assert p.take(0, 0, 271).tolist() == list(range(271))
    q = TextPositions()
    q.record(2, 3, None, None, "cpu")
    assert q.pos.shape[1] == 64
    for _ in range(62):
        q.record(2, 1, None, None, "cpu")
        if q.lens == [64, 64]:
            assert q.pos.shape[1] == 64  # exactly full: no growth yet
    assert q.pos.shape[1] == 64 * 3 // 2 and q.lens == [65, 65]  # the decode path grows too
    assert q.take(1, 0, 65).tolist() == list(range(65))


def test_positions_batch_mismatch_crop_take_rows_tile():
    fresh = TextPositions()
    fresh.crop(2)
    assert fresh.lens == [] and fresh.next == [] and fresh.version == 1
    p = TextPositions()
    p.record(2, 4, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), None, "cpu")
    with pytest.raises(ValueError, match="2 rows"):
        p.record(3, 1, None, None, "cpu")
    v = p.version
    p.crop(2)
    assert p.version == v + 1 and p.lens == [1, 2] and p.next == [1, 2]
    p.crop(3)
    assert p.lens == [0, 0] and p.next == [-2, -1]
    p.record(2, 3, None, None, "cpu")
    assert p.lens == [3, 3] and p.take(0, 0, 3).tolist() == [-2, -1, 0]
    assert p.take(1, 0, 3).tolist() == [-1, 0, 1]
    with pytest.raises(RuntimeError, match="never"):
        p.take(0, 1, 3)
    assert p.take(0, 3, 0).tolist() == []
    r = p.rows(1, [2, 1], 70)
    assert r.shape == (2, 70) and r.dtype == torch.int64
    assert r[0, :2].tolist() == [-1, 0] and r[1, :2].tolist() == [0, 1]
    assert not r[:, 63:].any()  # beyond capacity: zeros
    assert p.rows(0, [3, 3], 2).tolist() == [[-2, -1], [-1, 0]]
    with pytest.raises(RuntimeError, match="only"):
        p.rows(1, [3, 0], 4)
    with pytest.raises(RuntimeError, match="only"):
        p.rows(0, [0, 4], 4)
    t = p.tile(3)
    assert t.pos.shape == (3, 64) and t.lens == [3, 3, 3] and t.next == [1, 1, 1]
    assert torch.equal(t.pos[2], p.pos[0]) and t.pos.data_ptr() != p.pos.data_ptr()
    assert TextPositions().tile(2).pos is None


# --- mmkv/cache/placement.py ------------------------------------------------------------------------------------


def _dense(b=2, t=5, device="cpu"):
    return DenseSeg(torch.zeros(b, 1, t, 4, device=device), torch.ones(b, 1, t, 4, device=device),
                    torch.tensor([t, 1], dtype=torch.int32, device=device)[:b])


def test_placement_tensors_and_devices():
    seg = _dense()
    names = [n for n, _ in PL.tensors(seg)]
    assert names == ["k", "v", "lens"] and PL.tensors(seg)[2][1] is seg.lens
    assert PL.segment_device(seg) == torch.device("cpu")
    mixed = DenseSeg(seg.k, seg.v.to("meta"), seg.lens)
    with pytest.raises(ValueError, match="several devices"):
        PL.segment_device(mixed)
    assert PL.to_device(seg, "cpu") is seg
    moved = PL.to_device(mixed, "meta")
    assert all(t.device.type == "meta" for _, t in PL.tensors(moved)) and moved.v is mixed.v
    assert PL.device_key(torch.device("cpu")) == "cpu"


def _filled_cache(spec="text=kivi:bits=2 window=8 sinks=2", b=2, t=50, layers=2):
    cache = MMKVCache(spec, layers)
    g = torch.Generator().manual_seed(0)
    cache.set_inputs(torch.ones(b, t, dtype=torch.long), None)
    for i in range(layers):
        cache.update(torch.randn(b, 1, t, 64, generator=g), torch.randn(b, 1, t, 64, generator=g), i)
    return cache


def test_placement_bytes_by_device_and_layer_devices():
    cache = _filled_cache()
    # the last layer's prompt is still pending (held in fp16 until the next forward touches the cache)
    assert cache.layers[1].pending is not None
    pend = cache.layers[1].pending_nbytes()
    assert pend == 2 * 2 * 50 * 64 * 4
    assert PL.nbytes_by_device(cache) == {"cpu": cache.nbytes()}
    assert PL.nbytes_by_device(cache, used=True) == {"cpu": cache.nbytes(used=True)}
    held = sum(S.nbytes(s) for _, s, _ in cache.layers[0].parts())
    used = sum(S.used_nbytes(s, lens) for _, s, lens in cache.layers[0].parts())
    assert cache.nbytes() == held + pend and cache.nbytes(used=True) == used + pend and held > used
    assert cache.nbytes_by_device() == {"cpu": held + pend}
    assert PL.layer_devices(cache) == [torch.device("cpu"), None]
    cache.finalize()
    assert PL.layer_devices(cache) == [torch.device("cpu")] * 2
    assert PL.nbytes_by_device(cache) == {"cpu": 2 * held}
    assert PL.layer_devices(MMKVCache("fp16", 1)) == [None] and PL.nbytes_by_device(MMKVCache("fp16", 1)) == {}
    only_pending = MMKVCache("fp16", 2)
    only_pending.update(*_kv(1, 7), 0)  # nothing routed yet: the device's first bytes are a pending prompt
    assert PL.nbytes_by_device(only_pending) == {"cpu": 2 * 7 * 64 * 4}


# --- mmkv/cache/layer.py and cache.py: graph-replay support, crop, reset, growth -------------------------------
def _kv(b, t, seed=0, h=1, d=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def _prefill(spec, b, t, layers=1, valid=None):
    cache = MMKVCache(spec, layers)
    cache.set_inputs(valid, None)
    for i in range(layers):
        cache.update(*_kv(b, t, i), i)
    cache.finalize()
    return cache


def _decode(cache, seed):
    for i in range(len(cache.layers)):
        cache.update(*_kv(cache.layers[i].dense.k.shape[0], 1, seed + i), i)


@pytest.mark.parametrize("t", [1, 3, 9, 41, 49])
def test_decode_steps_free_counts_appends_before_a_grow_or_a_flush(t):
    # by definition, at every step of a decode: exactly ``free`` appends keep the fp16 segment's capacity and the
    # text segment unchanged, and the next one changes one of them
    import copy

    spec = "text=kivi:bits=2 window=8 sinks=2"  # KIVI flushes 32-token blocks; steady capacity 42
    cache = _prefill(spec, 2, t, layers=1)
    for step in range(45):
        layer = cache.layers[0]
        free = layer.decode_steps_free()
        assert cache.decode_steps_free() == free
        sim = copy.deepcopy(cache)
        lay = sim.layers[0]
        for i in range(free + 1):
            cap, text = S.capacity(lay.dense), list(lay.text_len)
            _decode(sim, 1000 + i)
            changed = S.capacity(lay.dense) != cap or lay.text_len != text
            assert changed == (i == free), (t, step, free, i)
        _decode(cache, step)


def test_decode_steps_free_is_zero_while_inputs_or_pending_are_set():
    assert MMKVCache("fp16", 1).layers[0].decode_steps_free() == 0  # nothing stored yet
    assert MMKVCache("fp16", 1).decode_steps_free() == 0
    cache = _prefill("fp16 window=8 sinks=2", 1, 3)
    assert cache.decode_steps_free() == 0  # the prompt filled its segment exactly: the next append grows it
    _decode(cache, 0)
    assert cache.decode_steps_free() == 2  # capacity 6, 4 held
    cache.set_inputs(torch.ones(1, 2), None)
    assert cache.decode_steps_free() == 0
    cache.set_inputs(None, torch.zeros(1, 2))
    assert cache.decode_steps_free() == 0
    cache.set_inputs(None, None)
    cache.update(*_kv(1, 2), 0)  # an extend leaves its tokens pending
    assert cache.layers[0].pending is not None and cache.layers[0].decode_steps_free() == 0
    assert MMKVCache("fp16", 0).decode_steps_free() == 0


def test_advance_decode_is_the_host_side_of_an_append():
    a = _prefill("fp16 window=8 sinks=2", 2, 5, layers=2, valid=torch.tensor([[1] * 5, [0, 0, 1, 1, 1]]))
    seen = a.get_seq_length()
    a.advance_decode()
    for layer in a.layers:
        assert layer.seen == seen + 1 and layer.dense_len == [6, 4]


def test_layout_signature_changes_exactly_when_memory_moves():
    cache = _prefill("text=kivi:bits=2 window=8 sinks=2", 1, 12, layers=2)
    sig = cache.layout_signature()
    assert sig == cache.layout_signature()
    layer = cache.layers[0]
    steps = layer.decode_steps_free()
    for i in range(steps):
        _decode(cache, i)
        assert cache.layout_signature() == sig  # in-place appends: same tensors, same shapes
    _decode(cache, 99)  # grows or flushes
    assert cache.layout_signature() != sig
    # the signature lists each layer's lens and tensors (ptr, shape, stride) and whether a prompt is pending
    d = layer.dense
    assert (d.lens.data_ptr(), d.lens.numel()) in cache.layout_signature()
    assert (d.k.data_ptr(), tuple(d.k.shape), d.k.stride()) in cache.layout_signature()
    assert cache.layout_signature()[-1] is False
    flags = [x for x in cache.layout_signature() if isinstance(x, bool)]
    assert flags == [False, False]  # one per layer: nothing pending
    cache.update(*_kv(1, 3), 0)  # an extend on layer 0 stays pending
    assert [x for x in cache.layout_signature() if isinstance(x, bool)] == [True, False]


def test_crop_drops_window_tokens_and_refuses_older_ones():
    cache = _prefill("text=kivi:bits=2 window=8 sinks=2", 2, 12, layers=1,
                     valid=torch.tensor([[1] * 12, [0, 0] + [1] * 10]))
    layer = cache.layers[0]
    assert layer.dense_len == [12, 10] and layer.seen == 12
    layer.crop(0)
    layer.crop(-1)
    assert layer.dense_len == [12, 10] and layer.seen == 12
    layer.crop(3)
    assert layer.dense_len == [9, 7] and layer.seen == 9 and layer.dense.lens.tolist() == [9, 7]
    assert layer.dense.lens.dtype == torch.int32
    layer.crop(5)  # row 1 keeps exactly its 2 sinks
    assert layer.dense_len == [4, 2]
    with pytest.raises(ValueError, match="no longer"):
        layer.crop(1)  # row 1 would lose a sink
    with pytest.raises(ValueError, match="no longer"):
        MMKVCache("fp16", 1).layers[0].crop(1)
    short = _prefill("fp16 window=8 sinks=4", 1, 3).layers[0]
    with pytest.raises(ValueError, match="no longer"):
        short.crop(1)  # fewer tokens than sinks: every token is a sink


def test_reset_keeps_partner_and_positions_and_clears_layer_zero_positions():
    cache = _prefill("text=kivi:bits=2 window=8 sinks=2", 1, 40, layers=2)
    pos = TextPositions()
    pos.record(1, 5, None, None, "cpu")
    for layer in cache.layers:
        layer.positions = pos
    cache.layers[1].partner = cache.layers[0]
    cache.layers[1].reset()
    l1 = cache.layers[1]
    assert l1.dense is None and l1.text is None and l1.seen == 0 and l1.dense_len == [] and l1.text_len == []
    assert l1.partner is cache.layers[0] and l1.positions is pos and l1.layer_idx == 1 and l1.num_layers == 2
    assert pos.lens == [5]  # only layer 0 owns the positions
    cache.layers[0].reset()
    assert cache.layers[0].positions is pos and pos.lens == [] and pos.pos is None


def test_fp16_segment_capacity_doubles_up_to_the_steady_size_then_shrinks_after_a_flush():
    spec = "text=kivi:bits=2 window=8 sinks=2"  # steady capacity 2 + 8 + 32 = 42
    cache = _prefill(spec, 1, 3)
    layer = cache.layers[0]
    assert S.capacity(layer.dense) == 3  # a prompt allocates exactly its length
    caps = []
    for i in range(45):
        _decode(cache, i)
        caps.append(S.capacity(layer.dense))
    assert sorted(set(caps)) == [6, 12, 24, 42]
    assert layer.text_len == [32] and layer.dense_len == [48 - 32]
    big = _prefill(spec, 1, 200)
    lay = big.layers[0]
    # prompt 200: 5 blocks of 32 leave (190 // 32), 2 sinks + 38 stay; capacity 200 shrinks to 2 + 8 + 32
    assert lay.text_len == [160] and lay.dense_len == [40] and S.capacity(lay.dense) == 42
    # the text segment is created with room for max(n, 4 blocks)
    assert S.capacity(lay.text) == 160
    small = _prefill(spec, 1, 45).layers[0]
    assert small.text_len == [32] and S.capacity(small.text) == 4 * 32


def test_text_segment_growth_is_by_half_in_whole_blocks():
    spec = "text=kivi:bits=2 window=8 sinks=2"
    cache = _prefill(spec, 1, 2 + 8 + 32 * 4 + 5)  # 4 blocks leave: capacity 128 exactly
    layer = cache.layers[0]
    assert layer.text_len == [128] and S.capacity(layer.text) == 128
    for i in range(32 - 5 + 8 + 1):  # until one more block leaves
        _decode(cache, i)
    assert layer.text_len == [160] and S.capacity(layer.text) == 192  # 128 + 64, a multiple of 32


def test_layer_reports_no_maximum_length_and_its_seen_tokens():
    cache = _prefill("fp16 window=8 sinks=2", 1, 5)
    layer = cache.layers[0]
    assert layer.get_max_length() == -1  # transformers' "unbounded"
    assert layer.get_seq_length() == 5 and layer.get_mask_sizes(3) == (8, 0)


def test_set_lens_writes_in_place_when_the_row_count_matches():
    seg = _dense(2, 5)
    ptr = seg.lens.data_ptr()
    from mmkv.cache.layer import set_lens

    set_lens(seg, [3, 4])
    assert seg.lens.tolist() == [3, 4] and seg.lens.data_ptr() == ptr and seg.lens.dtype == torch.int32
    set_lens(seg, [1, 2, 3])
    assert seg.lens.tolist() == [1, 2, 3] and seg.lens.dtype == torch.int32


# --- mmkv/methods/rope.py ---------------------------------------------------------------------------------------
from transformers import LlamaConfig  # noqa: E402

from mmkv.methods.rope import Rope, rotate, unrotate  # noqa: E402


def _inv_freq(theta, d):
    return torch.tensor([1.0 / theta ** (2 * i / d) for i in range(d // 2)], dtype=torch.float64)


def test_rope_default_frequencies_from_either_config_field():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=5000.0)
    r = Rope.from_config(cfg, 16)
    assert r.scaling == 1.0 and r.inv_freq.dtype == torch.float32 and r.inv_freq.shape == (8,)
    assert torch.allclose(r.inv_freq.double(), _inv_freq(5000.0, 16), rtol=1e-6)

    class Old:  # an older config: rope_theta as an attribute, no rope_parameters
        rope_theta = 300.0
    assert torch.allclose(Rope.from_config(Old(), 8).inv_freq.double(), _inv_freq(300.0, 8), rtol=1e-6)

    class Bare:
        rope_parameters = None
    assert torch.allclose(Rope.from_config(Bare(), 8).inv_freq.double(), _inv_freq(10000.0, 8), rtol=1e-6)

    class Half:
        partial_rotary_factor = None
        rope_parameters = {"rope_type": "default", "rope_theta": 7.0}
    assert torch.allclose(Rope.from_config(Half(), 4).inv_freq.double(), _inv_freq(7.0, 4), rtol=1e-6)


def test_rope_linear_scaling_and_refusals():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                      rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0})
    r = Rope.from_config(cfg, 32)
    assert torch.allclose(r.inv_freq.double(), _inv_freq(100.0, 32) / 4, rtol=1e-6)
    assert r.inv_freq.dtype == torch.float32 and r.scaling == 1.0 and isinstance(r.scaling, float)
    with pytest.raises(ValueError, match="config"):
        Rope.from_config(None, 8)

    class Partial:
        partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match="partial"):
        Rope.from_config(Partial(), 8)

    class Dyn:
        rope_parameters = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic"):
        Rope.from_config(Dyn(), 8)

    class M:
        rope_parameters = {"rope_type": "default", "mrope_section": [1, 1]}
    with pytest.raises(ValueError, match="multimodal"):
        Rope.from_config(M(), 8)


def test_rope_cos_sin_rotate_unrotate_by_hand():
    inv = torch.tensor([1.0, 0.25])
    r = Rope(inv.clone(), 2.0)
    pos = torch.tensor([[0, 3]])
    cos, sin = r.cos_sin(pos)
    f = [[0.0, 0.0], [3.0, 0.75]]
    want_c = torch.tensor([[[2 * torch.cos(torch.tensor(a)).item() for a in row + row] for row in f]])
    want_s = torch.tensor([[[2 * torch.sin(torch.tensor(a)).item() for a in row + row] for row in f]])
    assert cos.shape == (1, 2, 4) and torch.allclose(cos, want_c) and torch.allclose(sin, want_s)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    c, s = torch.tensor([0.6, 0.8, 0.6, 0.8]), torch.tensor([0.8, 0.6, 0.8, 0.6])
    # rotate-half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) per pair (i, i + D/2)
    want = torch.tensor([1 * 0.6 - 3 * 0.8, 2 * 0.8 - 4 * 0.6, 3 * 0.6 + 1 * 0.8, 4 * 0.8 + 2 * 0.6])
    assert torch.allclose(rotate(x, c, s), want)
    assert torch.allclose(unrotate(want, c, s), x, atol=1e-6)
    # with a scaling the inverse divides by scaling^2 = cos^2 + sin^2
    assert torch.allclose(unrotate(rotate(x, 3 * c, 3 * s), 3 * c, 3 * s), x, atol=1e-5)
    assert torch.allclose(unrotate(x, 3 * c, 3 * s), torch.tensor(
        [1 * 0.6 + 3 * 0.8, 2 * 0.8 + 4 * 0.6, 3 * 0.6 - 1 * 0.8, 4 * 0.8 - 2 * 0.6]) / 3, atol=1e-6)
    meta = Rope(inv.clone(), 1.0)
    c2, _ = meta.cos_sin(torch.tensor([1], device="meta"))
    assert c2.device.type == "meta" and meta.inv_freq.device.type == "meta"


# --- mmkv/attention.py ------------------------------------------------------------------------------------------
from mmkv.attention import causal_partial, mmkv_attention  # noqa: E402


class _Mod(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _attend(q, ks, vs, scale):
    """fp64 softmax over the given keys: q [B, Hq, D], ks/vs [B, Hk, T, D] (GQA: query head h reads h // g)."""
    g = q.shape[1] // ks.shape[1]
    k = ks.double().repeat_interleave(g, 1)
    v = vs.double().repeat_interleave(g, 1)
    w = torch.softmax(torch.einsum("bhd,bhtd->bht", q.double(), k) * scale, -1)
    return torch.einsum("bht,bhtd->bhd", w, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_extend_branches_default_scale_and_dtype(dtype):
    d = 16
    cache = MMKVCache("fp16 window=64 sinks=0", 1)
    k0, v0 = _kv(1, 5, 1, h=1, d=d)
    k0, v0 = k0.to(dtype), v0.to(dtype)
    cache.update(k0, v0, 0)
    cache.finalize()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 1, d, generator=g).to(dtype)
    k1, v1 = (x.to(dtype) for x in _kv(1, 1, 2, h=1, d=d))
    keys, values = cache.update(k1, v1, 0)
    assert keys._mmkv[1] == "decode"
    out, w = mmkv_attention(_Mod(), q, keys, values, None)  # scaling left out: 1/sqrt(D)
    assert w is None and out.dtype == dtype and out.shape == (1, 1, 2, d)
    want = _attend(q[:, :, 0], torch.cat([k0, k1], 2), torch.cat([v0, v1], 2), d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out[:, 0].double(), want, atol=tol)
    out2, _ = mmkv_attention(_Mod(), q, keys, values, None, scaling=0.7)
    want2 = _attend(q[:, :, 0], torch.cat([k0, k1], 2), torch.cat([v0, v1], 2), 0.7)
    assert torch.allclose(out2[:, 0].double(), want2, atol=tol)
    # extend: two new tokens attend to the 6 stored ones and causally to each other
    q2 = torch.randn(1, 2, 2, d, generator=g).to(dtype)
    k2, v2 = (x.to(dtype) for x in _kv(1, 2, 3, h=1, d=d))
    cache.set_inputs(None, None)
    keys, values = cache.update(k2, v2, 0)
    assert keys._mmkv[1] == "extend"
    out3, w3 = mmkv_attention(_Mod(), q2, keys, values, None)
    assert w3 is None and out3.dtype == dtype and out3.shape == (1, 2, 2, d) and out3.is_contiguous()
    ks, vs = torch.cat([k0, k1, k2], 2), torch.cat([v0, v1, v2], 2)
    for i in range(2):
        want3 = _attend(q2[:, :, i], ks[:, :, : 6 + i + 1], vs[:, :, : 6 + i + 1], d ** -0.5)
        assert torch.allclose(out3[:, i].double(), want3, atol=tol), i


def test_extend_reference_branch_equals_the_cpu_branch(monkeypatch):
    d = 64
    cache = MMKVCache("text=kivi:bits=4 window=4 sinks=0", 1)
    cache.update(*_kv(1, 40, 1, h=1, d=d), 0)
    cache.finalize()
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 3, d, generator=g)
    keys, values = cache.update(*_kv(1, 3, 2, h=1, d=d), 0)
    cpu, _ = mmkv_attention(_Mod(), q, keys, values, None, scaling=0.3)
    monkeypatch.setenv("MMKV_CPU_REFERENCE", "1")
    ref, _ = mmkv_attention(_Mod(), q, keys, values, None, scaling=0.3)
    assert torch.allclose(cpu, ref, atol=1e-5)
    ref_default, _ = mmkv_attention(_Mod(), q, keys, values, None)
    monkeypatch.delenv("MMKV_CPU_REFERENCE")
    cpu_default, _ = mmkv_attention(_Mod(), q, keys, values, None, scaling=d ** -0.5)
    assert torch.allclose(ref_default, cpu_default, atol=1e-5)


def test_causal_partial_by_hand_with_gqa():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 3, 8, generator=g)
    k, v = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    out, lse = causal_partial(q, k, v, 0.5)
    assert out.dtype == torch.float32 and lse.shape == (1, 4, 3)
    for h in range(4):
        for i in range(3):
            x = (q[0, h, i].double() @ k[0, h // 2, : i + 1].double().T) * 0.5
            assert torch.allclose(lse[0, h, i].double(), torch.logsumexp(x, 0), atol=1e-5)
            want = torch.softmax(x, 0) @ v[0, h // 2, : i + 1].double()
            assert torch.allclose(out[0, h, i].double(), want, atol=1e-5)


# --- mmkv/methods/skvq.py: which tables a variant binds, per layer and side ---------------------------------
from mmkv.methods import artifacts  # noqa: E402
from mmkv.methods.skvq import SKVQ, bits_key, table_names  # noqa: E402
from mmkv.models.adapter import Adapter  # noqa: E402

_SL, _SH, _SD = 2, 2, 32


def _skvq_adapter():
    return Adapter(name="hand-skvq", family="text", num_layers=_SL, num_q_heads=2 * _SH, num_kv_heads=_SH,
                   head_dim=_SD, lm_config=None)


@pytest.fixture(scope="module")
def skvq_hand_art(tmp_path_factory):
    """Hand-written tables, every one distinct, so a test can tell which one a layer bound."""
    t = {}
    for ki, kind in enumerate("kv"):
        for g in (16, 32):
            perm = torch.stack([torch.stack([torch.arange(_SD).roll(ki * 5 + lay * 3 + h + 1)
                                             for h in range(_SH)]) for lay in range(_SL)])
            t[f"{kind}.perm.g{g}"] = perm  # int64: the method must narrow perm and gid to uint8 itself
            gid = torch.tensor([0] * (5 + ki) + [1] * (_SD - 5 - ki)) if g == 16 else torch.zeros(_SD, dtype=torch.long)
            t[f"{kind}.gid.g{g}"] = gid.expand(_SL, _SH, _SD).contiguous()
            for vi, variant in enumerate(("nat", "var", "fix")):
                for bits in ("2", "1.5"):
                    ng = _SD // g
                    val = 0.5 + 0.01 * (ki * 30 + vi * 10 + (bits == "1.5") * 5) + 0.001 * torch.arange(
                        _SL * _SH * ng, dtype=torch.float64).reshape(_SL, _SH, ng)
                    t[f"{kind}.alpha.{variant}.g{g}.b{bits}"] = val.to(torch.float16)
    ad = _skvq_adapter()
    folder = tmp_path_factory.mktemp("skvq-hand")
    artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), t, {}).save(folder)
    return folder, t


def _bound(folder, params):
    return SKVQ.from_params({**params, "artifact": str(folder)}).bind(_skvq_adapter())


@pytest.mark.parametrize("variant", ["var", "fix", "nat"])
@pytest.mark.parametrize("clip", [True, False])
def test_skvq_binds_the_variants_tables_per_layer_and_side(skvq_hand_art, variant, clip):
    folder, t = skvq_hand_art
    params = {"group": "16", "v_bits": "1.5", "clip": str(clip).lower(),
              "reorder": "off" if variant == "nat" else "on", "groups": "fixed" if variant == "fix" else "variable"}
    m = _bound(folder, params)
    if variant == "nat" and not clip:  # RTN: nothing read, natural-order fixed groups, no alpha
        assert m._tables is None and m.for_layer(1, _SL)._side("k", _SD, _SH, "cpu")[::2] == (None, 16, None)
        return
    assert m._shape == (_SH, _SD)
    for layer in range(_SL):
        lay = m.for_layer(layer, _SL)
        assert lay.layer_idx == layer and lay.for_layer(5, 9) is lay
        for kind, bits in (("k", "2"), ("v", "1.5")):
            perm, gid, fixed, ng, alpha = lay._side(kind, _SD, _SH, torch.device("cpu"))
            assert ng == 2
            if variant == "nat":
                assert perm is None
            else:
                assert perm.dtype == torch.uint8 and torch.equal(perm, t[f"{kind}.perm.g16"][layer].to(torch.uint8))
            if variant == "var":
                assert fixed == 0 and torch.equal(gid, t[f"{kind}.gid.g16"][layer].to(torch.uint8))
            else:
                assert fixed == 16 and torch.equal(gid, (torch.arange(_SD) // 16).to(torch.uint8).expand(_SH, _SD))
            assert gid.dtype == torch.uint8 and gid.shape == (_SH, _SD)
            if clip:
                want = t[f"{kind}.alpha.{variant}.g16.b{bits}"][layer].float()
                assert alpha.dtype == torch.float32 and torch.equal(alpha, want)
            else:
                assert alpha is None
            assert lay._side(kind, _SD, _SH, torch.device("cpu"))[0] is perm  # cached per (side, device)
        k, v = _kv(1, 3, layer, h=_SH, d=_SD)
        seg = lay.quantize(k, v, torch.tensor([3]))
        assert seg.k_bits == 2 and seg.v_bits == 1.5 and seg.lens.dtype == torch.int32
        assert seg.k_group == (0 if variant == "var" else 16) and seg.v_group == seg.k_group
        if variant != "nat":
            assert seg.k_perm.tolist() == t["k.perm.g16"][layer].tolist()
            assert seg.v_perm.tolist() == t["v.perm.g16"][layer].tolist()
        if variant == "var":
            assert seg.k_gid.tolist() == t["k.gid.g16"][layer].tolist()
            assert seg.v_gid.tolist() == t["v.gid.g16"][layer].tolist()
    if variant != "nat":  # the method-level quantize uses layer 0's tables
        seg0 = m.quantize(*_kv(1, 2, 9, h=_SH, d=_SD), torch.tensor([2]))
        assert seg0.k_perm.tolist() == t["k.perm.g16"][0].tolist()


def test_skvq_one_group_per_head_needs_no_order_and_rtn_reads_nothing(skvq_hand_art, tmp_path, monkeypatch):
    folder, t = skvq_hand_art
    lay = _bound(folder, {"group": "32", "v_bits": "1.5"}).for_layer(1, _SL)
    perm, gid, fixed, ng, alpha = lay._side("k", _SD, _SH, "cpu")
    assert perm is None and fixed == 32 and ng == 1 and not gid.any()
    assert torch.equal(alpha, t["k.alpha.var.g32.b2"][1].float())
    # group 128 on head_dim 32 reads the g32 tables
    lay = _bound(folder, {"group": "128", "v_bits": "1.5"}).for_layer(0, _SL)
    assert torch.equal(lay._side("v", _SD, _SH, "cpu")[4], t["v.alpha.var.g32.b1.5"][0].float())
    monkeypatch.setenv("MMKV_CACHE_DIR", str(tmp_path))  # nowhere to find an artifact
    rtn = SKVQ.from_params({"reorder": "off", "clip": "off", "group": "16"}).bind(_skvq_adapter())
    assert rtn._tables is None and rtn._shape == (_SH, _SD) and not rtn.calibrated
    perm, gid, fixed, ng, alpha = rtn.for_layer(0, _SL)._side("k", _SD, _SH, "cpu")
    assert perm is None and alpha is None and fixed == 16 and ng == 2
    assert SKVQ().calibrated and SKVQ(clip=False).calibrated and SKVQ(reorder=False).calibrated


def test_skvq_missing_table_lists_what_the_artifact_holds(skvq_hand_art):
    folder, _ = skvq_hand_art
    with pytest.raises(ValueError, match=r"no 'k.alpha.var.g16.b4'.*mmkv-calibrate skvq --model hand-skvq "
                                         r"--group 16 --k-bits 4 --v-bits 1.5") as e:
        _bound(folder, {"group": "16", "k_bits": "4", "v_bits": "1.5"})
    assert "var.g16.b1.5" in str(e.value) and "fix.g32.b2" in str(e.value)
    with pytest.raises(ValueError, match=r"k.alpha.var.g16.b3"):
        _bound(folder, {"group": "16", "k_bits": "3", "v_bits": "1.5"})
    with pytest.raises(ValueError, match=r"v.alpha.var.g16.b4"):
        _bound(folder, {"group": "16", "v_bits": "4"})
    # without clipping no alpha is read, so the missing bits do not matter
    _bound(folder, {"group": "16", "k_bits": "4", "v_bits": "1.5", "clip": "off"})


def test_skvq_without_reorder_reads_no_order_tables(skvq_hand_art, tmp_path):
    _, t = skvq_hand_art
    ad = _skvq_adapter()
    nat = {k: v for k, v in t.items() if ".alpha.nat." in k}  # an artifact of the natural-order variant only
    artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), nat, {}).save(tmp_path)
    m = SKVQ.from_params({"group": "16", "v_bits": "1.5", "reorder": "off", "artifact": str(tmp_path)}).bind(ad)
    assert sorted(m._tables) == ["k_alpha", "v_alpha"]
    with pytest.raises(ValueError, match="k.perm.g16"):
        SKVQ.from_params({"group": "16", "v_bits": "1.5", "artifact": str(tmp_path)}).bind(ad)


def test_skvq_names_and_variants():
    assert bits_key(1.5) == "1.5" and bits_key(2.0) == "2" and bits_key(3) == "3"
    assert table_names("v", 32, "fix", 1.5) == {"perm": "v.perm.g32", "gid": "v.gid.g32",
                                                "alpha": "v.alpha.fix.g32.b1.5"}
    assert SKVQ(reorder=False, groups="fixed").variant() == "nat"
    assert SKVQ(groups="fixed").variant() == "fix" and SKVQ().variant() == "var"
    assert SKVQ(block=8).flush_block == 8 and SKVQ(v_bits=2).v_bits == 2.0 and isinstance(SKVQ(v_bits=2).v_bits, float)
    SKVQ(group=16).check(48, 2)
    SKVQ(group=128).check(40, 2)  # one group of the whole head
    with pytest.raises(ValueError, match="multiple"):
        SKVQ(group=32).check(48, 2)
    with pytest.raises(ValueError, match="multiple"):
        SKVQ(group=128).check(36, 2)  # 36 is not a multiple of 8


# --- mmkv/spec.py -----------------------------------------------------------------------------------------------
from mmkv.methods import KIVI, CalibQuant  # noqa: E402
from mmkv.spec import CacheSpec, parse_method  # noqa: E402


def test_spec_fields_given_as_strings_are_parsed_for_their_modality():
    s = CacheSpec(visual="calibquant:bits=1", text="kivi:bits=2")
    assert isinstance(s.visual, CalibQuant) and s.visual.bits == 1
    assert isinstance(s.text, KIVI) and s.text.bits == 2
    with pytest.raises(ValueError, match="does not handle text tokens"):
        CacheSpec(text="calibquant")


def test_a_parameter_value_may_contain_an_equals_sign():
    m = parse_method("skvq:reorder=off,clip=off,artifact=/tmp/a=b", "text")
    assert m.artifact == "/tmp/a=b" and m.reorder is False


# --- mmkv/cache/cache.py: names, defaults, empty caches ---------------------------------------------------------
def test_dense_dtype_names_and_empty_cache_defaults():
    assert MMKVCache("fp16", 2).dense_dtype() == "fp16"  # nothing stored: the GPU default
    for dt, name in [(torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32"),
                     (torch.float64, "float64")]:
        c = MMKVCache("fp16", 1)
        c.update(*(x.to(dt) for x in _kv(1, 3)), 0)
        c.finalize()
        assert c.dense_dtype() == name
    assert MMKVCache("fp16", 2).fp16_equivalent_bytes() == 0


def test_nbytes_counts_capacity_unless_asked_for_used_and_all_padding_gives_zero_bits():
    cache = _prefill("text=kivi:bits=2 window=8 sinks=2", 1, 50)
    held, used = cache.nbytes_by_modality(), cache.nbytes_by_modality(used=True)
    assert held == cache.nbytes_by_modality(used=False) and sum(held.values()) > sum(used.values())
    empty = _prefill("fp16 window=8 sinks=2", 2, 4, valid=torch.zeros(2, 4, dtype=torch.long))
    assert empty.tokens_by_modality() == {"visual": 0, "text": 0, "fp16": 0} and empty.elements_per_token() > 0
    assert empty.effective_bits() == {"visual": 0.0, "text": 0.0, "fp16": 0.0, "total": 0.0}


def test_for_model_checks_the_head_dim():
    ad = Adapter(name="odd", family="text", num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=20,
                 lm_config=None)
    with pytest.raises(ValueError):
        MMKVCache.for_model("text=kivi:bits=2", ad)


def test_one_token_forwards_take_the_decode_path_only_when_plain():
    cache = _prefill("visual=calibquant:bits=2 fp16 window=8 sinks=2", 2, 4)
    layer = cache.layers[0]
    assert MMKVCache("fp16", 1).layers[0].segments() == []  # nothing stored: nothing to read
    k, v = _kv(2, 1, 5)
    k_tagged, _ = layer.update(k, v, torch.ones(2, 1, dtype=torch.bool), torch.zeros(2, 1, dtype=torch.bool))
    assert k_tagged._mmkv[1] == "decode" and layer.dense_len == [5, 5]  # all-valid, no visual: a decode step
    k_tagged, _ = layer.update(*_kv(2, 1, 6), torch.tensor([[False], [True]]), None)
    assert k_tagged._mmkv[1] == "extend"  # a padded row: routed like a prompt
    layer.finalize()
    assert layer.dense_len == [5, 6]
    k_tagged, _ = layer.update(*_kv(2, 1, 7), None, torch.tensor([[True], [False]]))
    assert k_tagged._mmkv[1] == "extend"
    layer.finalize()
    assert layer.visual_lens == [[1, 0]] and layer.dense_len == [5, 7]


# --- mmkv/methods/artifacts.py: where an artifact lives, the files it writes, what load gives back ---------------
import datetime as _datetime  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402


def _art_adapter(name="org/m", layers=2):
    return Adapter(name=name, family="text", num_layers=layers, num_q_heads=2, num_kv_heads=1, head_dim=16,
                   lm_config=None)


def test_artifact_default_folder_is_calib_model_method_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MMKV_CACHE_DIR", str(tmp_path))
    assert artifacts.default_dir("org/some-model", "skvq") == tmp_path / "calib" / "org--some-model" / "skvq"
    # slashes at either end dropped (nothing else), then every run of other characters becomes "--"
    assert artifacts.default_dir("/Xorg/m X/", "aquakv") == tmp_path / "calib" / "Xorg--m--X" / "aquakv"


def test_artifact_shape_is_the_adapters_layer_and_kv_head_shape():
    assert artifacts.shape_of(_art_adapter(layers=3)) == {"num_layers": 3, "num_kv_heads": 1, "head_dim": 16}


def test_artifact_save_makes_the_folder_and_writes_the_documented_meta_json(tmp_path):
    ad = _art_adapter()
    folder = tmp_path / "a" / "b"  # neither exists yet
    meta = {"data": Path("/d/valid.txt"), "bits": 2}  # a Path is not JSON: written as its string
    out = artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), {"x": torch.ones(2)}, meta).save(folder)
    assert out == folder and sorted(p.name for p in folder.iterdir()) == ["meta.json", "tensors.safetensors"]
    text = (folder / "meta.json").read_text()
    created = json.loads(text)["created"]
    when = _datetime.datetime.fromisoformat(created)  # UTC, to the second
    assert created.endswith("+00:00") and when.utcoffset() == _datetime.timedelta(0) and when.microsecond == 0
    assert abs(_datetime.datetime.now(_datetime.UTC) - when) < _datetime.timedelta(minutes=5)
    assert text == ('{\n "method": "skvq",\n "model": "org/m",\n'
                    ' "shape": {\n  "num_layers": 2,\n  "num_kv_heads": 1,\n  "head_dim": 16\n },\n'
                    f' "created": "{created}",\n "data": "/d/valid.txt",\n "bits": 2\n}}')


def test_artifact_load_gives_back_method_model_shape_tensors_and_only_the_rest_as_meta(tmp_path):
    ad = _art_adapter()
    t = {"perm": torch.tensor([[1, 0]], dtype=torch.int32), "alpha": torch.tensor([0.5, 0.25])}
    artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), t, {"data": "valid.txt"}).save(tmp_path)
    back = artifacts.load(tmp_path, "skvq", ad)
    assert (back.method, back.model) == ("skvq", "org/m")
    assert back.shape == {"num_layers": 2, "num_kv_heads": 1, "head_dim": 16}
    assert sorted(back.meta) == ["created", "data"] and back.meta["data"] == "valid.txt"
    assert sorted(back.tensors) == ["alpha", "perm"]
    assert back.tensors["perm"].tolist() == [[1, 0]] and back.tensors["perm"].dtype == torch.int32
    assert back.tensors["alpha"].tolist() == [0.5, 0.25]


@pytest.mark.parametrize("missing", ["meta.json", "tensors.safetensors"])
def test_artifact_with_either_file_missing_names_the_command_that_makes_it(tmp_path, missing):
    ad = _art_adapter()
    artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), {"x": torch.ones(2)}).save(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match="make one with: mmkv-calibrate skvq --model org/m"):
        artifacts.load(tmp_path, "skvq", ad)


# --- mmkv/methods/alignedkv.py and fp16.py: quantize ------------------------------------------------------------
from mmkv.methods import FP16, AlignedKV  # noqa: E402


def test_alignedkv_names_the_side_that_is_outside_the_fp16_range():
    ok = torch.ones(1, 1, 4, 16)
    big = ok.clone()
    big[0, 0, 1, 3] = 1e5  # above 65504: inf in fp16
    with pytest.raises(ValueError, match="alignedkv: K has values outside the fp16 range"):
        AlignedKV().quantize(big, ok, torch.tensor([4]))
    with pytest.raises(ValueError, match="alignedkv: V has values outside the fp16 range"):
        AlignedKV().quantize(ok, big, torch.tensor([4]))


def test_fp16_keeps_k_and_v_and_stores_int32_lengths():
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 1, 3, 8, generator=g).half() for _ in range(2))
    seg = FP16().quantize(k, v, torch.tensor([3, 2]))  # int64 lengths; every segment's lens are int32
    assert torch.equal(seg.k, k) and torch.equal(seg.v, v)
    assert seg.lens.dtype == torch.int32 and seg.lens.tolist() == [3, 2]
