"""The scheduler's budget counts the bytes its caches' tensors hold (mmkv/batching/held.py): every row at the
batch's capacities, spare and pad rows included. Checked against an independent walk over the storage of every
tensor of every cache, through joins, leaves, merges, shrinks and flushes; the predictions the scheduler decides
with (after a merge, a keep, a decode step) against the tensors after the event; and a budget that holds the
requests' rows but not their padded bucket, under which every request still gets its alone tokens. CPU, with
buckets forced as tests/test_graph_slots.py does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prefilled import prefilled

from mmkv.batching import Scheduler
from mmkv.batching.held import after_decode, after_keep, after_merge, held, steps_free
from mmkv.cache.rows import keep_rows, merge_rows
from mmkv.cache.slots import clear_rows
from mmkv.graphs import DecodeStepper

FP16 = "fp16 window=8 sinks=4"
KIVI = "text=kivi:bits=2,group=16 window=8 sinks=4"
XQUANT = "text=xquant:kq=15,km=10,vm=10,group=16 window=8 sinks=4"
LAYOUTS = [FP16, KIVI, XQUANT, "text=skvq:reorder=off,clip=off,group=32,block=8 window=8 sinks=4",
           "text=alignedkv:block=32 window=8 sinks=4",
           "text=aquakv:predictors=false,quantizer=hadamard,block=8 window=8 sinks=4"]
SHORT = ["The sea at night is", "Three facts about the moon are", "A good breakfast has"]
LONG = ("List the colours of a rainbow in order, then name two animals that live in the cold polar seas, say what "
        "they eat in winter, how they keep warm when the ice closes over the water, and where they raise their young.")


def storage_bytes(cache) -> int:
    """Bytes of every distinct storage a cache's segments (and recorded positions) keep alive: not the code
    under test's arithmetic, the allocator's view."""
    seen = {}
    tensors = [cache.positions.pos] if cache.positions is not None and cache.positions.pos is not None else []
    for layer in cache.layers:
        for _, seg, _ in layer.parts():
            tensors += [getattr(seg, f.name) for f in dataclasses.fields(seg)
                        if isinstance(getattr(seg, f.name), torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def scheduler_storage(s) -> int:
    return sum(storage_bytes(b.cache) for b in s.batches.values()) + sum(storage_bytes(p.cache) for p in s.prefilling)


@pytest.fixture(scope="module")
def eng(smollm2):
    import mmkv

    return mmkv.Engine(smollm2)


def _chat(p):
    return [{"role": "user", "content": p}]


def _prefilled(eng, text, spec):
    return prefilled(eng, eng.tokenizer(text, return_tensors="pt").input_ids, spec)


@pytest.mark.slow
@pytest.mark.parametrize("spec", LAYOUTS)
def test_predicted_bytes_equal_the_tensors_after_a_merge_a_keep_and_each_decode_step(eng, spec):
    from mmkv.batching import KVBytes

    templates = [layer.text for layer in KVBytes(eng, spec).layers]
    a, ta, na = _prefilled(eng, SHORT[0], spec)
    assert held(a).total == a.nbytes() == storage_bytes(a)
    b, tb, nb = _prefilled(eng, SHORT[1], spec)
    want = after_merge(a, b)
    merge_rows(a, b)
    assert want.total == storage_bytes(a) and want.rows == 2
    want = after_keep(a, [0, 1], rows=4)  # padded to a bucket of 4 with copies of row 0
    keep_rows(a, [0, 1, 0, 0], repeat=True)
    assert want.total == storage_bytes(a)
    if spec != LAYOUTS[-1]:  # AQUA-KV's rows are not reused in place (per-row positions)
        clear_rows(a, [2, 3])
    toks, pos = [ta, tb, 0, 0], [na, nb, 0, 0]
    step = DecodeStepper(eng.model, a, graphs=False)
    changed = 0
    for _ in range(30):  # short prompts: the window grows, and (blocks of 16) a first flush makes the text segment
        free, before = steps_free(a), storage_bytes(a)
        want = after_decode(a, templates)
        with torch.inference_mode():
            logits = step(torch.tensor([[t] for t in toks]), torch.tensor([[p] for p in pos]))
        toks = [int(x) for x in logits.argmax(-1)]
        pos = [p + 1 for p in pos]
        assert want.total == storage_bytes(a) == a.nbytes()
        if free >= 1:  # the steps the scheduler does not re-count change nothing
            assert storage_bytes(a) == before
        changed += storage_bytes(a) != before
    assert changed >= 2
    c, _, _ = _prefilled(eng, LONG, spec)  # longer than every capacity of the batch
    want = after_merge(a, c, keep=[1])  # row 0 and the spares leave as it joins
    keep_rows(a, [1])
    merge_rows(a, c)
    assert want.total == storage_bytes(a) == a.nbytes()


def _run(s, spec, subs, check):
    """Step the scheduler, submitting ``(step, prompt, max_tokens)`` at their steps and calling ``check(s)``
    after every step; returns the jobs and the batch's rows per step."""
    jobs, shapes, i = [], [], 0
    for step in range(400):
        while i < len(subs) and subs[i][0] <= step:
            jobs.append(s.submit(_chat(subs[i][1]), spec=spec, max_new_tokens=subs[i][2]))
            i += 1
        if i == len(subs) and not s.waiting and not s.active():
            return jobs, shapes
        s.step()
        check(s)
        shapes.append(sum(len(b.slots) for b in s.batches.values()))
    raise AssertionError("the scheduler did not finish")


# staggered: rows leave in place and are joined in place, a long prompt does not fit a spare and merges, the batch
# shrinks once fewer than half its rows are live, and decode steps flush blocks and grow the window
STAGGER = [(0, SHORT[0], 30), (0, SHORT[1], 3), (0, SHORT[2], 9), (2, "Name a primary colour.", 6),
           (5, "Write one line about rain.", 4), (8, LONG, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [KIVI, XQUANT])
def test_held_bytes_equal_every_tensors_storage_through_joins_leaves_merges_shrinks_and_flushes(eng, spec):
    s = Scheduler(eng, buckets=True)
    seen = {"text": False}

    def check(s):
        total = scheduler_storage(s)
        assert s.held_bytes() == total
        g = s.gauges()
        assert g["held"] == total
        spare = sum(storage_bytes(b.cache) // len(b.slots) * b.spare for b in s.batches.values())
        assert g["spare"] == spare and g["used"] <= g["held"]
        seen["text"] |= any(layer.text is not None for b in s.batches.values() for layer in b.cache.layers)

    jobs, shapes = _run(s, spec, STAGGER, check)
    for (_, p, n), job in zip(STAGGER, jobs):
        assert job.tokens == eng.generate(_chat(p), spec=spec, max_new_tokens=n).tokens[0].tolist()
    g = s.graph_stats()
    assert g["joins_in_place"] >= 1 and g["joins_merged"] >= 1 and g["leaves_in_place"] >= 1
    assert max(shapes) == 4 and shapes[-2] == 1 and seen["text"]  # padded to 4, shrunk to the last request


@pytest.mark.slow
def test_a_budget_for_the_requests_rows_but_not_their_bucket_holds_every_byte_under_it(eng):
    """Three requests fit the budget as three rows, not as the bucket of four the scheduler pads them to: the batch
    runs unpadded, the tensors never hold more than the budget, every request gets its alone tokens."""
    subs = [(0, SHORT[0], 12), (0, SHORT[1], 10), (0, SHORT[2], 8)]
    peaks = {}
    for buckets in (False, True):
        s = Scheduler(eng, buckets=buckets)
        peaks[buckets] = []
        _run(s, KIVI, subs, lambda s, key=buckets: peaks[key].append(scheduler_storage(s)))
        peaks[buckets] = max(peaks[buckets])
    budget = peaks[False]
    assert peaks[True] > budget  # unbounded, the pad row takes more than the budget
    s = Scheduler(eng, kv_budget_bytes=budget, buckets=True)
    needs = sum(s.submit(_chat(p), spec=KIVI, max_new_tokens=n).need for _, p, n in subs)
    assert needs <= budget  # the requests' own bytes fit: only the held rows would not
    s = Scheduler(eng, kv_budget_bytes=budget, buckets=True)
    held_seen = []

    def check(s):
        held_seen.append(scheduler_storage(s))
        assert held_seen[-1] <= budget
        assert s.gauges()["held"] == held_seen[-1]

    jobs, shapes = _run(s, KIVI, subs, check)
    for (_, p, n), job in zip(subs, jobs):
        assert job.tokens == eng.generate(_chat(p), spec=KIVI, max_new_tokens=n).tokens[0].tolist()
        assert job.finish_reason in ("length", "stop")
    assert s.max_batch == 3 and 4 not in shapes


@pytest.mark.slow
def test_spare_rows_go_when_they_are_what_keeps_a_waiting_request_out(eng):
    """A request leaves its bucket of two in place, so its row stays held; a new request fits beside the running one
    but not beside the spare: the spare row is dropped and the request admitted at once, not after the batch ends."""
    first = [(0, SHORT[0], 24), (0, SHORT[1], 2)]
    s = Scheduler(eng, buckets=True)
    for _, p, n in first:
        s.submit(_chat(p), spec=KIVI, max_new_tokens=n)
    for _ in range(4):
        s.step()
    (b,) = s.batches.values()
    assert b.spare == 1 and len(b.slots) == 2
    late = s.submit(_chat(SHORT[2]), spec=KIVI, max_new_tokens=6)
    budget = s.held_bytes() + late.need - 1  # beside the live row, not beside the spare
    assert s.held_bytes() - b.spare_bytes + late.need <= budget
    s.budget = budget
    s.step()
    assert late not in s.waiting and late.preemptions == 0
    assert len(b.slots) == 1 + (late in b.jobs) and scheduler_storage(s) <= budget
    s.drain(200)
    assert late.tokens == eng.generate(_chat(SHORT[2]), spec=KIVI, max_new_tokens=6).tokens[0].tolist()


def test_metrics_show_live_held_and_spare_bytes_apart():
    from mmkv.serve.metrics import Metrics

    m = Metrics()
    m.source = lambda: {"running": 3, "waiting": 1, "used": 1000, "held": 5000, "spare": 1200, "budget": 6000,
                        "max_batch": 3, "graphs": {}}
    text = m.render("x")
    for line in ('mmkv_kv_cache_bytes_used{model="x"} 1000', 'mmkv_kv_cache_bytes_held{model="x"} 5000',
                 'mmkv_kv_cache_bytes_spare{model="x"} 1200', 'mmkv_kv_cache_bytes_budget{model="x"} 6000',
                 "# TYPE mmkv_kv_cache_bytes_held gauge", "# TYPE mmkv_kv_cache_bytes_spare gauge"):
        assert line in text
