"""The README's ``gradio_client`` example (issue 32, item 3), run as written against the real app (the browser
tests' server, default model SmolLM2), then checked; only the address is replaced."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Call the app from a script", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_client_example(app_url, monkeypatch):
    pytest.importorskip("gradio_client")
    code = readme_example()
    assert 'Client("http://127.0.0.1:7860/")' in code
    monkeypatch.chdir(ROOT)  # the example names assets/ relative to a checkout
    ns: dict = {}
    exec(compile(code.replace("http://127.0.0.1:7860/", app_url), "README.md", "exec"), ns)  # noqa: S102
    assert ns["model"]["name"] == "smollm2-135m" and not ns["model"]["takes_images"]
    assert {"calibquant", "kivi", "xquant"} <= set(ns["names"])
    out, cmp, seen = ns["out"], ns["cmp"], ns["seen"]
    assert out["model"] == "smollm2-135m" and out["text"].strip()
    assert out["stats"]["new_tokens"] <= 16 and out["stats"]["cache_dtype"] in ("fp32", "fp16", "bf16")
    assert cmp["fp16"]["text"].strip() and cmp["quantized"]["text"].strip()
    mine = "".join(d["text"] for d in cmp["diff"] if d["only"] != "fp16")
    assert mine.strip() == cmp["quantized"]["text"].strip()
    assert seen["model"] == "demo-llava" and seen["stats"]["prompt_tokens"]["visual"] == 576
