"""Rows reused in place (mmkv/cache/slots.py) and the scheduler's slots (mmkv/batching/scheduler.py): a request that
joins a spare row or leaves one moves no tensor of the batch (what keeps a captured decode graph valid), and every
request still gets the greedy tokens it gets alone, through joins and leaves at staggered lengths. On CPU graphs do
not run, so ``buckets=True`` forces the slot logic; tests/test_scheduler_device.py runs it with graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from mmkv.batching import KVBytes, Scheduler
from mmkv.cache import MMKVCache
from mmkv.cache.rows import keep_rows, merge_rows
from mmkv.cache.slots import clear_row, misfit, unsupported, write_row
from mmkv.engine import first_positions, prefill
from mmkv.graphs import DecodeStepper

FP16 = "fp16 window=8 sinks=4"
KIVI = "text=kivi:bits=2,group=16 window=8 sinks=4"
XQUANT = "text=xquant:kq=15,km=10,vm=10,group=16 window=8 sinks=4"
SHORT = ["The sea at night is", "Three facts about the moon are", "A good breakfast has"]
MEDIUM = ("List the colours of a rainbow in order, then name two animals that live in the cold polar seas, say what "
        "they eat in winter, how they keep warm when the ice closes over the water, where they raise their young, "
        "and how far they swim in one season, then explain in a few careful sentences why the sea stays salty. ")
LONG = 2 * MEDIUM


@pytest.fixture(scope="module")
def eng(smollm2):
    import mmkv

    return mmkv.Engine(smollm2)


def _ids(eng, text):
    return eng.tokenizer(text, return_tensors="pt").input_ids


def _prefilled(eng, ids, spec):
    mask = torch.ones_like(ids)
    positions, _ = first_positions(eng, ids, mask, {})
    cache = MMKVCache.for_model(spec, eng.adapter)
    logits = prefill(eng, cache, ids, mask, mask, torch.zeros_like(ids, dtype=torch.bool), positions, {})
    return cache, int(logits.argmax(-1))


def _tensors(cache) -> list[tuple[int, tuple, tuple]]:
    """Every segment tensor of the cache: address, shape, stride (lens included)."""
    out = []
    for layer in cache.layers:
        for _, seg, _ in layer.parts():
            for t in [seg.lens] + [getattr(seg, f) for f in vars(seg) if isinstance(getattr(seg, f), torch.Tensor)]:
                out.append((t.data_ptr(), tuple(t.shape), t.stride()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("spec", [FP16, KIVI, XQUANT])
def test_a_row_written_into_a_spare_and_a_row_cleared_move_no_tensor_and_decode_as_alone(eng, spec):
    steps = 12
    alone = {p: eng.generate(_ids(eng, p), spec=spec, max_new_tokens=steps + 1).tokens[0].tolist()
             for p in SHORT}
    kv = KVBytes(eng, spec)
    # rows 0, 1: two requests; rows 2, 3: spares (copies of row 0, emptied), as the scheduler pads a bucket
    a, ta = _prefilled(eng, _ids(eng, SHORT[0]), spec)
    b, tb = _prefilled(eng, _ids(eng, SHORT[1]), spec)
    merge_rows(a, b)
    keep_rows(a, [0, 1, 0, 0], repeat=True)
    clear_row(a, 2)
    clear_row(a, 3)
    assert a.nbytes(used=True) == kv.total(0, _ids(eng, SHORT[0]).shape[1]) + kv.total(0, _ids(eng, SHORT[1]).shape[1])
    rows = {0: [SHORT[0], [ta], _ids(eng, SHORT[0]).shape[1]], 1: [SHORT[1], [tb], _ids(eng, SHORT[1]).shape[1]]}
    before_sig, before = a.layout_signature(), _tensors(a)
    step = DecodeStepper(eng.model, a, graphs=False)
    for i in range(steps):
        if i == 3:  # the third request joins row 3 in place
            c, tc = _prefilled(eng, _ids(eng, SHORT[2]), spec)
            assert misfit(a, c) is None
            sig = a.layout_signature()
            write_row(a, 3, c)
            assert a.layout_signature() == sig
            rows[3] = [SHORT[2], [tc], _ids(eng, SHORT[2]).shape[1]]
        if i == 5:  # the first leaves: its row becomes a spare in place; spare row 2, which decoded pads, is emptied
            sig = a.layout_signature()
            clear_row(a, 0)
            clear_row(a, 2)
            assert a.layout_signature() == sig
            done = rows.pop(0)
            assert done[1] == alone[done[0]][: len(done[1])]
            assert a.nbytes(used=True) == sum(kv.total(0, n) for _, _, n in rows.values())
        ids = torch.tensor([[rows[r][1][-1]] if r in rows else [0] for r in range(4)])
        pos = torch.tensor([[rows[r][2]] if r in rows else [0] for r in range(4)])
        with torch.inference_mode():
            logits = step(ids, pos)
        for r, row in rows.items():
            row[1].append(int(logits[r].argmax()))
            row[2] += 1
    for p, got, _ in rows.values():
        assert got == alone[p][: len(got)], p
    if a.layout_signature() == before_sig:  # no flush grew anything: then not a single tensor moved
        assert _tensors(a) == before


@pytest.mark.slow
def test_a_row_longer_than_the_batchs_capacity_does_not_fit_a_spare(eng):
    short, _ = _prefilled(eng, _ids(eng, SHORT[0]), KIVI)  # all its text in the fp16 window: no text segment
    long_row, _ = _prefilled(eng, _ids(eng, LONG), KIVI)  # ~130 tokens: 7 blocks of 16 in its text segment
    assert "no text segment" in misfit(short, long_row)
    a, _ = _prefilled(eng, _ids(eng, MEDIUM), KIVI)  # ~65 tokens, 3 blocks flushed: a text segment of 4 blocks
    keep_rows(a, [0, 0], repeat=True)
    clear_row(a, 1)
    assert "along tokens" in misfit(a, long_row)
    with pytest.raises(ValueError, match="cannot take row 1 in place"):
        write_row(a, 1, long_row)
    two, _ = _prefilled(eng, _ids(eng, SHORT[1]), KIVI)
    merge_rows(two, _prefilled(eng, _ids(eng, SHORT[2]), KIVI)[0])
    assert "one row" in misfit(a, two)
    other_spec, _ = _prefilled(eng, _ids(eng, SHORT[1]), FP16)
    assert "spec" in misfit(a, other_spec)
    with pytest.raises(ValueError, match="not a row"):
        clear_row(a, 2)


def test_caches_with_row_state_beside_their_segments_are_not_reused_in_place(eng):
    aqua = MMKVCache.for_model("text=aquakv:predictors=false,quantizer=hadamard,block=8", eng.adapter)
    assert "positions" in unsupported(aqua)
    sliding = MMKVCache("fp16", num_layers=2, windows=(4, None))
    assert "sliding" in unsupported(sliding)
    assert unsupported(MMKVCache(KIVI, num_layers=2)) is None


def _chat(p):
    return [{"role": "user", "content": p}]


def _run_staggered(s, spec, submissions):
    """Step the scheduler, submitting ``(step, prompt, max_tokens)`` at their steps; rows of the batch per step."""
    jobs, shapes, i = [], [], 0
    for step in range(400):
        while i < len(submissions) and submissions[i][0] <= step:
            _, p, n = submissions[i]
            jobs.append(s.submit(p, spec=spec, max_new_tokens=n))
            i += 1
        if i == len(submissions) and not s.waiting and not s.active():
            return jobs, shapes
        s.step()
        shapes.append(sum(len(b.slots) for b in s.batches.values()))
    raise AssertionError("the scheduler did not finish")


# request (step it arrives, prompt, max_tokens): staggered lengths, so rows leave while others run and join
STAGGER = [(0, SHORT[0], 14), (0, SHORT[1], 3), (0, SHORT[2], 9), (2, "Name a primary colour.", 6),
           (5, "Write one line about rain.", 10), (6, "What is two plus two?", 4), (9, SHORT[1], 5)]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [FP16, KIVI, XQUANT])
def test_staggered_joins_and_leaves_reuse_rows_in_place_and_keep_alone_tokens(eng, spec):
    s = Scheduler(eng, buckets=True)
    subs = [(t, _chat(p), n) for t, p, n in STAGGER]
    jobs, shapes = _run_staggered(s, spec, subs)
    for (_, msgs, n), job in zip(subs, jobs):
        want = eng.generate(msgs, spec=spec, max_new_tokens=n).tokens[0].tolist()
        assert job.tokens == want and job.finish_reason in ("length", "stop")
    g = s.graph_stats()
    assert g["joins_in_place"] >= 2 and g["leaves_in_place"] >= 2
    assert g["joins_in_place"] + g["joins_merged"] == len(STAGGER) - 1  # the first request starts the batch
    assert set(shapes) <= {0, 1, 2, 4, 8}  # always a bucket (0: nothing decoding)
    assert s.gauges()["graphs"] == g  # what /metrics shows


@pytest.mark.slow
def test_a_join_that_does_not_fit_merges_and_keeps_alone_tokens(eng):
    s = Scheduler(eng, buckets=True)
    # two short requests fill bucket 2; one leaves; a long prompt (more text than the batch's segments hold) joins
    subs = [(0, SHORT[0], 12), (0, SHORT[1], 2), (4, LONG, 5)]
    jobs, shapes = _run_staggered(s, KIVI, subs)
    for (_, p, n), job in zip(subs, jobs):
        assert job.tokens == eng.generate(p, spec=KIVI, max_new_tokens=n).tokens[0].tolist()
    g = s.graph_stats()
    assert g["joins_in_place"] == 0 and g["joins_merged"] == 2 and g["leaves_in_place"] >= 1
    assert max(shapes) == 2


@pytest.mark.slow
def test_a_batch_shrinks_only_below_half_its_rows(eng):
    s = Scheduler(eng, buckets=True)
    # four requests in bucket 4 leave after 2, 3, 4 and 12 tokens (the first from the prefill): the steps that decode
    # 3 and 2 of them keep 4 rows, the one left alone goes to 1 row
    subs = [(0, SHORT[0], 12), (0, SHORT[1], 2), (0, SHORT[2], 3), (0, "Name a primary colour.", 4)]
    jobs, shapes = _run_staggered(s, FP16, subs)
    assert [len(j.tokens) for j in jobs] == [12, 2, 3, 4]  # no early end of text: the schedule is the one above
    assert shapes[:3] == [4, 4, 4] and set(shapes[3:-1]) == {1} and shapes[-1] == 0  # 0: the batch ended
    g = s.graph_stats()  # the third request's merge padded 3 rows to 4 at once, so the fourth took a spare
    assert (g["joins_merged"], g["joins_in_place"], g["reshapes"]) == (2, 1, 2)  # padded to 4, shrunk to 1


@pytest.fixture(scope="module")
def llava(tiny_random_llava):
    import mmkv

    return mmkv.Engine(tiny_random_llava)


@pytest.mark.slow
def test_image_requests_with_1_bit_calibquant_visual_join_and_leave_in_place(llava, square_image_path):
    from tiny_vlms import image_chat

    spec = "visual=calibquant:bits=1 " + KIVI
    s = Scheduler(llava, buckets=True)
    texts = ["What is in the picture?", "Describe the colours.", "Is it day or night?", "Count the shapes."]
    subs = [(0, image_chat(str(square_image_path), text=texts[0]), 8),
            (0, image_chat(str(square_image_path), text=texts[1]), 2),
            (3, image_chat(str(square_image_path), text=texts[2]), 4),
            (4, image_chat(str(square_image_path), text=texts[3]), 3)]
    jobs, _ = _run_staggered(s, spec, subs)
    for (_, msgs, n), job in zip(subs, jobs):
        assert job.tokens == llava.generate(msgs, spec=spec, max_new_tokens=n).tokens[0].tolist()
    g = s.graph_stats()
    assert g["joins_in_place"] >= 1 and g["leaves_in_place"] >= 1



def test_metrics_show_the_graph_and_slot_counters():
    from mmkv.serve.metrics import Metrics

    m = Metrics()
    counts = {"graph_captures": 3, "graph_replays": 250, "eager_steps": 9, "joins_in_place": 40, "joins_merged": 4,
              "leaves_in_place": 41, "reshapes": 2}
    m.source = lambda: {"running": 2, "waiting": 0, "used": 10, "budget": None, "max_batch": 8, "graphs": counts}
    text = m.render("x")
    for key, n in counts.items():
        assert f'mmkv_decode_{key}_total{{model="x"}} {n}' in text
    assert "# TYPE mmkv_decode_graph_replays_total counter" in text
