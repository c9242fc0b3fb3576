"""Rows in and out of a running cache (mmkv/cache/rows.py) and the exact byte projection (mmkv/batching/kvbytes.py):
rows decoded inside a merged batch give the tokens each request gets alone, before and after other rows leave,
for every layout; used bytes of a batch are the sum of its rows' and equal the projection."""

from __future__ import annotations

import pytest
import torch
from prefilled import prefilled

import kernels
from mmkv.batching import KVBytes
from mmkv.cache import MMKVCache
from mmkv.cache.rows import keep_rows, merge_rows
from mmkv.graphs import DecodeStepper

# small windows and blocks so that a short prompt already fills sinks, window and text segment
TEXT_SPECS = [
    "fp16",
    "text=kivi:bits=2,group=16 window=8 sinks=4",
    "text=xquant:kq=15,km=10,vm=10,group=16 window=8 sinks=4",
    "text=xquant:share=average,km=10,vm=10,group=16 window=8 sinks=4",
    "text=skvq:reorder=off,clip=off,group=32,block=8 window=8 sinks=4",
    "text=alignedkv:block=32 window=8 sinks=4",
    "text=aquakv:predictors=false,quantizer=hadamard,block=8 window=8 sinks=4",
]
PROMPTS = ["The sea at night is", "Three facts about the moon and the way it moves around the earth every month are",
           ("List the colours of a rainbow in order, then name two animals that live in the cold polar seas, say "
            "what they eat in winter, how they keep warm when the ice closes over the water, and then")]
STEPS, LEAVE_AT = 10, 4


def _alone(eng, ids, spec):
    out = eng.generate(ids, spec=spec, max_new_tokens=STEPS + 1)
    return out.tokens[0].tolist(), out.cache


@pytest.mark.slow
@pytest.mark.parametrize("spec", TEXT_SPECS)
def test_rows_decode_in_a_merged_batch_as_alone_before_and_after_rows_leave(smollm2, spec):
    import mmkv

    eng = mmkv.Engine(smollm2)
    ids = [eng.tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    alone = [_alone(eng, x, spec) for x in ids]
    kv = KVBytes(eng, spec)
    for x, (toks, cache) in zip(ids, alone):  # the projection is the cache's own accounting, per modality
        assert kv.by_modality(0, x.shape[1] + len(toks) - 1) == cache.nbytes_by_modality(used=True)
        assert kv.effective_bits(0, x.shape[1] + len(toks) - 1) == pytest.approx(cache.effective_bits())

    parts = [prefilled(eng, x, spec) for x in ids]
    batch = parts[0][0]
    for cache, _, _ in parts[1:]:
        merge_rows(batch, cache)
    assert batch.nbytes(used=True) == sum(kv.total(0, n) for _, _, n in parts)
    assert len(batch.layers[0].dense_len) == 3
    got = [[t] for _, t, _ in parts]
    pos = [n for _, _, n in parts]
    live = [0, 1, 2]
    step = DecodeStepper(eng.model, batch, graphs=False)
    for i in range(STEPS):
        if i == LEAVE_AT:  # the shortest request leaves; the others go on in a smaller batch
            keep_rows(batch, [1, 2])
            live = [1, 2]
            step = DecodeStepper(eng.model, batch, graphs=False)
            assert batch.nbytes(used=True) == sum(kv.total(0, pos[r]) for r in live)
        with torch.inference_mode():
            logits = step(torch.tensor([[got[r][-1]] for r in live]), torch.tensor([[pos[r]] for r in live]))
        for j, r in enumerate(live):
            got[r].append(int(logits[j].argmax()))
            pos[r] += 1
    # alone stops at an end-of-text token; the batch loop here does not
    assert got[0] == alone[0][0][: LEAVE_AT + 1]
    assert got[1][: len(alone[1][0])] == alone[1][0] and got[2][: len(alone[2][0])] == alone[2][0]
    assert min(len(alone[1][0]), len(alone[2][0])) > LEAVE_AT + 1
    assert batch.nbytes(used=True) == sum(kv.total(0, pos[r]) for r in live)
    assert batch.layers[0].text is not None or "fp16" == spec  # the prompts reached the text segment


VISUAL_SPECS = ["visual=calibquant:bits=1 text=kivi:bits=2,group=16 window=8 sinks=2",
                "visual=calibquant:bits=2,value_axis=global window=8 sinks=2",
                "visual=calibquant:bits=4,block=16 window=8 sinks=2",
                "visual=kivi:bits=2,group=16 window=8 sinks=2",
                "visual=alignedkv text=alignedkv window=8 sinks=2",
                "visual=fp16 text=xquant:kq=1,km=1,vm=1,group=16 window=8 sinks=2"]
H, D, LAYERS = 2, 32, 2


def _request(spec, n_text, n_vis, seed):
    """A cache filled with one prompt of random K/V: ``n_vis`` visual tokens after the first text tokens."""
    g = torch.Generator().manual_seed(seed)
    t = n_text + n_vis
    cache = MMKVCache(spec, LAYERS, D)
    visual = torch.zeros(1, t, dtype=torch.bool)
    visual[0, 3 : 3 + n_vis] = True
    cache.set_inputs(None, visual)
    for i in range(LAYERS):
        cache.update(torch.randn(1, H, t, D, generator=g), torch.randn(1, H, t, D, generator=g), i)
    cache.finalize()
    return cache


def _attend(cache, q, rows):
    return [kernels.decode_attention(q[rows], layer.segments(), D**-0.5) for layer in cache.layers]


@pytest.mark.parametrize("spec", VISUAL_SPECS)
def test_visual_segments_of_every_layout_merge_and_leave_row_exactly(spec):
    shapes = [(20, 24), (33, 0), (9, 40)]  # (text, visual): ragged, one request without an image
    alone = [_request(spec, a, b, seed) for seed, (a, b) in enumerate(shapes)]
    q = torch.randn(3, 2 * H, D, generator=torch.Generator().manual_seed(9))
    want = [_attend(c, q, [r]) for r, c in enumerate(alone)]
    used = [c.nbytes_by_modality(used=True) for c in alone]
    batch = _request(spec, *shapes[0], 0)
    merge_rows(batch, alone[1])
    merge_rows(batch, alone[2])
    got = _attend(batch, q, [0, 1, 2])
    for r in range(3):
        for lay in range(LAYERS):
            torch.testing.assert_close(got[lay][r : r + 1], want[r][lay], rtol=1e-5, atol=1e-6)  # padded rows change the sum order only
    total = batch.nbytes_by_modality(used=True)
    assert total == {m: sum(u[m] for u in used) for m in total}
    keep_rows(batch, [2, 1])  # the first request leaves; order is the one given
    got = _attend(batch, q, [2, 1])
    for j, r in enumerate([2, 1]):
        for lay in range(LAYERS):
            torch.testing.assert_close(got[lay][j : j + 1], want[r][lay], rtol=1e-5, atol=1e-6)  # padded rows change the sum order only
    assert batch.nbytes(used=True) == used[1]["visual"] + used[2]["visual"] + sum(
        used[r][m] for r in (1, 2) for m in ("text", "fp16"))


def test_rows_refuse_what_they_cannot_hold():
    a = _request("visual=kivi:bits=2,group=16 window=8 sinks=2", 20, 24, 0)
    b = _request("visual=kivi:bits=4,group=16 window=8 sinks=2", 20, 24, 1)
    with pytest.raises(ValueError, match="spec"):
        merge_rows(a, b)
    with pytest.raises(ValueError, match="distinct rows"):
        keep_rows(a, [0, 0])
    with pytest.raises(ValueError, match="distinct rows"):
        keep_rows(a, [1])
    a.set_inputs(None, None)
    a._valid = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="between forwards"):
        keep_rows(a, [0])


@pytest.mark.slow
@pytest.mark.parametrize("spec", TEXT_SPECS[1:3])
def test_the_peak_is_the_largest_total_on_the_way_which_is_not_always_the_last(smollm2, spec):
    """Admission needs the peak: the fp16 window fills before a flush moves a block into 2-bit codes."""
    import mmkv

    kv = KVBytes(mmkv.Engine(smollm2), spec)
    for first, last in [(5, 5), (3, 40), (30, 90), (12, 13)]:
        assert kv.peak(0, first, last) == max(kv.total(0, n) for n in range(first, last + 1))
    assert kv.peak(7, 30, 50) == max(kv.total(7, n) for n in range(30, 51))
    assert any(kv.peak(0, 35, 35 + k) > kv.total(0, 35 + k) for k in range(40))
