"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) through mmkv (issue 30), on tiny random-weight checkpoints of the real
architectures written to folders with their own processor files (``tiny_vlms.qwen_vl``) and loaded as a hub id
would be: visual tokens found exactly (the processor's and the vision tower's counts), M-RoPE positions equal to
the model's own (the fp16 cache gives the logits of the model's own DynamicCache on a multi-image and a video
prompt, and its greedy tokens), a second chat turn equal to a fresh run and to the model's own generate, every
method's spec run end to end, and AQUA-KV (pre-RoPE keys) refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_vlms import own_cache_logits, qwen_vl, skvq_artifact_for

import mmkv
from mmkv.cache import MMKVCache, cache_kwargs
from mmkv.models.inputs import prepare_inputs
from mmkv.models.mrope import prompt_positions, step_positions

pytestmark = pytest.mark.slow
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
FRAMES = 4  # two temporal patches of two frames


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_load_info):
    from mmkv.models.smollm2 import ensure_tokenizer

    root = tmp_path_factory.mktemp("qwen_vl")
    return {t: qwen_vl(root / t, ensure_tokenizer(), t) for t in FAMILIES}


@pytest.fixture(scope="module")
def models(folders):
    return {t: mmkv.load_model(str(f), device="cpu") for t, f in folders.items()}


def _img(seed, h, w):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _images_chat():
    return [{"role": "user", "content": [{"type": "image", "image": _img(0, 48, 64)},
                                         {"type": "text", "text": "Compare"},
                                         {"type": "image", "image": _img(1, 64, 40)},
                                         {"type": "text", "text": "with this."}]}]


def _video_chat(video_path, text="What happens?"):
    return [{"role": "user", "content": [{"type": "video", "path": str(video_path)},
                                         {"type": "image", "image": _img(2, 48, 64)},
                                         {"type": "text", "text": text}]}]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_image_and_video_token_is_visual_and_counted_as_the_processor_does(models, model_type, video_path):
    model, processor, adapter = models[model_type]
    tok = processor.tokenizer
    assert adapter.family == "qwen_vl" and adapter.mrope and adapter.takes_images and adapter.takes_video
    assert type(processor).__name__.endswith("NoTorchvision")
    assert adapter.visual_token_ids == (processor.image_token_id, processor.video_token_id)
    prep = prepare_inputs(adapter, _images_chat(), processor)
    kw = prep.model_kwargs
    # 48x64 px -> 6x8 patches -> 12 tokens; 64x40 -> 64x32 (Qwen's smart_resize to multiples of 16) -> 8 tokens
    assert kw["image_grid_thw"].tolist() == [[1, 6, 8], [1, 8, 4]]
    with torch.inference_mode():
        feats = model.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"], return_dict=True)
    per_image = [int(f.shape[0]) for f in feats.pooler_output]  # what the vision tower emits per image
    assert per_image == [12, 8] and int(prep.visual_mask.sum()) == 20
    ids, vis = prep.input_ids[0], prep.visual_mask[0]
    assert bool((ids[vis] == processor.image_token_id).all())
    spans = int((vis[1:] & ~vis[:-1]).sum() + vis[0])
    assert spans == 2  # each image its own span, the text between them is not visual
    for marker in ("<|vision_start|>", "<|vision_end|>"):  # brackets: ordinary text embeddings, 1-D positions
        at = ids == tok.convert_tokens_to_ids(marker)
        assert int(at.sum()) == 2 and not bool(vis[at].any())

    prep = prepare_inputs(adapter, _video_chat(video_path), processor, video_frames=FRAMES)
    grid = prep.model_kwargs["video_grid_thw"]
    assert grid[0, 0] == FRAMES // 2  # frame pairs are temporal patches
    n_video = int((prep.input_ids == processor.video_token_id).sum())
    assert n_video == int(grid.prod(-1).sum()) // 4 and int(prep.visual_mask.sum()) == n_video + 12


def test_video_patches_follow_the_image_processors_layout(models):
    from mmkv.models.qwen_vl import VideoPatches
    from mmkv.models.video import Clip

    _, processor, _ = models["qwen2_5_vl"]
    ip = processor.image_processor
    frame = _img(3, 48, 64)
    image = ip(frame, return_tensors="pt")
    video = VideoPatches(ip)([Clip([frame, frame], [0, 1], 25.0, 2)])
    # a still image is a video of temporal_patch_size equal frames: the same patches in the same order
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    torch.testing.assert_close(video["pixel_values_videos"], image["pixel_values"].float())
    with pytest.raises(ValueError, match="list of mmkv.models.video.Clip"):
        VideoPatches(ip)([[frame, frame]])


def _mmkv_logits(model, adapter, prep, steps):
    """The same through an fp16 ``MMKVCache`` with the positions the engine feeds (models/mrope.py)."""
    cache = MMKVCache.for_model("fp16", adapter)
    pos, delta = prompt_positions(model, prep.input_ids, prep.attention_mask, prep.model_kwargs)
    cache.set_inputs(prep.attention_mask, prep.visual_mask)
    with torch.inference_mode():
        out = model(input_ids=prep.input_ids, attention_mask=prep.attention_mask, position_ids=pos,
                    **cache_kwargs(model, cache), use_cache=True, **prep.model_kwargs)
        cache.finalize()
        logits, nxt_pos = [out.logits[:, -1]], pos[0, :, -1:] + 1
        for _ in range(steps):
            nxt = logits[-1].argmax(-1, keepdim=True)
            out = model(input_ids=nxt, position_ids=step_positions(nxt_pos, delta), **cache_kwargs(model, cache),
                        use_cache=True)
            logits.append(out.logits[:, -1])
            nxt_pos = nxt_pos + 1
    return torch.stack(logits), delta


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("prompt", ["images", "video"])
def test_fp16_cache_gives_the_models_own_logits_and_tokens(models, model_type, prompt, video_path):
    model, processor, adapter = loaded = models[model_type]
    msgs = _images_chat() if prompt == "images" else _video_chat(video_path)
    prep = prepare_inputs(adapter, msgs, processor, video_frames=FRAMES)
    ref, _ = own_cache_logits(model, prep, steps=3)
    ours, delta = _mmkv_logits(model, adapter, prep, steps=3)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert int(delta[0]) < 0  # a visual span takes fewer positions than tokens: the delta is what decode carries
    with torch.inference_mode():  # 1-D positions would give other logits: the check above can tell
        flat = model(input_ids=prep.input_ids, attention_mask=prep.attention_mask,
                     position_ids=torch.arange(prep.input_ids.shape[1])[None], **prep.model_kwargs).logits[:, -1]
    assert not torch.allclose(flat, ref[0], rtol=1e-3, atol=1e-3)

    out = mmkv.Engine(loaded).generate(msgs, spec="fp16", max_new_tokens=6, video_frames=FRAMES)
    with torch.inference_mode():
        gen = model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_kwargs,
                             max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(out.tokens[0], gen[0, prep.input_ids.shape[1]:])
    assert out.stats["prompt_tokens"]["visual"] == int(prep.visual_mask.sum())
    assert torch.equal(out.rope_delta, delta)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_second_turn_equals_a_fresh_run_and_the_models_own_generate(models, model_type, video_path):
    model, processor, adapter = loaded = models[model_type]
    eng = mmkv.Engine(loaded)
    first = eng.generate(_video_chat(video_path), spec="fp16", max_new_tokens=4, video_frames=FRAMES)
    history = _video_chat(video_path) + [{"role": "assistant", "content": first.text[0]},
                                         {"role": "user", "content": "And after that?"}]
    second = eng.generate(history, spec="fp16", max_new_tokens=6, past=first, video_frames=FRAMES)
    fresh = eng.generate(history, spec="fp16", max_new_tokens=6, video_frames=FRAMES)
    assert torch.equal(second.tokens, fresh.tokens)
    assert torch.equal(second.rope_delta, first.rope_delta) and int(first.rope_delta[0]) != 0
    prep = prepare_inputs(adapter, history, processor, video_frames=FRAMES)
    with torch.inference_mode():
        gen = model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_kwargs,
                             max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(second.tokens[0], gen[0, prep.input_ids.shape[1]:])
    later = history + [{"role": "assistant", "content": second.text[0]},
                       {"role": "user", "content": [{"type": "image", "image": _img(4, 48, 48)}]}]
    with pytest.raises(ValueError, match="start a new conversation"):
        eng.generate(later, spec="fp16", max_new_tokens=2, past=second, video_frames=FRAMES)


@pytest.fixture(scope="module")
def skvq_artifact(models, folders, tmp_path_factory):
    return skvq_artifact_for(models["qwen2_5_vl"], folders["qwen2_5_vl"], tmp_path_factory.mktemp("skvq"))


TEXT_SPECS = ["kivi:bits=2", "xquant:kq=1,vq=1,km=2,vm=1", "alignedkv", "fp16", "skvq:group=32,block=8"]


@pytest.mark.parametrize("text", TEXT_SPECS)
@pytest.mark.parametrize("visual", ["calibquant:bits=1", "kivi:bits=2"])
def test_every_method_runs_on_images_and_video(models, skvq_artifact, video_path, visual, text):
    loaded = models["qwen2_5_vl"]
    if text.startswith("skvq"):
        text += f",artifact={skvq_artifact}"
    spec = f"visual={visual} text={text} window=8 sinks=2"
    # text methods flush the window in blocks of 32 tokens or more: a prompt long enough to fill some
    msgs = _video_chat(video_path, "Say what happens in the video and in the picture, one line each. " * 8)
    out = mmkv.Engine(loaded).generate(msgs, spec=spec, max_new_tokens=4, video_frames=FRAMES)
    assert out.tokens.shape == (1, 4)
    n_visual = out.stats["prompt_tokens"]["visual"]
    assert out.stats["cache_tokens"]["visual"] == n_visual > 0  # image and video tokens: all in the visual segment
    assert out.stats["cache_tokens"]["text"] > 0  # the text beyond sinks and window went to the text method
    ad = loaded.adapter
    fp16 = n_visual * 2 * ad.num_layers * ad.num_kv_heads * ad.head_dim * 2
    assert out.stats["cache_bytes_used"]["visual"] < fp16 / 3  # 1-2 bit codes plus fp16 scales


def test_pre_rope_key_methods_are_refused_with_the_reason(models):
    with pytest.raises(ValueError, match="aquakv stores keys before RoPE.*multimodal RoPE"):
        mmkv.Engine(models["qwen3_vl"]).generate(_images_chat(), spec="text=aquakv", max_new_tokens=2)


def test_random_qwen25_vl_7b_has_the_real_shapes_and_builds_tiny_for_the_budget_bench(square_image_path):
    from eval.bench import budget as bench_budget
    from eval.bench import common as bench_common
    from mmkv.models.random_models import random_config

    t = random_config("random:qwen2.5-vl-7b").text_config  # a config only: no 7B allocation
    assert (t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.hidden_size // 28) == (28, 28, 4, 128)
    assert t.rope_parameters["mrope_section"] == [16, 24, 24]
    loaded = mmkv.load_model("random:qwen2.5-vl-7b", tiny=True, dtype=torch.float32)
    model, processor, adapter = loaded
    assert adapter.family == "qwen_vl" and adapter.mrope and adapter.synthetic == "random weights"
    # the budget's image: 4:3 at 1792 x 1344 px -> 64 x 48 merged patches of 28 px = 3072 visual tokens
    prep = prepare_inputs(adapter, [{"role": "user", "content": [{"type": "image", "image": _img(5, 1344, 1792)},
                                                                 {"type": "text", "text": "hi"}]}], processor)
    assert int(prep.visual_mask.sum()) == 3072 == int(prep.model_kwargs["image_grid_thw"].prod()) // 4
    out = mmkv.Engine(loaded).generate([{"role": "user", "content": [{"type": "image", "path": str(square_image_path)},
                                                                     {"type": "text", "text": "hi"}]}],
                                       spec="visual=calibquant:bits=1 text=xquant:kq=1,vq=1,km=2,vm=1",
                                       max_new_tokens=3)
    assert out.tokens.shape == (1, 3) and out.stats["cache_tokens"]["visual"] == out.stats["prompt_tokens"]["visual"]
    per_req = bench_common.one_request_cache("visual=calibquant:bits=1", adapter, 64, 16, torch.device("cpu"),
                                             torch.float32).nbytes()
    rows = bench_budget.run(model, adapter, ["hf-fp16", "fp16", "visual=calibquant:bits=1"], [3 * per_req / 1e9], 64,
                            16, steps=2, max_batch=8)
    assert {r["spec"]: r["max_batch"] for r in rows}["visual=calibquant:bits=1"] == 3
    assert all(r["tokens_per_s"] > 0 for r in rows if r["max_batch"] >= 1)
