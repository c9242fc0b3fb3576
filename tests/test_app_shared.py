"""``--shared`` (mmkv/ui/shared.py) on SmolLM2: two sessions' chat turns, through the app's own handler functions
(no browser), decode in one scheduler batch, each gets the answer it gets alone, and the stats panel's numbers are
the real caches' own accounting: this answer's bytes, the shared batch, the bytes all answers hold, the budget."""

from __future__ import annotations

import threading
import time

import pytest

from mmkv.batching import Scheduler
from mmkv.batching.chunks import DEFAULT_CHUNK
from mmkv.ui import chat, stats
from mmkv.ui.launch import make_host, parse_args
from mmkv.ui.session import Session
from mmkv.ui.shared import SharedEngine, shared_loader
from mmkv.ui.uploads import Limits

SPEC = "text=kivi:bits=2,group=16 window=8 sinks=4"
INFO = {"name": "smollm2-135m", "family": "text", "synthetic": None, "takes_images": False, "takes_video": False}
QS = ["Name a primary colour.", "Write one line about the sea."]
N = 8
BUDGET = 10**8


@pytest.fixture(scope="module")
def eng(smollm2):
    import mmkv

    return mmkv.Engine(smollm2)


@pytest.fixture(scope="module")
def alone(eng):
    return [eng.generate([{"role": "user", "content": q}], spec=SPEC, max_new_tokens=N) for q in QS]


@pytest.mark.slow
def test_two_sessions_share_one_batch_and_get_their_alone_answers(eng, alone):
    s = Scheduler(eng, kv_budget_bytes=BUDGET)
    shared = SharedEngine(eng, scheduler=s, start=False)
    streams = []
    opened = shared.stream

    def keep(*a, **kw):  # the test reads each answer's job (its timings) after the handler is done
        st = opened(*a, **kw)
        streams.append((threading.current_thread().name, st))
        return st

    shared.stream = keep
    sessions = [Session(), Session()]
    for sess, q in zip(sessions, QS):
        assert chat.add_turn(sess, q, INFO, Limits())[1]
    live = {0: [], 1: []}

    def user(i):
        for _ in chat.respond(sessions[i], shared, INFO, SPEC, chat.GenParams(max_new_tokens=N)):
            if sessions[i].stream is not None:  # the last frame comes after the answer is done
                live[i].append(stats.snapshot(sessions[i].stream.stats))

    threads = [threading.Thread(target=user, args=(i,), name=f"user{i}") for i in range(2)]
    for t in threads:
        t.start()
    for _ in range(500):  # the loop starts once both wait, so they join one batch
        if len(s.waiting) == 2:
            break
        time.sleep(0.01)
    s.start()
    for t in threads:
        t.join(timeout=120)
    s.close()
    by_user = dict(streams)  # which user submitted first is up to the threads: pair each session with its own
    for i, (sess, want) in enumerate(zip(sessions, alone)):
        st = by_user[f"user{i}"]
        assert sess.turns[-1].text == want.text[0] and not sess.turns[-1].error
        got = sess.last_stats
        for key in ("cache_bytes_used", "cache_tokens", "fp16_equivalent_bytes", "cache_dtype"):
            assert got[key] == want.stats[key], key
        assert got["effective_bits"] == pytest.approx(want.stats["effective_bits"])
        n = want.tokens.shape[1]
        assert got["new_tokens"] == n and got["shared"]["batch_max"] == 2 and got["shared"]["kv_budget"] == BUDGET
        job = st.job
        assert got["decode_tokens_per_s"] == pytest.approx((n - 1) / (job.t_end - job.t_first))
        panel = stats.stats_html(got)
        assert 'data-batch-max="2"' in panel and f'data-kv-budget="{BUDGET}"' in panel
    assert all(frames and frames[-1]["new_tokens"] >= 1 for frames in live.values())
    assert s.max_batch == 2


@pytest.mark.slow
def test_the_panel_counts_the_shared_batch_and_its_bytes_as_the_batch_cache_does(eng):
    s = Scheduler(eng, kv_budget_bytes=BUDGET)
    shared = SharedEngine(eng, scheduler=s, start=False)
    a, b = (shared.stream([{"role": "user", "content": q}], spec=SPEC, max_new_tokens=N) for q in QS)
    for _ in range(3):
        s.step()
    for x in (a, b):
        x._refresh()
        sh = x.stats["shared"]
        assert (sh["batch"], sh["running"], sh["waiting"]) == (2, 2, 0)
        # every row has fed all its tokens but the last: the batch cache's own count of its tokens' bytes
        assert sh["kv_used"] == s.batches[str(x.job.spec)].cache.nbytes(used=True)
        # what the budget counts: every byte the batch cache's tensors hold
        assert sh["kv_held"] == s.batches[str(x.job.spec)].cache.nbytes() == s.held_bytes()
        assert f'data-kv-held="{sh["kv_held"]}"' in stats.stats_html(x.stats)
        assert 'data-batch="2"' in stats.stats_html(x.stats)
    a.stop()
    s.step()
    b._refresh()
    assert b.stats["shared"]["batch"] == 1 and b.stats["shared"]["batch_max"] == 2


@pytest.mark.slow
def test_a_turn_too_large_for_the_budget_is_an_error_line_and_the_next_turn_answers(eng, alone):
    probe = Scheduler(eng).submit([{"role": "user", "content": QS[0]}], spec=SPEC, max_new_tokens=N)
    shared = SharedEngine(eng, kv_budget_bytes=probe.need)
    sess = Session()
    chat.add_turn(sess, QS[0], INFO, Limits())
    value = list(chat.respond(sess, shared, INFO, SPEC, chat.GenParams(max_new_tokens=N * 50)))[-1][0]
    assert "budget" in value[-1]["content"] and sess.turns[-1].error
    chat.add_turn(sess, QS[0], INFO, Limits())
    list(chat.respond(sess, shared, INFO, SPEC, chat.GenParams(max_new_tokens=N)))
    assert sess.turns[-1].text == alone[0].text[0]
    shared.close()


def test_the_shared_flag_wraps_only_a_real_engine_and_a_new_model_stops_the_old_scheduler():
    from mmkv.ui.fake import FakeEngine

    args = parse_args(["--shared", "--kv-budget-gb", "2", "--prefill-chunk", "0"])
    assert args.shared and args.kv_budget_gb == 2 and args.prefill_chunk == 0
    host = make_host(args)
    host.load("fake")
    assert isinstance(host.engine, FakeEngine)  # the stand-in engine has no scheduler: one answer at a time
    assert not parse_args([]).shared and parse_args([]).prefill_chunk == DEFAULT_CHUNK
    with pytest.raises(SystemExit):
        parse_args(["--shared", "--kv-budget-gb", "0"])

    closed = []

    class Stub(SharedEngine):  # a SharedEngine without a model: records its closing
        def __init__(self, *a, **kw):
            self.engine = object()

        def close(self, reason=""):
            closed.append(self)

    import mmkv.ui.shared as mod

    loaded = []
    real = mod.SharedEngine
    mod.SharedEngine = Stub
    try:
        from mmkv.engine import Engine

        fake_engine = Engine.__new__(Engine)  # an Engine instance, never used to generate here
        load = shared_loader(lambda name: (fake_engine, {"name": name}, None))
        loaded.append(load("a"))
        loaded.append(load("b"))
    finally:
        mod.SharedEngine = real
    assert isinstance(loaded[0][0], Stub) and loaded[1][1] == {"name": "b", "shared": True}
    assert closed == [loaded[0][0]]
