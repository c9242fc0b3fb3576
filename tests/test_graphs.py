"""The host-side contract that lets decode steps replay from a CUDA graph (mmkv/graphs.py), checked on CPU:

* ``decode_steps_free()`` predicts exactly how many eager decode steps leave every segment tensor where it was
  (same addresses and shapes: ``layout_signature`` unchanged), and the next step does move something;
* ``advance_decode()`` reproduces the host state of an eager decode step;
* flushes update ``lens`` in place, so a flush that does not reallocate keeps the signature.
The GPU half (graph replays vs eager logits) is in tests/test_gpu_e2e.py.
"""

import pytest
import torch

from mmkv.cache import MMKVCache

H, D, L = 3, 64, 4


def step(cache, seed):
    g = torch.Generator().manual_seed(seed)
    for layer in range(L):
        cache.update(torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g), layer)


def prefill(spec, t=170):
    cache = MMKVCache(spec, num_layers=L, head_dim=D)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, :9] = 0  # rows of different lengths
    cache.set_inputs(mask, None)
    for layer in range(L):
        cache.update(torch.randn(2, H, t, D, generator=g), torch.randn(2, H, t, D, generator=g), layer)
    cache.finalize()
    return cache


def host(cache):
    return [(layer.seen, list(layer.dense_len), list(layer.text_len)) for layer in cache.layers]


@pytest.mark.parametrize("spec", ["text=kivi:bits=2 window=32 sinks=4", "text=xquant:kq=2,vq=1,km=2,vm=2 window=16",
                                  "fp16 window=8 sinks=2", "text=kivi:bits=1,group=64 window=0 sinks=0"])
def test_free_steps_keep_the_layout_and_the_next_step_moves_it(spec):
    cache = prefill(spec)
    step(cache, 1)  # the first decode step grows the fp16 segment to its steady size
    for round_ in range(3):
        free = cache.decode_steps_free()
        sig = cache.layout_signature()
        for i in range(free):
            step(cache, 100 * round_ + i)
            assert cache.layout_signature() == sig, f"step {i + 1} of {free} free steps moved memory"
        lens_before = [int(x) for x in cache.layers[0].dense.lens]
        step(cache, 999 + round_)
        assert cache.decode_steps_free() > 0
        moved = cache.layout_signature() != sig
        flushed = [int(x) for x in cache.layers[0].dense.lens] != [n + 1 for n in lens_before]
        assert moved or flushed, "decode_steps_free() said a flush or growth was due, but nothing happened"


def test_advance_decode_mirrors_an_eager_step():
    a = prefill("text=kivi:bits=2 window=32 sinks=4")
    b = prefill("text=kivi:bits=2 window=32 sinks=4")
    step(a, 1)
    step(b, 1)
    assert a.decode_steps_free() > 0
    step(a, 2)
    b.advance_decode()
    assert host(a) == host(b)


def test_flush_updates_lens_in_place():
    cache = prefill("text=kivi:bits=2 window=32 sinks=4")
    step(cache, 1)
    text_lens, dense_lens = cache.layers[0].text.lens, cache.layers[0].dense.lens
    for i in range(cache.decode_steps_free() + 1):  # through one flush
        step(cache, 10 + i)
    assert cache.layers[0].text.lens is text_lens and cache.layers[0].dense.lens is dense_lens
    assert [int(x) for x in text_lens] == cache.layers[0].text_len


def test_pending_prefill_or_new_inputs_are_never_graphed():
    cache = prefill("text=kivi:bits=2")
    cache.set_inputs(torch.ones(2, 1, dtype=torch.long), None)
    assert cache.decode_steps_free() == 0
