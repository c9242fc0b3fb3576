"""``mmkv-serve`` on the continuous-batching scheduler with SmolLM2: concurrent clients share one batch and get
the answers they get alone; the KV budget refuses what it can never hold; a client that stops frees its rows."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from mmkv.batching import Scheduler
from mmkv.serve import create_app

SPEC = "text=xquant:kq=15,km=10,vm=10,group=16 window=8 sinks=4"


@pytest.fixture(scope="module")
def eng(smollm2):
    import mmkv

    return mmkv.Engine(smollm2)


def _body(q, **kw):
    return {"messages": [{"role": "user", "content": q}], "max_tokens": 6, "temperature": 0,
            "mmkv": {"spec": SPEC}, **kw}


@pytest.mark.slow
def test_three_concurrent_clients_are_served_in_one_batch_with_their_alone_answers(eng):
    s = Scheduler(eng)
    c = TestClient(create_app(eng, "smollm2-135m", scheduler=s))
    qs = ["Name a primary colour.", "Write one line about the sea.", "What is two plus two?"]
    want = [eng.generate([{"role": "user", "content": q}], spec=SPEC, max_new_tokens=6).text[0] for q in qs]
    got = {}

    def call(i):
        got[i] = c.post("/v1/chat/completions", json=_body(qs[i])).json()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for _ in range(500):  # the loop starts once all three wait, so they join one batch
        if len(s.waiting) == 3:
            break
        time.sleep(0.01)
    assert 'mmkv_requests_waiting{model="smollm2-135m"} 3' in c.get("/metrics").text
    s.start()
    for t in threads:
        t.join(timeout=120)
    for _ in range(500):  # the gauges are a snapshot the loop publishes after each step
        if s.gauges()["running"] == 0:
            break
        time.sleep(0.01)
    s.close()
    assert [got[i]["choices"][0]["message"]["content"] for i in range(3)] == want
    m = c.get("/metrics").text
    assert 'mmkv_batch_size_max{model="smollm2-135m"} 3' in m
    assert 'mmkv_requests_running{model="smollm2-135m"} 0' in m and "mmkv_kv_cache_bytes_budget" in m
    prompt = sum(got[i]["usage"]["prompt_tokens"] for i in range(3))
    assert 'mmkv_prefill_chunks_total{model="smollm2-135m"} 3' in m  # short prompts: one piece each
    assert f'mmkv_prefill_tokens_total{{model="smollm2-135m"}} {prompt}' in m
    # on the CPU no graph runs and rows are not bucketed: the second and third request merged into the first's rows
    assert 'mmkv_decode_joins_merged_total{model="smollm2-135m"} 2' in m
    assert 'mmkv_decode_graph_captures_total{model="smollm2-135m"} 0' in m
    assert 'mmkv_decode_joins_in_place_total{model="smollm2-135m"} 0' in m
    assert all(got[i]["usage"]["mmkv"]["kv_cache_bytes"] > 0 for i in range(3))


@pytest.mark.slow
def test_a_prompt_too_long_for_the_budget_is_a_400_and_a_stopped_client_frees_its_rows(eng):
    probe = Scheduler(eng).submit([{"role": "user", "content": "hi"}], spec=SPEC, max_new_tokens=6)
    c = TestClient(create_app(eng, "smollm2-135m", kv_budget_bytes=probe.need * 2))
    r = c.post("/v1/chat/completions", json=_body("hi", max_tokens=400))
    assert r.status_code == 400 and "budget" in r.json()["error"]["message"]
    assert c.post("/v1/chat/completions", json=_body("hi")).status_code == 200

    s = Scheduler(eng)
    app = create_app(eng, "smollm2-135m", scheduler=s)
    s.start()
    from mmkv.serve.protocol import parse_chat

    runner_stop = threading.Event()
    req = parse_chat(_body("Tell me a long story.", max_tokens=60), "fp16", __import__("mmkv.serve").serve.Limits())
    pieces = []

    def on_piece(p):  # the client goes away after its first piece (the app sets this event on disconnect)
        pieces.append(p)
        runner_stop.set()

    from mmkv.serve.batched import BatchRunner

    res = BatchRunner(s, eng, app.state.metrics).run(req, on_piece, runner_stop)
    s.close()
    assert res["usage"]["completion_tokens"] <= 3 and pieces
    assert s.gauges()["running"] == 0 and not s.batches


@pytest.mark.slow
def test_metrics_count_the_pieces_of_a_chunked_prompt(eng):
    c = TestClient(create_app(eng, "smollm2-135m", prefill_chunk=8))
    r = c.post("/v1/completions", json={"prompt": "The lighthouse keeper climbed the stairs at dusk, lit the lamp, "
                                        "and watched the ships pass in the fog until", "max_tokens": 3})
    n = r.json()["usage"]["prompt_tokens"]
    assert r.status_code == 200 and n > 16
    m = c.get("/metrics").text
    assert f'mmkv_prefill_chunks_total{{model="smollm2-135m"}} {-(-n // 8)}' in m
    assert f'mmkv_prefill_tokens_total{{model="smollm2-135m"}} {n}' in m
    assert 'mmkv_requests_prefilling{model="smollm2-135m"} 0' in m
    c.app.state.scheduler.close()
