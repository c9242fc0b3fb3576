"""mmkv.models on CPU: the embedded SmolLM2, demo VLMs with real processors, inputs, errors, configs, video.

Hub-style loading is tested on tiny random checkpoints written into tmp_path with save_pretrained; nothing is
downloaded.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from mmkv.models import LoadedModel, available_models, load_model, load_video_frames, random_config
from mmkv.models import smollm2 as smollm2_mod
from mmkv.models.configs import internvl_tokens_per_tile, llava_tokens_per_image
from mmkv.models.inputs import prepare_inputs
from mmkv.models.video import available_backend


def image_msg(path, text="What is in the picture?"):
    return [{"role": "user", "content": [{"type": "image", "image": str(path)}, {"type": "text", "text": text}]}]


def last_logits(lm, prep):
    with torch.inference_mode():
        return lm.model(input_ids=prep.input_ids, attention_mask=prep.attention_mask, logits_to_keep=1,
                        **prep.model_kwargs).logits[:, -1]


def greedy(lm, prep, n):
    with torch.inference_mode():
        out = lm.model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, max_new_tokens=n,
                                do_sample=False, **prep.model_kwargs)
    return out[:, prep.input_ids.shape[1]:]


# --- the embedded default model -------------------------------------------------------------------------------

def test_smollm2_is_converted_once_and_reloads_fast_from_the_cache(smollm2, smollm2_load_info):
    folder = smollm2_load_info["folder"]
    assert (folder / "model.safetensors").is_file() and (folder / smollm2_mod.MARKER).is_file()
    assert not list(folder.parent.glob(".smollm2-135m.tmp-*"))
    assert smollm2_mod.ensure_converted() == (folder, False)
    start = time.perf_counter()
    again = load_model("smollm2-135m", device="cpu")
    assert time.perf_counter() - start < 20  # ~1 s unloaded; the GGUF route takes ~25 s
    assert again.adapter.synthetic is None


def test_smollm2_shapes_and_unpacking(smollm2):
    model, tokenizer, adapter = smollm2
    assert isinstance(smollm2, LoadedModel)
    assert (adapter.family, adapter.num_layers, adapter.num_q_heads, adapter.num_kv_heads, adapter.head_dim) == \
        ("text", 30, 9, 3, 64)
    assert adapter.lm_config is model.config and adapter.visual_token_ids == ()
    assert not adapter.takes_images and "smollm2-135m" in repr(smollm2) and "synthetic" not in repr(smollm2)
    assert adapter.lm_config._attn_implementation == "mmkv"


def test_smollm2_greedy_answer_is_sane(smollm2):
    prep = smollm2.prepare("What is the capital of France? Answer in one word.")
    text = smollm2.processor.decode(greedy(smollm2, prep, 6)[0])
    assert "Paris" in text


def test_batch_of_two_strings_is_left_padded(smollm2):
    short, long = "Hi!", "Please list three prime numbers greater than ten, separated by commas."
    prep = smollm2.prepare([short, long])
    ids, mask = prep.input_ids, prep.attention_mask
    assert ids.shape[0] == 2 and mask.shape == ids.shape and mask.dtype == torch.long
    n_short, n_long = mask.sum(1).tolist()
    assert n_long == ids.shape[1] > n_short
    assert mask[0, : ids.shape[1] - n_short].eq(0).all() and mask[0, -n_short:].eq(1).all()
    assert ids[0, 0] == smollm2.processor.pad_token_id
    alone = smollm2.prepare(short)
    assert torch.equal(alone.input_ids[0], ids[0, -n_short:])
    assert not prep.visual_mask.any()


def test_token_id_tensors_are_accepted(smollm2):
    prep = smollm2.prepare(torch.tensor([1, 2, 3]))
    assert prep.input_ids.shape == (1, 3) and prep.attention_mask.sum() == 3


def test_cache_write_is_atomic(tmp_path):
    dest = tmp_path / "models" / "m"

    def crash(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        smollm2_mod.write_atomically(dest, crash)
    assert not dest.exists() and list((tmp_path / "models").iterdir()) == []
    smollm2_mod.write_atomically(dest, lambda tmp: (tmp / "ok").write_text("1"))
    smollm2_mod.write_atomically(dest, lambda tmp: (tmp / "ok2").write_text("2"))  # replaces, never merges
    assert sorted(p.name for p in dest.iterdir()) == ["ok2"]
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["m"]


# --- demo VLMs -------------------------------------------------------------------------------------------------

def test_demo_llava_marks_exactly_576_image_tokens(demo_llava, cat_image_path):
    model, processor, adapter = demo_llava
    assert adapter.family == "llava" and adapter.synthetic == "random vision tower"
    assert "random vision tower" in repr(demo_llava)
    prep = prepare_inputs(adapter, image_msg(cat_image_path), processor)
    assert int((prep.input_ids == model.config.image_token_id).sum()) == 576
    assert torch.equal(prep.visual_mask, prep.input_ids == model.config.image_token_id)
    assert prep.model_kwargs["pixel_values"].shape == (1, 3, 336, 336)
    ids = prep.input_ids[0][prep.visual_mask[0]]
    assert ids.numel() == 576 and prep.visual_mask[0].nonzero().diff(dim=0).eq(1).all()  # one contiguous span


def test_demo_llava_forward_uses_the_real_language_model(demo_llava, smollm2, square_image_path):
    prep = demo_llava.prepare(image_msg(square_image_path, "Say hello."))
    logits = last_logits(demo_llava, prep)
    assert logits.shape == (1, demo_llava.model.config.text_config.vocab_size) and logits.isfinite().all()
    lm = demo_llava.model.model.language_model
    assert torch.equal(lm.layers[3].self_attn.k_proj.weight, smollm2.model.model.layers[3].self_attn.k_proj.weight)


def test_demo_internvl_marks_256_tokens_per_tile(demo_internvl, cat_image_path, square_image_path):
    model, processor, adapter = demo_internvl
    assert adapter.family == "internvl" and adapter.synthetic == "random vision tower"
    prep = prepare_inputs(adapter, image_msg(cat_image_path), processor)
    tiles = prep.model_kwargs["pixel_values"].shape[0]
    assert tiles > 1 and prep.model_kwargs["pixel_values"].shape[1:] == (3, 448, 448)
    assert int(prep.visual_mask.sum()) == 256 * tiles
    assert torch.equal(prep.visual_mask, prep.input_ids == model.config.image_token_id)
    one = prepare_inputs(adapter, image_msg(square_image_path, "Say hello."), processor)
    assert int(one.visual_mask.sum()) == 256
    assert last_logits(demo_internvl, one).isfinite().all()


def test_vlm_batch_mixes_image_and_text_only_rows(demo_llava, square_image_path):
    prep = demo_llava.prepare([image_msg(square_image_path), "Just text."])
    assert prep.visual_mask.sum(1).tolist() == [576, 0]
    assert prep.attention_mask[1, 0] == 0 and prep.attention_mask[:, -1].eq(1).all()


# --- errors ----------------------------------------------------------------------------------------------------

def test_unknown_model_name_lists_builtins():
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_model("no-such-model-anywhere")
    with pytest.raises(ValueError, match="random:internvl2.5-8b"):
        load_model("random:gpt-5")
    with pytest.raises(ValueError, match="could not read config.json"):
        load_model("nobody/not-a-cached-model")


@pytest.mark.parametrize("bad", ["", "   \n", [], [{"role": "user", "content": "  "}]],
                         ids=["empty", "whitespace", "empty-list", "empty-chat"])
def test_empty_prompt(smollm2, bad):
    with pytest.raises(ValueError, match="empty prompt"):
        smollm2.prepare(bad)


def test_unreadable_and_missing_images(demo_llava, corrupt_image_path, tmp_path):
    with pytest.raises(ValueError, match=r"corrupt\.png is not a readable image"):
        demo_llava.prepare(image_msg(corrupt_image_path))
    with pytest.raises(ValueError, match="not found"):
        demo_llava.prepare(image_msg(tmp_path / "nope.png"))


def test_images_to_a_text_model_are_refused(smollm2, cat_image_path):
    with pytest.raises(ValueError, match="text-only"):
        smollm2.prepare(image_msg(cat_image_path))


# --- local hub-style folders -----------------------------------------------------------------------------------

def _write_config(folder, cfg):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_config_needing_remote_code_names_the_flag(tmp_path):
    folder = _write_config(tmp_path / "custom", {
        "model_type": "my_custom_lm", "architectures": ["MyCustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyLM"}})
    with pytest.raises(ValueError, match=r"trust_remote_code=True.*--trust-remote-code"):
        load_model(str(folder))


def test_unsupported_architecture_lists_families(tmp_path):
    folder = _write_config(tmp_path / "gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"unsupported architecture.*Llama, Mistral, Qwen2"):
        load_model(str(folder))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_local_text_folder_loads(arch, tmp_path, smollm2_load_info):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.for_model(arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=49152)
    folder = tmp_path / arch
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_load_info["folder"]).save_pretrained(folder)
    lm = load_model(str(folder), device="cpu")
    assert (lm.adapter.family, lm.adapter.num_layers, lm.adapter.num_kv_heads, lm.adapter.head_dim) == \
        ("text", 2, 2, 16)
    assert lm.adapter.synthetic is None and lm.adapter.lm_config._attn_implementation == "mmkv"
    assert greedy(lm, lm.prepare("Hello"), 2).shape == (1, 2)


def test_local_llava_folder_loads_with_its_own_processor(tmp_path, tiny_random_llava, square_image_path):
    folder = tmp_path / "llava"
    tiny_random_llava.model.save_pretrained(folder)
    tiny_random_llava.processor.save_pretrained(folder)
    lm = load_model(str(folder), device="cpu")
    assert lm.adapter.family == "llava" and lm.adapter.visual_token_ids == (lm.model.config.image_token_id,)
    assert int(lm.prepare(image_msg(square_image_path)).visual_mask.sum()) == 576


def test_local_internvl_folder_loads_without_torchvision(tmp_path, tiny_random_internvl, square_image_path):
    folder = tmp_path / "internvl"
    tiny_random_internvl.model.save_pretrained(folder)
    tiny_random_internvl.processor.save_pretrained(folder)
    cfg = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({**cfg, "processor_class": "InternVLProcessor"}))
    lm = load_model(str(folder), device="cpu")  # as a real -hf checkpoint says; its video half needs torchvision
    assert lm.adapter.family == "internvl" and lm.adapter.num_q_heads // lm.adapter.num_kv_heads == 4
    assert int(lm.prepare(image_msg(square_image_path)).visual_mask.sum()) == 256


def test_pickle_only_checkpoint_is_refused(tmp_path):
    from transformers import LlamaConfig

    folder = tmp_path / "pickled"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4).save_pretrained(
        folder)
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(folder), device="cpu")


# --- random:* --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, layers, heads, kv, head_dim, hidden, per_image", [
    ("llava-1.5-7b", 32, 32, 32, 128, 4096, 576),
    ("internvl2.5-8b", 32, 32, 8, 128, 4096, 256),
    ("internvl2.5-26b", 48, 48, 8, 128, 6144, 256),
])
def test_random_configs_match_the_real_checkpoints(name, layers, heads, kv, head_dim, hidden, per_image):
    cfg = random_config(name)
    t = cfg.text_config
    assert (t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.hidden_size) == \
        (layers, heads, kv, head_dim, hidden)
    per = llava_tokens_per_image(cfg) if cfg.model_type == "llava" else internvl_tokens_per_tile(cfg)
    assert per == per_image
    assert random_config(f"random:{name}").to_dict() == cfg.to_dict()
    assert f"random:{name}" in available_models()


def test_tiny_random_models_keep_visual_geometry(tiny_random_llava, tiny_random_internvl, square_image_path):
    for lm, per in [(tiny_random_llava, 576), (tiny_random_internvl, 256)]:
        assert lm.adapter.synthetic == "random weights" and "random weights" in repr(lm)
        prep = lm.prepare(image_msg(square_image_path))
        assert int(prep.visual_mask.sum()) == per
    assert tiny_random_internvl.adapter.num_q_heads // tiny_random_internvl.adapter.num_kv_heads == 4


# --- video -----------------------------------------------------------------------------------------------------

needs_video = pytest.mark.skipif(available_backend() is None, reason="no video backend (decord / av)")


@needs_video
@pytest.mark.parametrize("backend", ["decord", "av"])
def test_load_video_frames(video_path, backend):
    import importlib.util

    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} not installed")
    frames = load_video_frames(video_path, backend=backend)
    assert len(frames) == 8 and frames[0].size == (640, 272) and frames[0].mode == "RGB"
    assert len(load_video_frames(video_path, fps=1, backend=backend)) == 10  # 10 s clip at 1 fps
    with pytest.raises(ValueError, match="max_seconds"):
        load_video_frames(video_path, max_seconds=5, backend=backend)


@needs_video
def test_bad_videos_raise_value_errors(tmp_path, video_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42 garbage" * 10)
    with pytest.raises(ValueError, match="bad.mp4 is not a readable video"):
        load_video_frames(bad)
    (tmp_path / "clip.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported video type"):
        load_video_frames(tmp_path / "clip.txt")
    with pytest.raises(ValueError, match="not found"):
        load_video_frames(tmp_path / "missing.mp4")
    with pytest.raises(ValueError, match="max_frames"):
        load_video_frames(video_path, fps=30, max_frames=64)


@needs_video
def test_video_frames_become_visual_spans(demo_llava, demo_internvl, smollm2, video_path):
    msg = [{"role": "user", "content": [{"type": "video", "video": str(video_path)},
                                        {"type": "text", "text": "What happens?"}]}]
    llava = demo_llava.prepare(msg, video_frames=4)
    assert int(llava.visual_mask.sum()) == 4 * 576
    internvl = demo_internvl.prepare(msg)  # InternVL default: 16 frames
    assert internvl.model_kwargs["pixel_values"].shape[0] == 16  # one tile per frame, no tiling
    assert int(internvl.visual_mask.sum()) == 16 * 256
    with pytest.raises(ValueError, match="text-only"):
        smollm2.prepare(msg)
