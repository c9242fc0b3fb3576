"""Idefics3 / SmolVLM through mmkv (issue 30), on a tiny random-weight checkpoint of the real architecture written to
a folder with its own processor (``tiny_vlms.idefics3``) and loaded as a hub id would be: image tokens found
exactly (the processor's tiles x tokens per tile), mmkv's fp16 cache token-equal to the model's own generate, a
second chat turn equal to a fresh run of the same history, and every method running end to end: each text method
(KIVI, XQuant, AlignedKV, SKVQ, AQUA-KV with calibrated artifacts) beside CalibQuant on the image tokens, and KIVI
on the image tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_vlms import METHOD_CASES, idefics3, image_chat, method_artifacts, with_artifact

import mmkv
from mmkv.models.inputs import prepare_inputs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_load_info):
    from mmkv.models.smollm2 import ensure_tokenizer

    return idefics3(tmp_path_factory.mktemp("idefics3") / "tiny-idefics3", ensure_tokenizer())


@pytest.fixture(scope="module")
def tiny(folder):
    return mmkv.load_model(str(folder), device="cpu")


def _img(seed, h, w):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _chat(*images, text="Describe the pictures."):
    return image_chat(*images, text=text)


def test_loads_as_idefics3_and_finds_every_image_token(tiny):
    model, processor, adapter = tiny
    assert adapter.family == "idefics3" and adapter.takes_images and not adapter.takes_video
    assert adapter.visual_token_ids == (processor.tokenizer.convert_tokens_to_ids("<image>"),)
    prep = prepare_inputs(adapter, _chat(_img(0, 100, 150), _img(1, 64, 64)), processor)
    # tiles that hold pixels: each image's 64-px crops plus one global tile (padding tiles have an all-zero mask)
    tiles = int(prep.model_kwargs["pixel_attention_mask"].flatten(2).any(-1).sum())
    # both images are resized to a longest edge of 128 px (100x150 -> 85x128, 64x64 -> 128x128): 2x2 crops + global
    assert tiles == 5 + 5
    assert int(prep.visual_mask.sum()) == tiles * processor.image_seq_len == 40
    # separators and row/column markers around the tiles are text, not visual
    ids = prep.input_ids[0]
    fake = processor.tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    assert int((ids == fake).sum()) > 0 and not bool(prep.visual_mask[0][ids == fake].any())


def test_fp16_cache_is_token_equal_to_the_models_own_generate(tiny):
    model, processor, adapter = tiny
    msgs = _chat(_img(2, 100, 150), _img(3, 64, 64))
    ours = mmkv.Engine(tiny).generate(msgs, spec="fp16", max_new_tokens=8)
    prep = prepare_inputs(adapter, msgs, processor)
    with torch.inference_mode():
        ref = model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_kwargs,
                             max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(ours.tokens[0], ref[0, prep.input_ids.shape[1]:])
    assert ours.stats["cache_tokens"]["visual"] == 40  # the visual span is routed (kept in fp16 by this spec)
    assert ours.stats["prompt_tokens"]["visual"] == 40


def test_second_turn_equals_a_fresh_run_of_the_same_history(tiny):
    eng = mmkv.Engine(tiny)
    img = _img(4, 100, 150)
    first = eng.generate(_chat(img), spec="fp16", max_new_tokens=4)
    history = _chat(img) + [{"role": "assistant", "content": first.text[0]},
                            {"role": "user", "content": "And the colours?"}]
    second = eng.generate(history, spec="fp16", max_new_tokens=6, past=first)
    fresh = eng.generate(history, spec="fp16", max_new_tokens=6)
    assert torch.equal(second.tokens, fresh.tokens)
    assert second.next_position.tolist() == [second.fed_ids.shape[1]]


@pytest.fixture(scope="module")
def artifacts(tiny, folder, tmp_path_factory):
    return method_artifacts(tiny, folder, tmp_path_factory.mktemp("artifacts"))


@pytest.mark.parametrize("visual,text", METHOD_CASES)
def test_every_method_runs_end_to_end(tiny, artifacts, visual, text):
    text = with_artifact(text, artifacts)
    # window=8 and a long question: text tokens leave the fp16 window, so the text method stores some of them
    msgs = _chat(_img(5, 100, 150), text="Describe the picture in detail, one line for each part of it. " * 8)
    out = mmkv.Engine(tiny).generate(msgs, spec=f"visual={visual} text={text} window=8 sinks=2", max_new_tokens=4)
    assert out.tokens.shape == (1, 4)
    assert out.stats["cache_tokens"]["visual"] == 20  # 5 tiles x 4 tokens, all in the visual segment
    assert out.stats["cache_tokens"]["text"] > 0
    ad = tiny.adapter
    fp16 = 20 * 2 * ad.num_layers * ad.num_kv_heads * ad.head_dim * 2  # K and V of those tokens in fp16
    assert out.stats["cache_bytes_used"]["visual"] < fp16 / 3  # 1-2 bit codes plus fp16 scales


def test_video_is_refused_with_a_clear_message(tiny, tmp_path):
    with pytest.raises(ValueError, match="takes images, not videos"):
        mmkv.Engine(tiny).generate([{"role": "user", "content": [{"type": "video", "path": str(tmp_path / "a.mp4")},
                                                                  {"type": "text", "text": "hi"}]}])
