"""LLaVA-OneVision through mmkv (issue 30), on a tiny random-weight checkpoint of the real architecture written to a
folder laid out as the hub's (``tiny_vlms.llava_onevision``) and loaded as a hub id would be, with OneVision's own
processor class minus its torchvision video processor (``mmkv/models/onevision.py``): every image and video feature
routed to the visual methods (counts equal the model's own), the fp16 cache token-equal to the model's own generate
on a two-image and a video prompt, a second turn equal to a fresh run, and every method end to end: each text
method (KIVI, XQuant, AlignedKV, SKVQ, AQUA-KV with calibrated artifacts) beside CalibQuant on the image and video
features, and KIVI on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_vlms import METHOD_CASES, llava_onevision, method_artifacts, with_artifact

import mmkv
from mmkv.models.inputs import prepare_inputs

pytestmark = pytest.mark.slow
FRAMES = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_load_info):
    from mmkv.models.smollm2 import ensure_tokenizer

    return llava_onevision(tmp_path_factory.mktemp("onevision") / "tiny", ensure_tokenizer())


@pytest.fixture(scope="module")
def tiny(folder):
    return mmkv.load_model(str(folder), device="cpu")


def _img(seed, h, w):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _chat(*images, text="Compare them."):
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


def _video_chat(video_path, text="What happens?"):
    return [{"role": "user", "content": [{"type": "video", "path": str(video_path)}, {"type": "text", "text": text}]}]


def _generate(model, prep, n):
    with torch.inference_mode():
        out = model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_kwargs,
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, prep.input_ids.shape[1]:]


def test_every_image_and_video_feature_is_visual(tiny, video_path):
    model, processor, adapter = tiny
    assert adapter.family == "llava_onevision" and adapter.takes_images and adapter.takes_video
    assert type(processor).__name__ == "LlavaOnevisionProcessorNoTorchvision"
    assert adapter.visual_token_ids == (processor.image_token_id, processor.video_token_id)
    # one image: anyres. 40x70 -> grid 64x128 (1x2 crops of 4x4 patches = 4 rows x 8 columns; the aspect 70:40
    # unpads nothing here) + a newline feature per row + the 16 base features = 32 + 4 + 16
    prep = prepare_inputs(adapter, _chat(_img(0, 40, 70)), processor)
    assert int(prep.visual_mask.sum()) == 52
    # two images in one prompt: OneVision's multi-image layout, each its 16 base features and one newline
    prep = prepare_inputs(adapter, _chat(_img(0, 40, 70), _img(1, 64, 64)), processor)
    assert int(prep.visual_mask.sum()) == 2 * (16 + 1)
    kw = prep.model_kwargs
    with torch.inference_mode():
        feats = model.model.get_image_features(kw["pixel_values"], kw["image_sizes"],
                                               batch_num_images=kw["batch_num_images"]).pooler_output
    assert sum(f.shape[0] for f in feats) == 34  # the model's own count
    # a video: every frame's 4x4 patches pooled 2x2, then one newline feature
    prep = prepare_inputs(adapter, _video_chat(video_path), processor, video_frames=FRAMES)
    assert prep.model_kwargs["pixel_values_videos"].shape[:2] == (1, FRAMES)
    assert int((prep.input_ids == processor.video_token_id).sum()) == int(prep.visual_mask.sum()) == FRAMES * 4 + 1


@pytest.mark.parametrize("prompt", ["images", "video"])
def test_fp16_cache_is_token_equal_to_the_models_own_generate(tiny, prompt, video_path):
    model, processor, adapter = tiny
    msgs = _chat(_img(0, 40, 70), _img(1, 64, 64)) if prompt == "images" else _video_chat(video_path)
    out = mmkv.Engine(tiny).generate(msgs, spec="fp16", max_new_tokens=8, video_frames=FRAMES)
    prep = prepare_inputs(adapter, msgs, processor, video_frames=FRAMES)
    assert torch.equal(out.tokens[0], _generate(model, prep, 8))
    assert out.stats["cache_tokens"]["visual"] == out.stats["prompt_tokens"]["visual"] == int(prep.visual_mask.sum())


def test_second_turn_equals_a_fresh_run_of_the_same_history(tiny):
    eng = mmkv.Engine(tiny)
    images = (_img(2, 40, 70), _img(3, 64, 64))
    first = eng.generate(_chat(*images), spec="fp16", max_new_tokens=4)
    history = _chat(*images) + [{"role": "assistant", "content": first.text[0]}, {"role": "user", "content": "Why?"}]
    second = eng.generate(history, spec="fp16", max_new_tokens=6, past=first)
    fresh = eng.generate(history, spec="fp16", max_new_tokens=6)
    assert torch.equal(second.tokens, fresh.tokens)


@pytest.fixture(scope="module")
def artifacts(tiny, folder, tmp_path_factory):
    return method_artifacts(tiny, folder, tmp_path_factory.mktemp("artifacts"))


@pytest.mark.parametrize("visual,text", METHOD_CASES)
def test_every_method_runs_on_images_and_video(tiny, artifacts, video_path, visual, text):
    text = with_artifact(text, artifacts)
    msgs = [{"role": "user", "content": [{"type": "video", "path": str(video_path)},
                                         {"type": "image", "image": _img(4, 40, 70)},
                                         {"type": "text", "text": "Say what happens and what the picture shows. " * 10}]}]
    out = mmkv.Engine(tiny).generate(msgs, spec=f"visual={visual} text={text} window=8 sinks=2",
                                     max_new_tokens=4, video_frames=FRAMES)
    assert out.tokens.shape == (1, 4)
    n_visual = out.stats["prompt_tokens"]["visual"]
    assert n_visual == 52 + FRAMES * 4 + 1  # one image (anyres, as alone) and the video
    assert out.stats["cache_tokens"]["visual"] == n_visual
    assert out.stats["cache_tokens"]["text"] > 0
    ad = tiny.adapter
    assert out.stats["cache_bytes_used"]["visual"] < n_visual * 2 * ad.num_layers * ad.num_kv_heads * ad.head_dim * 2 / 3
