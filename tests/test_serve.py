"""``mmkv-serve``'s OpenAI-compatible API (mmkv/serve/): protocol, streaming, errors and metrics with the stand-in
engine (fast), and answers of the real SmolLM2 through the API equal to ``Engine.generate``'s."""

from __future__ import annotations

import base64
import io
import json
import threading

import pytest
from fastapi.testclient import TestClient

from mmkv.serve import Limits, create_app
from mmkv.serve.app import StopScanner
from mmkv.ui.fake import FakeEngine

TEXT = "alpha beta gamma delta epsilon"


def _client(engine=None, **kw):
    return TestClient(create_app(engine or FakeEngine(text=TEXT), "fake", **kw))


def _chat(content="hi", **extra):
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **extra}


def _events(resp) -> list:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_chat_completion_returns_the_text_usage_and_cache_bytes():
    r = _client().post("/v1/chat/completions", json=_chat(max_tokens=3, mmkv={"spec": "text=kivi:bits=2"}))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "alpha beta gamma"}
    assert body["choices"][0]["finish_reason"] == "length"  # 3 tokens of 3 allowed
    u = body["usage"]
    assert u["prompt_tokens"] == 596 and u["completion_tokens"] == 3 and u["total_tokens"] == 599
    assert "text=kivi" in u["mmkv"]["spec"] and u["mmkv"]["kv_cache_bytes"] > 0  # the spec as parsed


def test_streamed_chunks_add_up_to_the_answer_and_end_with_usage_and_done():
    r = _client().post("/v1/chat/completions", json=_chat(stream=True, max_tokens=10))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = _events(r)
    assert ev[-1] == "[DONE]"
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-1])
    assert text == TEXT
    assert ev[-2]["choices"][0]["finish_reason"] == "stop" and ev[-2]["usage"]["completion_tokens"] == 5


def test_stop_strings_cut_the_answer_and_are_not_sent():
    r = _client().post("/v1/chat/completions", json=_chat(stop=[" gam"], max_tokens=10))
    assert r.json()["choices"][0]["message"]["content"] == "alpha beta"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    ev = _events(_client().post("/v1/chat/completions", json=_chat(stop="delta", stream=True)))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-1]) == "alpha beta gamma "


def test_stop_scanner_holds_back_a_possible_stop_prefix():
    s = StopScanner(["o w"])
    assert s.feed("Hel") == "H"  # "el" could begin "o w"? no, but two characters are held back
    assert s.feed("lo wo") == "ell"
    assert s.hit and s.text == "Hell"


def test_completions_endpoint_and_models_health():
    c = _client()
    r = c.post("/v1/completions", json={"model": "fake", "prompt": "Once", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "alpha beta"
    assert r.json()["object"] == "text_completion"
    assert c.get("/v1/models").json()["data"][0]["id"] == "fake"
    assert c.get("/health").json() == {"status": "ok", "model": "fake"}


def _png(size=(4, 4)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("body,status,needle", [
    ("{not json", 400, "not valid JSON"),
    ({"model": "fake", "messages": []}, 400, "non-empty list"),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "not served here"),
    (_chat(mmkv={"spec": "text=nope:bits=2"}), 400, "invalid cache spec"),
    (_chat(n=2), 400, "n=1"),
    (_chat(temperature=3), 400, "'temperature'"),
    (_chat(max_tokens=0), 400, "'max_tokens'"),
    (_chat(stop=["a", "b", "c", "d", "e"]), 400, "'stop'"),
    (_chat([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]), 400, "not fetched"),
    (_chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]), 400, "invalid base64"),
    (_chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]), 400, "unreadable"),
    (_chat([{"type": "image_url", "image_url": {"url": "/etc/hostname"}}]), 400, "--allowed-media-dir"),
    (_chat([{"type": "audio", "audio": "x"}]), 400, "unsupported content part"),
])
def test_bad_requests_get_an_openai_error_object_and_the_server_keeps_serving(body, status, needle):
    c = _client()
    r = c.post("/v1/chat/completions", content=body if isinstance(body, str) else json.dumps(body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] in ("invalid_request_error", "model_not_found")
    assert c.post("/v1/chat/completions", json=_chat(max_tokens=1)).status_code == 200


def test_media_limits_and_allowed_folder(tmp_path):
    c = _client(limits=Limits(max_media_bytes=100, allowed_media_dir=tmp_path))
    big = _chat([{"type": "image_url", "image_url": {"url": _png((64, 64))}}])
    assert c.post("/v1/chat/completions", json=big).status_code == 413
    inside = tmp_path / "a.png"
    inside.write_bytes(b"x" * 10)
    assert c.post("/v1/chat/completions", json=_chat([{"type": "image_url", "image_url": {"url": str(inside)}}])
                  ).status_code == 200  # the path passes; the engine reads it
    outside = _chat([{"type": "image_url", "image_url": {"url": str(tmp_path.parent)}}])
    assert c.post("/v1/chat/completions", json=outside).status_code == 403
    ok = _client().post("/v1/chat/completions", json=_chat([{"type": "text", "text": "what?"},
                                                            {"type": "image_url", "image_url": {"url": _png()}}]))
    assert ok.status_code == 200


def test_requests_run_one_at_a_time_in_order_and_metrics_count_them():
    eng = FakeEngine(delay=0.01, text=TEXT)
    c = _client(eng)
    results = []

    def call(i):
        results.append((i, c.post("/v1/chat/completions", json=_chat(f"q{i}", max_tokens=5)).status_code))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s for _, s in results) == [200, 200, 200] and len(eng.calls) == 3
    c.post("/v1/chat/completions", content="{bad")
    m = c.get("/metrics").text
    assert 'mmkv_requests_total{model="fake",endpoint="/v1/chat/completions",status="200"} 3' in m
    assert 'mmkv_requests_total{model="fake",endpoint="/v1/chat/completions",status="400"} 1' in m
    assert 'mmkv_requests_running{model="fake"} 0' in m and 'mmkv_requests_waiting{model="fake"} 0' in m
    assert 'mmkv_generation_tokens_total{model="fake"} 15' in m
    assert 'mmkv_time_to_first_token_seconds_count{model="fake"} 3' in m


@pytest.mark.slow
def test_smollm2_answers_through_the_api_equal_engine_generate(smollm2):
    import mmkv

    eng = mmkv.Engine(smollm2)
    c = TestClient(create_app(eng, "smollm2-135m"))
    msgs = [{"role": "user", "content": "Name a primary colour."}]
    want = eng.generate(msgs, spec="text=kivi:bits=2", max_new_tokens=12)
    body = {"messages": msgs, "max_tokens": 12, "temperature": 0, "mmkv": {"spec": "text=kivi:bits=2"}}
    r = c.post("/v1/chat/completions", json=body).json()
    assert r["choices"][0]["message"]["content"] == want.text[0]
    assert r["usage"]["completion_tokens"] == want.tokens.shape[1]
    assert r["usage"]["prompt_tokens"] == sum(want.stats["prompt_tokens"].values())
    ev = _events(c.post("/v1/chat/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-1]) == want.text[0]
    # completions continue the raw prompt (no chat template)
    ids = eng.tokenizer("The capital of France is", return_tensors="pt").input_ids
    raw = eng.generate(ids, max_new_tokens=5)
    r2 = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
    assert r2.json()["choices"][0]["text"] == raw.text[0]


def test_server_and_load_generator_end_to_end(tmp_path):
    """A real uvicorn server (stand-in engine) on a free loopback port, and ``mmkv-bench load`` against it."""
    import socket
    import time

    import uvicorn

    from eval.bench.load import main as load_main

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(FakeEngine(delay=0.002, text=TEXT), "fake"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.02)
        out, plot = tmp_path / "load.json", tmp_path / "load.svg"
        rc = []  # in its own thread: asyncio.run needs a thread without a running event loop (an earlier test's)
        t = threading.Thread(target=lambda: rc.append(load_main([
            "--url", f"http://127.0.0.1:{port}", "--rates", "20,50", "--requests", "6", "--max-tokens", "4",
            "--out", str(out), "--plot", str(plot)])))
        t.start()
        t.join(timeout=120)
        assert rc == [0]
    finally:
        server.should_exit = True
        th.join(timeout=10)
    rows = json.loads(out.read_text())["rows"]
    assert [r["rate"] for r in rows] == [20.0, 50.0]
    for r in rows:
        assert r["sent"] == r["completed"] == 6 and r["failed"] == 0, r
        assert r["output_tokens"] == 6 * 4 and r["max_concurrent"] >= 1
        assert r["ttft_p50_s"] > 0 and r["tpot_p99_s"] >= r["tpot_p50_s"] > 0
    assert plot.read_text().startswith("<svg")


def test_load_generator_refuses_remote_servers():
    from eval.bench.load import main as load_main

    with pytest.raises(SystemExit, match="this machine"):
        load_main(["--url", "http://example.com:8000", "--rates", "1"])


def test_a_failing_generation_is_an_openai_500_and_the_next_request_works():
    eng = FakeEngine(text=TEXT)
    c = _client(eng)
    eng.fail = RuntimeError("out of memory (simulated)")
    r = c.post("/v1/chat/completions", json=_chat(max_tokens=2))
    assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"
    eng.fail_at = 1  # fails mid-stream: the stream ends with an error event, then [DONE]
    ev = _events(c.post("/v1/chat/completions", json=_chat(max_tokens=4, stream=True)))
    assert "error" in ev[-2] and ev[-1] == "[DONE]"
    eng.fail_at = None
    assert c.post("/v1/chat/completions", json=_chat(max_tokens=2)).status_code == 200
