"""UI handlers with a fake engine: no model, no browser, fast."""

from __future__ import annotations

import threading

import pytest
from PIL import Image

from mmkv.ui import chat, stats
from mmkv.ui.compare import FP16_ONLY, QUANT_ONLY, agreement, diff_pieces, words
from mmkv.ui.fake import FakeEngine, fake_loader
from mmkv.ui.models import ModelHost, badge_html
from mmkv.ui.session import Session
from mmkv.ui.uploads import Limits

VLM = {"name": "fake-vlm", "family": "llava", "synthetic": "random vision tower", "takes_images": True,
       "takes_video": True}
TEXT = {"name": "fake", "family": "text", "synthetic": None, "takes_images": False, "takes_video": False}
P = chat.GenParams(max_new_tokens=8)


def drain(gen):
    frames = list(gen)
    return frames[-1] if frames else None


@pytest.fixture
def png(tmp_path):
    p = tmp_path / "ok.png"
    Image.new("RGB", (32, 24), "red").save(p)
    return str(p)


def test_text_turn_streams_and_records_stats():
    s, eng = Session(), FakeEngine()
    chat_value, ok = chat.add_turn(s, {"text": "hello", "files": []}, TEXT, Limits())
    assert ok and chat_value == [{"role": "user", "content": "hello"}]
    steps = list(chat.respond(s, eng, TEXT, "fp16", P))
    assert len(steps) == 9  # one per piece, plus the final frame
    texts = [step[0][-1]["content"] for step in steps]
    assert texts[0] == "the" and texts[-1].startswith("the cache keeps")
    assert s.last_stats["new_tokens"] == 8 and s.stream is None
    assert eng.calls[0]["inputs"] == [{"role": "user", "content": "hello"}]
    assert eng.calls[0]["do_sample"] is False and eng.calls[0]["max_new_tokens"] == 8


def test_images_go_to_engine_as_parts(png):
    s, eng = Session(), FakeEngine()
    _, ok = chat.add_turn(s, {"text": "what?", "files": [png, {"path": png}]}, VLM, Limits())
    assert ok and s.uploads == {png}
    drain(chat.respond(s, eng, VLM, "visual=calibquant:bits=1", P))
    parts = eng.calls[0]["inputs"][0]["content"]
    assert [p["type"] for p in parts] == ["image", "image", "text"]


@pytest.mark.parametrize("message, needle", [
    ({"text": "   ", "files": []}, "empty"),
    ({"text": "hi", "files": ["/nope/missing.png"]}, "missing"),
])
def test_bad_messages_show_reason(message, needle):
    s = Session()
    value, ok = chat.add_turn(s, message, VLM, Limits())
    assert not ok and needle in value[-1]["content"] and "Error" in value[-1]["content"]
    assert not chat.pending(s)
    assert chat.to_messages(s.turns, True) == []


def test_corrupt_image_then_next_message_answers(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    s, eng = Session(), FakeEngine()
    value, ok = chat.add_turn(s, {"text": "look", "files": [str(bad)]}, VLM, Limits())
    assert not ok and "not a readable image" in value[-1]["content"]
    _, ok = chat.add_turn(s, {"text": "hello again", "files": []}, VLM, Limits())
    assert ok
    drain(chat.respond(s, eng, VLM, "fp16", P))
    assert eng.calls[0]["inputs"] == [{"role": "user", "content": [{"type": "text", "text": "hello again"}]}]
    assert s.turns[-1].text.startswith("the")


def test_unsupported_type_and_text_only_model(tmp_path, png):
    doc = tmp_path / "notes.pdf"
    doc.write_bytes(b"%PDF-1.4")
    s = Session()
    value, _ = chat.add_turn(s, {"text": "x", "files": [str(doc)]}, VLM, Limits())
    assert "unsupported file type .pdf" in value[-1]["content"]
    value, _ = chat.add_turn(s, {"text": "x", "files": [png]}, TEXT, Limits())
    assert "text only" in value[-1]["content"]


def test_oversized_upload(tmp_path):
    big = tmp_path / "big.png"
    Image.new("RGB", (800, 800)).save(big)
    s = Session()
    value, ok = chat.add_turn(s, {"text": "x", "files": [str(big)]}, VLM, Limits(max_upload_mb=0.0001))
    assert not ok and "--max-upload-mb" in value[-1]["content"]


def test_failure_shows_error_and_app_keeps_answering():
    s, eng = Session(), FakeEngine()
    chat.add_turn(s, "first", TEXT, Limits())
    eng.fail = ValueError("image is unreadable")
    value = drain(chat.respond(s, eng, TEXT, "fp16", P))[0]
    assert "image is unreadable" in value[-1]["content"]
    chat.add_turn(s, "second", TEXT, Limits())
    drain(chat.respond(s, eng, TEXT, "fp16", P))
    assert eng.calls[-1]["inputs"] == [{"role": "user", "content": "second"}]  # the failed turn is not resent
    assert not s.turns[-1].error


def test_out_of_memory_message():
    import torch

    s, eng = Session(), FakeEngine()
    chat.add_turn(s, "q", TEXT, Limits())
    eng.fail = torch.OutOfMemoryError("CUDA out of memory")
    value = drain(chat.respond(s, eng, TEXT, "fp16", P))[0]
    assert "Out of memory" in value[-1]["content"]


def test_mid_stream_failure_keeps_partial_text():
    s, eng = Session(), FakeEngine()
    eng.fail_at = 3
    chat.add_turn(s, "q", TEXT, Limits())
    value = drain(chat.respond(s, eng, TEXT, "fp16", P))[0]
    assert "fake failure" in value[-1]["content"] and "the cache keeps" in value[-1]["content"]


def test_stop_really_stops():
    s, eng = Session(), FakeEngine(delay=0.01)
    chat.add_turn(s, "q", TEXT, Limits())
    gen = chat.respond(s, eng, TEXT, "fp16", chat.GenParams(max_new_tokens=50))
    next(gen)
    next(gen)
    chat.stop(s)
    drain(gen)
    assert s.last_output.stats["new_tokens"] == 2


def test_stop_from_another_thread():
    s, eng = Session(), FakeEngine(delay=0.02)
    chat.add_turn(s, "q", TEXT, Limits())
    threading.Timer(0.1, chat.stop, args=(s,)).start()
    drain(chat.respond(s, eng, TEXT, "fp16", chat.GenParams(max_new_tokens=1000)))
    assert 0 < s.last_output.stats["new_tokens"] < 20


def test_regenerate_and_clear():
    s, eng = Session(), FakeEngine()
    chat.add_turn(s, "q", TEXT, Limits())
    drain(chat.respond(s, eng, TEXT, "fp16", P))
    value, pending = chat.regenerate(s)
    assert pending and value == [{"role": "user", "content": "q"}]
    drain(chat.respond(s, eng, TEXT, "visual=calibquant:bits=1", P))
    assert len(s.turns) == 2 and eng.calls[-1]["spec"] == "visual=calibquant:bits=1"
    assert chat.clear(s) == [] and s.turns == [] and s.last_stats is None


def test_compare_runs_fp16_first_then_spec_and_diffs():
    s, eng = Session(), FakeEngine()
    chat.add_turn(s, "q", TEXT, Limits())
    main, side, diff = drain(chat.respond(s, eng, TEXT, "visual=calibquant:bits=1", P, compare=True))
    assert [c["spec"] for c in eng.calls] == ["fp16", "visual=calibquant:bits=1"]
    assert side[-1]["content"].startswith("the cache") and main[-1]["content"] != side[-1]["content"]
    assert any(label == QUANT_ONLY for _, label in diff)
    assert s.fp16_stats is not None and s.last_stats is not None
    mem, speed = stats.compare_frames(s.last_stats, s.fp16_stats)
    assert list(mem["run"]) == ["fp16 cache", "quantized"] and list(speed["run"]) == ["fp16 cache", "quantized"]


def test_sampling_params_and_seed():
    kw = chat.GenParams(16, 0.7, 0.9, 5, 4, 2.0).engine_kwargs()
    assert kw == {"max_new_tokens": 16, "do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": 5,
                  "video_frames": 4, "video_fps": 2.0}
    assert chat.GenParams(seed=-1).engine_kwargs()["seed"] is None


def test_diff_pieces():
    pairs = diff_pieces(words("the cat sat"), words("the dog sat"))
    assert pairs == [("the", None), (" cat", FP16_ONLY), (" dog", QUANT_ONLY), (" sat", None)]
    assert agreement(diff_pieces(words("a b"), words("a b"))) == 1.0


def test_stats_html_and_frames():
    s, eng = Session(), FakeEngine()
    chat.add_turn(s, "q", VLM, Limits())
    drain(chat.respond(s, eng, VLM, "visual=calibquant:bits=1", P))
    html = stats.stats_html(s.last_stats)
    assert 'id="stat-cache-bytes"' in html and f'data-bytes="{stats.total_cache_bytes(s.last_stats, used=True)}"' in html
    tps, mib = stats.timeline_frames(s.last_stats)
    assert len(tps) == 7 and len(mib) == 7  # the prefill token is left out
    assert "No answer yet" in stats.stats_html(None)


def test_timer_reads_live_stream():
    s, eng = Session(), FakeEngine()
    chat.add_turn(s, "q", TEXT, Limits())
    gen = chat.respond(s, eng, TEXT, "fp16", P)
    next(gen)
    live, is_live, _ = stats.current(s)
    assert is_live and live["new_tokens"] == 1
    drain(gen)
    shown, is_live, _ = stats.current(s)
    assert not is_live and shown["new_tokens"] == 8


def test_model_host_keeps_previous_model_on_failure():
    def loader(name):
        if name == "broken":
            raise ValueError("unknown model 'broken'")
        return fake_loader(name)

    host = ModelHost(loader=loader)
    host.load("fake-vlm")
    with pytest.raises(ValueError):
        host.load("broken")
    assert host.info["name"] == "fake-vlm" and "broken" in host.error
    assert "synthetic-badge" in badge_html(host.info) and "random weights" in badge_html(host.info)
    assert "mmkv-error" in badge_html(None, host.error)
