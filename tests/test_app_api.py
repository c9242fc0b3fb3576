"""The named API (issue 32, item 3) on the fake engine: exactly four endpoints with named, typed parameters, JSON
results, and errors a client can read. The same calls against the real app:
tests/browser/test_app_browser.py::test_readme_client_example."""

from __future__ import annotations

import json

import gradio as gr
import pytest

from mmkv.ui.blocks import build_app
from mmkv.ui.fake import fake_loader
from mmkv.ui.models import ModelHost


@pytest.fixture()
def app():
    host = ModelHost(fake_loader)
    host.load("fake-vlm")
    return host, build_app(host)


def endpoint(demo, name):
    return next(f.fn for f in demo.fns.values() if f.api_name == name)


def test_only_the_named_endpoints_are_public(app):
    info = app[1].get_api_info()
    assert sorted(info["named_endpoints"]) == ["/chat", "/compare", "/load_model", "/methods"]
    assert not info.get("unnamed_endpoints")
    chat = {p["parameter_name"]: p for p in info["named_endpoints"]["/chat"]["parameters"]}
    assert list(chat)[:3] == ["messages", "spec", "max_new_tokens"]
    assert chat["max_new_tokens"]["type"] == {"type": "integer"} and chat["max_new_tokens"]["parameter_default"] == 64
    assert chat["spec"]["parameter_default"] == "visual=calibquant:bits=1 text=kivi:bits=2 window=128 sinks=4"


def test_chat_and_compare_return_json(app, cat_image_path):
    host, demo = app
    msgs = [{"role": "user", "content": [{"type": "image", "image": {"path": str(cat_image_path)}},
                                         {"type": "text", "text": "What is it?"}]}]
    out = endpoint(demo, "chat")(msgs, "visual=calibquant:bits=1", 5)
    json.dumps(out)
    assert out["model"] == "fake-vlm" and len(out["text"].split()) == 5
    assert out["stats"]["cache_bytes_used"]["visual"] > 0
    sent = host.engine.calls[-1]["inputs"][0]["content"]
    assert sent[0] == {"type": "image", "image": str(cat_image_path)} and sent[-1]["text"] == "What is it?"
    cmp = endpoint(demo, "compare")("Hello?", "visual=calibquant:bits=1", 6)
    json.dumps(cmp)
    assert [c["spec"] for c in host.engine.calls[-2:]] == ["fp16", "visual=calibquant:bits=1"]
    assert {d["only"] for d in cmp["diff"]} >= {None, "quantized"} and 0 < cmp["agreement"] < 1


def test_api_errors_name_the_problem(app, tmp_path):
    _, demo = app
    chat = endpoint(demo, "chat")
    with pytest.raises(gr.Error, match="Invalid cache spec"):
        chat("hi", "visual=calibquant:bits=3")
    secret = tmp_path / "x.png"
    secret.write_bytes(b"")
    with pytest.raises(gr.Error, match="handle_file"):  # a server path outside the uploads is never read
        chat([{"role": "user", "content": [{"type": "image", "image": str(secret)}]}])
    with pytest.raises(gr.Error, match="Could not load"):
        endpoint(demo, "load_model")("")
    assert [m["name"] for m in endpoint(demo, "methods")()][:1] == ["fp16"]
