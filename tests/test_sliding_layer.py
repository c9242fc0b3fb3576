"""The sliding-window cache layer (mmkv/cache/sliding.py) against attention over the whole sequence under
transformers' window rule (a query at ``p`` sees keys ``p - W < k <= p``): prompts shorter and longer than the
window, with padding, decode steps that wrap the ring, later chunks of new tokens (extend), crops, and memory that
stops at the window."""

from __future__ import annotations

import pytest
import torch

from mmkv.attention import mmkv_attention
from mmkv.cache import MMKVCache
from mmkv.cache.sliding import SlidingLayer

H, D, W = 2, 16, 6


def _reference(q, ks, vs, lengths, w=W):
    """Attention of the last ``q.shape[2]`` tokens over all ``lengths`` tokens of each row, windowed."""
    outs = []
    for row, n in enumerate(lengths):
        t = q.shape[2]
        k, v = ks[row, :, :n], vs[row, :, :n]
        pos_q = torch.arange(n - t, n)[:, None]
        pos_k = torch.arange(n)[None]
        mask = (pos_k <= pos_q) & (pos_k > pos_q - w)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[row : row + 1], k[None], v[None],
                                                                     attn_mask=mask, scale=0.25))
    return torch.cat(outs).transpose(1, 2)


def _capacity(layer):
    return layer.dense.k.shape[2]


class _Module:  # what transformers passes attention functions: only read for its config
    pass


def _attend(cache, layer_idx, q, k, v, valid=None):
    cache.set_inputs(valid, None)
    kt, vt = cache.update(k, v, layer_idx)
    return mmkv_attention(_Module(), q, kt, vt, None, scaling=0.25)[0]


@pytest.mark.parametrize("prompt", [3, 11])
def test_decode_and_extend_read_exactly_the_window(prompt):
    g = torch.Generator().manual_seed(prompt)
    total = prompt + 9 + 4 + 1
    ks, vs, qs = (torch.randn(2, H, total, D, generator=g) for _ in range(3))
    cache = MMKVCache("fp16 window=4 sinks=1", num_layers=1, windows=(W,))
    layer = cache.layers[0]
    assert isinstance(layer, SlidingLayer) and cache.is_sliding == [True]
    # row 1 is left-padded by two tokens: its real tokens are fewer by two throughout
    valid = torch.ones(2, prompt, dtype=torch.bool)
    valid[1, :2] = False
    _attend(cache, 0, qs[:, :, :prompt], ks[:, :, :prompt], vs[:, :, :prompt], valid)
    cache.finalize()
    real = [[*range(prompt)], [*range(2, prompt)]]
    assert layer.dense_len == [min(len(r), W) for r in real]
    for s in range(prompt, prompt + 9):  # decode steps: the ring fills and wraps
        out = _attend(cache, 0, qs[:, :, s : s + 1], ks[:, :, s : s + 1], vs[:, :, s : s + 1])
        real = [r + [s] for r in real]
        idx = [torch.tensor(r) for r in real]
        want = torch.cat([_reference(qs[i : i + 1, :, s : s + 1], ks[i : i + 1][:, :, idx[i]],
                                     vs[i : i + 1][:, :, idx[i]], [len(real[i])]) for i in range(2)])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert layer.dense_len == [min(len(r), W) for r in real]
    assert _capacity(layer) == W  # memory stopped at the window
    # a chunk of 4 new tokens over the held ones (a later chat turn): each sees only its own window
    a, b = prompt + 9, prompt + 13
    out = _attend(cache, 0, qs[:, :, a:b], ks[:, :, a:b], vs[:, :, a:b])
    real = [r + [*range(a, b)] for r in real]
    for i in range(2):
        idx = torch.tensor(real[i])
        want = _reference(qs[i : i + 1, :, a:b], ks[i : i + 1][:, :, idx], vs[i : i + 1][:, :, idx], [len(idx)])
        torch.testing.assert_close(out[i : i + 1], want, rtol=1e-5, atol=1e-5)
    cache.finalize()
    # after the chunk the ring is in order again and the next decode step still reads its window
    out = _attend(cache, 0, qs[:, :, b : b + 1], ks[:, :, b : b + 1], vs[:, :, b : b + 1])
    for i in range(2):
        idx = torch.tensor(real[i] + [b])
        want = _reference(qs[i : i + 1, :, b : b + 1], ks[i : i + 1][:, :, idx], vs[i : i + 1][:, :, idx], [len(idx)])
        torch.testing.assert_close(out[i : i + 1], want, rtol=1e-5, atol=1e-5)


def test_crop_uncovers_evicted_tokens_from_the_spare_or_refuses():
    g = torch.Generator().manual_seed(0)
    ks, vs, qs = (torch.randn(1, H, 20, D, generator=g) for _ in range(3))
    cache = MMKVCache("fp16 window=1", num_layers=1, windows=(W,))  # a spare of one evicted token
    layer = cache.layers[0]
    _attend(cache, 0, qs[:, :, :9], ks[:, :, :9], vs[:, :, :9])
    cache.finalize()
    for s in range(9, 12):
        _attend(cache, 0, qs[:, :, s : s + 1], ks[:, :, s : s + 1], vs[:, :, s : s + 1])
    assert layer.dense_len == [W] and layer.spare_len == [1]  # window 6..11, spare 5, 0..4 gone
    with pytest.raises(ValueError, match="already evicted"):
        layer.crop(3)  # the next query would see 4..9, and 4 is gone
    layer.crop(2)  # drop 10 and 11: the next query sees 5..9 and itself
    assert layer.seen == 10 and layer.dense_len == [W - 1]
    out = _attend(cache, 0, qs[:, :, 12:13], ks[:, :, 12:13], vs[:, :, 12:13])  # token 12 fed at position 10
    idx = torch.tensor([5, 6, 7, 8, 9, 12])
    want = _reference(qs[:, :, 12:13], ks[:, :, idx], vs[:, :, idx], [6])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_memory_stops_at_the_window_and_full_layers_keep_growing():
    cache = MMKVCache("fp16 window=4 sinks=1", num_layers=2, windows=(W, None))
    k = torch.randn(1, H, 3, D)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    cache.finalize()
    sizes = []
    for _ in range(20):
        k = torch.randn(1, H, 1, D)
        cache.update(k, k, 0)
        cache.update(k, k, 1)
        sizes.append(cache.nbytes_by_layer(used=True))
    per_token = 2 * H * D * k.element_size()
    # the sliding layer: its window and a spare of the spec's window (4) of evicted tokens, then no more
    assert sizes[-1][0] == sizes[8][0] == (W + 4) * per_token
    assert sizes[-1][1] == 23 * per_token > sizes[5][1]
    assert cache.tokens_by_modality()["fp16"] == 23  # counted on the full-attention layer
    # a plain transformers cache keeps window - 1 tokens in a sliding layer: that is the baseline reported
    assert cache.fp16_equivalent_bytes() == (23 + W - 1) * per_token


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="windows gives 1 layers, the cache has 2"):
        MMKVCache("fp16", num_layers=2, windows=(4,))
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        MMKVCache("fp16", num_layers=1, windows=(0,))
