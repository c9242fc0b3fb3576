"""LLaVA-NeXT through mmkv (issue 30), on a tiny random-weight checkpoint of the real architecture written to a folder
with its own processor (``tiny_vlms.llava_next``) and loaded as a hub id would be: every image feature (anyres crops,
the base image and the image-newline features, all at ``<image>`` positions) routed to the visual methods, the fp16
cache token-equal to the model's own generate, a second turn equal to a fresh run of the history, and every method
end to end: each text method (KIVI, XQuant, AlignedKV, SKVQ, AQUA-KV with calibrated artifacts) beside CalibQuant
on the image features, and KIVI on the image features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_vlms import METHOD_CASES, image_chat, llava_next, method_artifacts, with_artifact

import mmkv
from mmkv.models.inputs import prepare_inputs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_load_info):
    from mmkv.models.smollm2 import ensure_tokenizer

    return llava_next(tmp_path_factory.mktemp("llava_next") / "tiny", ensure_tokenizer())


@pytest.fixture(scope="module")
def tiny(folder):
    return mmkv.load_model(str(folder), device="cpu")


def _chat(*images, text="What is shown?"):
    return image_chat(*images, text=text)


IMG = Image.fromarray((np.random.RandomState(0).rand(40, 70, 3) * 255).astype("uint8"))
SQUARE = Image.fromarray((np.random.RandomState(1).rand(64, 64, 3) * 255).astype("uint8"))


def test_every_image_feature_is_visual(tiny):
    model, processor, adapter = tiny
    assert adapter.family == "llava_next" and adapter.takes_images and not adapter.takes_video
    prep = prepare_inputs(adapter, _chat(IMG, SQUARE), processor)
    # per image: 4 base features (2x2 patches, class token dropped) + the best-fit grid's crops, unpadded, with a
    # newline feature per row: 40x70 -> grid 32x64 (1x2 crops of 2x2 patches = 2 rows x 4 columns), unpadded to the
    # image's 40:70 aspect: 2 rows x 4 columns + 2 newlines = 10; 64x64 -> grid 64x64: 4 rows x 4 columns + 4 = 20
    assert int(prep.visual_mask.sum()) == (4 + 10) + (4 + 20)
    with torch.inference_mode():
        feats = model.get_image_features(pixel_values=prep.model_kwargs["pixel_values"],
                                         image_sizes=prep.model_kwargs["image_sizes"])
    feats = feats.pooler_output if hasattr(feats, "pooler_output") else feats
    assert sum(f.shape[0] for f in feats) == int(prep.visual_mask.sum())  # the model's own feature count


def test_fp16_cache_is_token_equal_to_the_models_own_generate(tiny):
    model, processor, adapter = tiny
    msgs = _chat(IMG, SQUARE)
    ours = mmkv.Engine(tiny).generate(msgs, spec="fp16", max_new_tokens=8)
    prep = prepare_inputs(adapter, msgs, processor)
    with torch.inference_mode():
        ref = model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_kwargs,
                             max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(ours.tokens[0], ref[0, prep.input_ids.shape[1]:])


def test_second_turn_equals_a_fresh_run_of_the_same_history(tiny):
    eng = mmkv.Engine(tiny)
    first = eng.generate(_chat(IMG), spec="fp16", max_new_tokens=4)
    history = _chat(IMG) + [{"role": "assistant", "content": first.text[0]}, {"role": "user", "content": "Why?"}]
    second = eng.generate(history, spec="fp16", max_new_tokens=6, past=first)
    fresh = eng.generate(history, spec="fp16", max_new_tokens=6)
    assert torch.equal(second.tokens, fresh.tokens)


@pytest.fixture(scope="module")
def artifacts(tiny, folder, tmp_path_factory):
    return method_artifacts(tiny, folder, tmp_path_factory.mktemp("artifacts"))


@pytest.mark.parametrize("visual,text", METHOD_CASES)
def test_every_method_runs_end_to_end(tiny, artifacts, visual, text):
    text = with_artifact(text, artifacts)
    # window=8 and a long question: text tokens leave the fp16 window, so the text method stores some of them
    msgs = _chat(IMG, text="Say what is shown, one line for each part of the picture, please. " * 8)
    out = mmkv.Engine(tiny).generate(msgs, spec=f"visual={visual} text={text} window=8 sinks=2", max_new_tokens=4)
    assert out.tokens.shape == (1, 4) and out.stats["cache_tokens"]["visual"] == 14
    assert out.stats["cache_tokens"]["text"] > 0
    ad = tiny.adapter
    assert out.stats["cache_bytes_used"]["visual"] < 14 * 2 * ad.num_layers * ad.num_kv_heads * ad.head_dim * 2 / 3
