"""End-to-end: the real app (SmolLM2, then demo-llava) in headless Chromium. Tests run in order on one page.

Screenshots of the main views go to a temporary folder, so a test run never touches tracked files. To refresh the
ones the README and docs/APP.md show, ask for them: ``MMKV_SCREENSHOTS=docs/img pytest tests/browser`` (a path
relative to the repository root, or absolute).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SHOTS = os.environ.get("MMKV_SCREENSHOTS")
IMG = ROOT / _SHOTS if _SHOTS else Path(tempfile.mkdtemp(prefix="mmkv-screenshots-"))
ANSWER_TIMEOUT_S = 150

pytestmark = pytest.mark.slow


def shot(page, name: str, selector: str | None = None) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    target = page.locator(selector) if selector else page
    target.screenshot(path=str(IMG / name), **({} if selector else {"full_page": True}))
    assert (IMG / name).stat().st_size > 0


def gen(page) -> int:
    return int(page.locator("#stats").get_attribute("data-gen") or 0)


def bot_texts(page, chat: str = "#chat") -> list[str]:
    return page.locator(f"{chat} [data-testid=bot]").all_inner_texts()


def send(page, text: str, files: list[str] | None = None) -> None:
    if files:
        page.locator("#msg input[type=file]").set_input_files([str(ROOT / f) for f in files])
        page.locator("#msg .thumbnail-item, #msg [data-testid=file-preview], #msg img").first.wait_for()
    box = page.locator("#msg textarea")
    box.fill(text)
    box.press("Enter")


def wait_answer(page, before: int, watch_stream: bool = False) -> list[str]:
    """Wait until the stats panel shows a finished answer newer than ``before``; return the bot texts seen."""
    seen, deadline = [], time.time() + ANSWER_TIMEOUT_S
    while time.time() < deadline:
        texts = bot_texts(page)
        if watch_stream and texts and (not seen or seen[-1] != texts[-1]):
            seen.append(texts[-1])
        if gen(page) > before and page.locator("#stats").get_attribute("data-state") == "done":
            return seen + bot_texts(page)[-1:]
        page.wait_for_timeout(100 if watch_stream else 300)
    raise AssertionError(f"no finished answer in {ANSWER_TIMEOUT_S}s; chat: {bot_texts(page)}")


def pick(page, elem_id: str, value: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=value, exact=True).click()


def cache_bytes(page, row: str | None = None) -> int:
    sel = f"#stat-mod-{row}" if row else "#stat-cache-bytes"
    return int(page.locator(sel).get_attribute("data-bytes"))


def test_first_example_headline_shows_the_saving(page):
    """Issue 32, item 2: the default first example leaves the fp16 window, and the headline compares bytes in use
    with a plain cache of the same tokens in the model's own dtype (fp32 on this CPU), reserved bytes apart."""
    page.locator("#examples button, #examples tbody tr, #examples .gallery-item").first.click()
    page.wait_for_function("() => document.querySelector('#msg textarea').value.startsWith('Read this passage')")
    before = gen(page)
    page.locator("#msg textarea").press("Enter")
    wait_answer(page, before)
    head = page.locator("#stat-cache-bytes")
    text = head.inner_text()
    assert re.search(r"in use · \d+\.\d× smaller than a plain fp32 cache of the same tokens \(.+\) · .+ reserved$",
                     text), text
    used, base = int(head.get_attribute("data-bytes")), int(head.get_attribute("data-baseline"))
    assert 0 < used < base / 1.5 and int(head.get_attribute("data-reserved")) > used
    assert "sinks + window (fp32)" in page.locator("#stats").inner_text()


# Records every text the chat's last bot message shows, as the DOM changes: polling every 100 ms missed the partial
# answers of a 6-token reply on a slow 2-core box (all six tokens rendered between two polls).
_WATCH_BOT = """() => {
    window.__botTexts = [];
    const chat = document.querySelector('#chat');
    new MutationObserver(() => {
        const bots = chat.querySelectorAll('[data-testid=bot]');
        const t = bots.length ? bots[bots.length - 1].innerText : '';
        const seen = window.__botTexts;
        if (t && seen[seen.length - 1] !== t) seen.push(t);
    }).observe(chat, {childList: true, subtree: true, characterData: true});
}"""


def test_text_message_streams_an_answer(page):
    before = gen(page)
    page.evaluate(_WATCH_BOT)
    send(page, "What is a KV cache?")
    polled = wait_answer(page, before, watch_stream=True)
    seen = page.evaluate("() => window.__botTexts") + polled
    final = seen[-1].strip()
    assert final and "Error" not in final
    partial = [s for s in seen if s.strip() and s.strip() != final and final.startswith(s.strip()[:3])]
    assert partial, f"no partial answer seen before the final one: {seen}"
    assert cache_bytes(page) > 0
    shot(page, "chat.png")


def test_text_model_page_is_quiet_and_shows_no_visual_controls(page):
    """Issue 32, item 5: a text-only model hides the visual cache controls and the image/video examples, and with
    no generation running the page sends nothing (the stats timer polls only while an answer is written)."""
    assert page.locator("#text-method").is_visible()  # the cache controls are up, only the visual ones hidden
    assert not page.locator("#visual-method").is_visible() and not page.locator("#media-examples").is_visible()
    assert not page.locator("#examples img, #examples video").count()
    sent = []
    page.on("request", lambda r: sent.append(r.url) if "/gradio_api/" in r.url else None)
    page.wait_for_timeout(2000)
    assert sent == []


def test_typed_spec_error_on_enter_and_controls_follow(page):
    """Issue 32, item 5: Enter in the spec box shows its error as an error; a valid spec sets the dropdowns."""
    spec = page.locator("#spec textarea, #spec input").first
    default = spec.input_value()
    spec.fill("text=kivi:bits=3")
    spec.press("Enter")
    page.locator("#spec-note.mmkv-error", has_text="Invalid cache spec").wait_for(timeout=10_000)
    spec.fill("text=xquant:kq=28")
    spec.press("Enter")
    page.wait_for_function("() => document.querySelector('#text-method input').value === 'xquant'", timeout=10_000)
    assert not page.locator("#spec-note.mmkv-error").is_visible()
    spec.fill(default)
    spec.press("Enter")
    page.wait_for_function("() => document.querySelector('#text-method input').value === 'kivi'", timeout=10_000)
    page.wait_for_function("v => document.querySelector('#spec textarea, #spec input').value === v", arg=default,
                           timeout=10_000)


def test_compare_mode_shows_two_answers(page):
    page.locator("#compare input").check()
    page.locator("#chat", has_text="Quantized cache (the spec)").wait_for(timeout=10_000)
    before = gen(page)
    send(page, "Name a fruit.")
    wait_answer(page, before)
    fp16, quant = bot_texts(page, "#fp16-chat"), bot_texts(page)
    assert fp16 and fp16[-1].strip() and quant[-1].strip()
    assert page.locator("#diff").is_visible()
    shot(page, "compare.png")
    page.locator("#compare input").uncheck()


def test_corrupt_image_shows_error_then_app_answers(page):
    n = len(bot_texts(page))
    send(page, "What is this?", files=["assets/corrupt.png"])
    page.locator("#chat [data-testid=bot]").nth(n).wait_for()
    page.wait_for_function("n => document.querySelectorAll('#chat [data-testid=bot]').length > n", arg=n)
    assert "not a readable image" in bot_texts(page)[-1]
    before = gen(page)
    send(page, "Say hello.")
    answer = wait_answer(page, before)[-1]
    assert answer.strip() and "Error" not in answer


def test_image_to_demo_llava(page):
    page.locator("#model-name input").fill("demo-llava")
    page.locator("#model-name input").press("Enter")
    page.locator("#load-model").click()
    page.locator('#model-status[data-model="demo-llava"]').wait_for(timeout=180_000)
    assert "random vision tower" in page.locator("#synthetic-badge").inner_text()
    page.locator("#visual-method").wait_for()  # a vision model shows the visual cache controls again
    page.locator("#clear").click()
    pick(page, "knob-visual-calibquant-bits", "4")
    page.wait_for_function("() => document.querySelector('#spec textarea, #spec input').value.includes('bits=4')")
    before = gen(page)
    send(page, "Hello! What do you see?", files=["assets/images/coffee.png"])
    answer = wait_answer(page, before)[-1]
    assert answer.strip() and "Error" not in answer
    assert cache_bytes(page, "visual") > 0
    shot(page, "vlm.png")


def test_new_page_shows_the_model_the_server_runs(page, open_page):
    """Issue 32, item 1: after one tab loaded demo-llava, a new visitor's page (its own browser context) shows
    demo-llava with its badge, not the model the page was built with."""
    other = open_page()
    other.locator('#model-status[data-model="demo-llava"]').wait_for(timeout=30_000)
    assert "random vision tower" in other.locator("#synthetic-badge").inner_text()
    assert other.locator("#model-name input").input_value() == "demo-llava"
    other.reload()
    other.locator('#model-status[data-model="demo-llava"]').wait_for(timeout=30_000)


def test_one_bit_visual_cache_is_smaller(page):
    four_bit_visual, four_bit_total = cache_bytes(page, "visual"), cache_bytes(page)
    pick(page, "knob-visual-calibquant-bits", "1")
    page.wait_for_function("() => document.querySelector('#spec textarea, #spec input').value.includes('bits=1')")
    before = gen(page)
    page.locator("#regenerate").click()
    wait_answer(page, before)
    assert cache_bytes(page, "visual") < four_bit_visual / 2
    assert cache_bytes(page) < four_bit_total
    shot(page, "stats.png", "#stats-panel")


def test_attention_lens(page):
    """The lens analyzes the last prompt (demo-llava, one image: 576 visual tokens among the prompt's tokens) at its
    defaults: 1-bit channel-wise K/V, calibration tau1 = 0, tau2 = 3 (CalibQuant's released setting), no error.
    (The range arithmetic of the lens is tested in tests/test_app_lens.py; Gradio's dataframe renders its rows
    lazily, so they are not read here.)"""
    page.get_by_role("tab", name="Attention lens").click()
    page.locator("#lens-run").click()
    page.wait_for_function("() => document.querySelector('#lens-note').innerText.includes('visual tokens')",
                           timeout=ANSWER_TIMEOUT_S * 1000)
    note = page.locator("#lens-note").inner_text()
    assert "Lens failed" not in note
    m = re.search(r"(\d+) visual tokens of (\d+), (\d+)-bit", note)
    assert m, note
    assert int(m.group(1)) == 576 and int(m.group(2)) > 576 and m.group(3) == "1"
    assert "tau1=0, tau2=3" in note
    # issue 32, item 5: every series of both plots is named in a legend a person can see, inside the window
    for legend, names in (("#lens-dist-legend", ["exact", "quantized", "calibrated"]),
                          ("#lens-err-legend", ["quantized", "quantized + calibrated"])):
        items = page.locator(f"{legend} .mmkv-legend-item")
        assert items.all_inner_texts() == names
        for i in range(items.count()):
            box = items.nth(i).bounding_box()
            assert items.nth(i).is_visible() and box["width"] > 0 and box["y"] + box["height"] <= page.viewport_size[
                "height"] + page.evaluate("window.scrollY")
    shot(page, "lens.png")


# The README's ``gradio_client`` example (issue 32, item 3), run as written against this file's server (one app start
# for both: in a file of its own it could land on the other xdist worker and start a second app, ~20 s); only the
# address is replaced. Last, as before, after the page's tests.
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
