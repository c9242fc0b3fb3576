"""``mmkv-bench cpu`` (eval/bench/cpu.py): both sides timed on the same prompt; ``--prompts app`` is the app's
first example through the chat template, with the app's default spec unless one is given (issue 34)."""

from __future__ import annotations

import pytest

from eval.bench import cpu


def test_app_prompts_default_to_the_apps_spec_and_fp16(monkeypatch):
    from mmkv.ui.spec_controls import default_spec

    seen = {}

    def fake_run(name, lengths, specs, new_tokens, repeats):
        seen.update(lengths=lengths, specs=specs)
        return []

    monkeypatch.setattr(cpu, "run", fake_run)
    assert cpu.main(["--prompts", "app", "--repeats", "1"]) == 0
    assert seen == {"lengths": ["app"], "specs": [default_spec(), "fp16"]}
    assert cpu.main(["--prompts", "app,256", "--spec", "text=kivi:bits=2"]) == 0
    assert seen == {"lengths": ["app", 256], "specs": ["text=kivi:bits=2"]}


@pytest.mark.slow
def test_app_prompt_is_the_apps_first_example_and_both_sides_run(smollm2, monkeypatch):
    import mmkv.models
    from mmkv.ui.examples import PASSAGE

    ids = cpu.app_prompt(smollm2)
    text = smollm2.processor.decode(ids[0])  # a text model's processor is its tokenizer
    assert ids.shape[0] == 1 and ids.shape[1] > 250  # the passage leaves the 128-token window (examples.py)
    assert PASSAGE[:60] in text and "user" in text
    monkeypatch.setattr(mmkv.models, "load_model", lambda name, device=None: smollm2)
    rows = cpu.run("smollm2-135m", ["app"], ["fp16"], new_tokens=3, repeats=1)
    assert [r["path"] for r in rows] == ["transformers", "fp16"]
    assert all(r["prompt_tokens"] == "app" and r["decode_tokens_per_s"] > 0 and r["prefill_ms"] > 0 for r in rows)


@pytest.mark.slow
def test_image_prompt_is_the_apps_first_image_example_and_both_sides_run(demo_llava, monkeypatch):
    """``--prompts image`` on a VLM: the app's first example with one image (its 576 visual tokens go to both
    sides), transformers' generate and mmkv's engine each decode it."""
    import mmkv.models

    msgs, prep = cpu.image_prompt(demo_llava)
    assert int(prep.visual_mask.sum()) == 576 and msgs[0]["content"][0]["type"] == "image"
    monkeypatch.setattr(mmkv.models, "load_model", lambda name, device=None: demo_llava)
    rows = cpu.run("demo-llava", ["image"], ["visual=calibquant:bits=1"], new_tokens=3, repeats=1)
    assert [r["path"] for r in rows] == ["transformers", "visual=calibquant:bits=1"]
    assert all(r["prompt_tokens"] == "image" and r["decode_tokens_per_s"] > 0 for r in rows)


def test_both_sides_count_the_same_steps():
    """mmkv's decode rate is n - 1 steps over the time from its first new token to its last, as transformers'
    side counts them from its streamer (an earlier version counted n - 1 steps over n - 2 step times)."""
    import torch

    class Out:
        tokens = torch.zeros(1, 5, dtype=torch.long)
        stats = {"prefill_ms": 100.0, "timeline": [{"t_s": t} for t in (0.002, 0.102, 0.202, 0.302, 0.402)]}

    class Eng:
        def generate(self, *a, **kw):
            return Out()

    r = cpu.mmkv_run(Eng(), None, "fp16", 5)
    assert r["new_tokens"] == 5 and r["decode_tokens_per_s"] == pytest.approx(4 / 0.4)
