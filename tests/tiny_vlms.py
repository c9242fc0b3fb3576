"""Tiny random-weight checkpoints of VLM families, written to a folder with their own config, processor and
tokenizer (SmolLM2's, plus the family's special tokens), so that mmkv loads them through the same
``from_pretrained`` path as a hub id. Random weights: answers are noise; shapes, tokens and caching are real."""

from __future__ import annotations

from pathlib import Path

import torch


def _text_config(tok) -> dict:
    """The language model of every tiny family: 2 Llama layers, head_dim 32 (KIVI's group of 32 divides it)."""
    return dict(model_type="llama", vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                pad_token_id=tok.pad_token_id or 0, tie_word_embeddings=False)


def image_chat(*images, text: str) -> list[dict]:
    """One user turn: the images, then the text."""
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}{% else %}:"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %} {{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


def idefics3(folder: Path, tokenizer_src, seed: int = 0) -> Path:
    """An Idefics3 checkpoint (SmolVLM's architecture): 2-layer Llama LM (head_dim 32), 1-layer 64-px ViT of 16-px
    patches, pixel shuffle by 2 (4 tokens a tile), images split into 64-px tiles plus a global one."""
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_src)
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>",
                                                          "<end_of_utterance>"]})
    text = _text_config(tok)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                  patch_size=16)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    ip = Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64},
                                   do_image_splitting=True)
    proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    proc.save_pretrained(folder)
    return folder


LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def llava_next(folder: Path, tokenizer_src, seed: int = 0) -> Path:
    """A LLaVA-NeXT checkpoint: 2-layer Llama LM (head_dim 32), 1-layer CLIP ViT of 32-px images in 16-px patches
    (4 features a crop, the class token dropped), anyres grid pinpoints up to 64x64 px, the learned image-newline
    feature after each row of patch features."""
    from transformers import (
        AutoTokenizer,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next import LlavaNextImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_src)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = _text_config(tok)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=16, projection_dim=32)
    pins = [[32, 32], [32, 64], [64, 32], [64, 64]]
    config = LlavaNextConfig(text_config=text, vision_config=vision, image_grid_pinpoints=pins,
                             image_token_index=tok.convert_tokens_to_ids("<image>"),
                             vision_feature_select_strategy="default", vision_feature_layer=-1,
                             tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                    image_grid_pinpoints=pins)
    proc = LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=16, num_additional_image_tokens=1,
                              vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    proc.save_pretrained(folder)
    return folder


QWEN_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PATCH = 8  # 8-px patches merged 2x2: one token per 16x16 px, images bounded to 64x64 px (<= 16 tokens)


def qwen_vl(folder: Path, tokenizer_src, model_type: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense or MoE) checkpoint: 2-layer text model of the family (head_dim 32, M-RoPE sections
    summing to 16), a 1-2 layer vision tower of 8-px patches, 2x2 merge, temporal patches of 2 frames; files laid
    out as the hub's (``preprocessor_config.json`` naming the torchvision class, ``video_preprocessor_config.json``,
    ``chat_template.jinja``)."""
    import json

    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_src)
    tok.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    ids = {f"{k}_token_id": tok.convert_tokens_to_ids(t)
           for k, t in zip(("vision_start", "vision_end", "image", "video"), QWEN_VL_TOKENS)}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    text = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_parameters=rope, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    common = dict(patch_size=QWEN_PATCH, spatial_merge_size=2, temporal_patch_size=2, num_heads=2, in_channels=3)
    if model_type == "qwen2_vl":
        vision = dict(common, depth=1, embed_dim=32, hidden_size=128, mlp_ratio=2)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    elif model_type == "qwen2_5_vl":
        vision = dict(common, depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=128,
                      window_size=32, fullatt_block_indexes=[1], tokens_per_second=2)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    elif model_type == "qwen3_vl":
        text = dict(text, head_dim=32, rope_parameters={**rope, "mrope_section": [6, 5, 5], "mrope_interleaved": True})
        vision = dict(common, depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=128,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    elif model_type == "qwen3_vl_moe":  # every layer sparse: 4 experts of which 2 route each token
        text = dict(text, head_dim=32, rope_parameters={**rope, "mrope_section": [6, 5, 5], "mrope_interleaved": True},
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
        vision = dict(common, depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=128,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    else:
        raise ValueError(model_type)
    config.tie_word_embeddings = False
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    pixels = {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}
    ip = Qwen2VLImageProcessorPil(size=pixels, patch_size=QWEN_PATCH, merge_size=2, temporal_patch_size=2)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    ip.save_pretrained(folder)
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    cfg["image_processor_type"] = "Qwen2VLImageProcessor"  # what hub checkpoints name: the torchvision class
    (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
    video = {"size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}, "patch_size": QWEN_PATCH,
             "merge_size": 2, "temporal_patch_size": 2, "video_processor_type": "Qwen2VLVideoProcessor"}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    (folder / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)
    return folder


GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
GEMMA3_WINDOW = 12  # the sliding layers' window: prompts of a few dozen tokens cross it


def gemma3(folder: Path, tokenizer_src, text_only: bool = False, seed: int = 0, pan_and_scan: bool = False) -> Path:
    """A Gemma 3 checkpoint: 4-layer Gemma 3 LM (head_dim 32), sliding-window layers (window ``GEMMA3_WINDOW``) at
    0 and 2 beside full-attention layers at 1 and 3 (so XQuant's odd layers would share codes with sliding ones), the
    two RoPE bases of the real models; a 1-layer SigLIP tower of 64-px images in 16-px patches, 16 soft tokens an
    image. ``text_only``: the same LM as a ``Gemma3ForCausalLM`` (``gemma3_text``, as gemma-3-1b is).
    ``pan_and_scan``: its ``preprocessor_config.json`` turns pan-and-scan on, crops of at least 16 px, up to 4."""
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForCausalLM,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
    )
    from transformers.models.gemma3 import Gemma3ImageProcessorPil, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_src, extra_special_tokens=dict(GEMMA3_TOKENS))
    tok.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    text = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                sliding_window=GEMMA3_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                max_position_embeddings=4096, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    if text_only:
        Gemma3ForCausalLM(Gemma3TextConfig(**text)).eval().save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        return folder
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=64, patch_size=16)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                          image_token_index=tok.image_token_id, tie_word_embeddings=False)
    Gemma3ForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
    pas = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=4,
               pan_and_scan_min_ratio_to_activate=1.2) if pan_and_scan else {}
    ip = Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, **pas)
    Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=16,
                    chat_template=GEMMA3_TEMPLATE).save_pretrained(folder)
    return folder


def llava_onevision(folder: Path, tokenizer_src, seed: int = 0) -> Path:
    """A LLaVA-OneVision checkpoint: 2-layer Llama LM (head_dim 32), 1-layer SigLIP ViT of 64-px crops in 16-px
    patches (16 features a crop, ``full`` strategy: SigLIP has no class token), anyres grid pinpoints up to 128x128
    px with the image-newline feature after each row, videos of 64-px frames pooled 2x2 (4 features a frame) and
    one newline feature after the video; files laid out as the hub's (``processor_config.json`` naming
    transformers' processor class, ``video_preprocessor_config.json``)."""
    import json

    from transformers import AutoTokenizer, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

    from mmkv.models.onevision import VideoFrames, processor_class

    tok = AutoTokenizer.from_pretrained(tokenizer_src)
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    text = _text_config(tok)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=64, patch_size=16)
    pins = [[64, 64], [64, 128], [128, 64], [128, 128]]
    config = LlavaOnevisionConfig(text_config=text, vision_config=vision, image_grid_pinpoints=pins,
                                  image_token_index=tok.convert_tokens_to_ids("<image>"),
                                  video_token_index=tok.convert_tokens_to_ids("<video>"),
                                  vision_feature_select_strategy="full", vision_feature_layer=-1,
                                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    ip = LlavaOnevisionImageProcessorPil(size={"height": 64, "width": 64}, image_grid_pinpoints=pins)
    video = VideoFrames(ip, {"size": {"height": 64, "width": 64}})
    proc = processor_class()(image_processor=ip, tokenizer=tok, video=video, num_image_tokens=16,
                             vision_feature_select_strategy="full", chat_template=ONEVISION_TEMPLATE)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    proc.save_pretrained(folder)
    path = folder / "processor_config.json"
    cfg = json.loads(path.read_text())
    cfg["processor_class"] = "LlavaOnevisionProcessor"
    path.write_text(json.dumps(cfg))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": video.size, "image_mean": video.image_mean, "image_std": video.image_std,
         "video_processor_type": "LlavaOnevisionVideoProcessor"}))
    return folder


ONEVISION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'video' %}<video>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def own_cache_logits(model, prep, steps: int):
    """Logits of the prompt's last token and of ``steps`` greedy steps through the model's own DynamicCache (the
    model numbers positions itself; one unpadded row, so no mask on the steps) -> (``[steps + 1, 1, vocab]``, cache)."""
    with torch.inference_mode():
        out = model(input_ids=prep.input_ids, attention_mask=prep.attention_mask, use_cache=True,
                    **prep.model_kwargs)
        logits, cache = [out.logits[:, -1]], out.cache
        for _ in range(steps):
            out = model(input_ids=logits[-1].argmax(-1, keepdim=True), cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


def _calibration_text(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    text = root / "calib.txt"
    text.write_text(" The tower is 324 metres tall, about the same height as an 81-storey building. " * 30)
    return text


def skvq_artifact_for(loaded, folder: Path, root: Path) -> Path:
    """An SKVQ calibration artifact of a tiny model (``loaded``, the LoadedModel of ``folder``) from a short repeated
    text, written under ``root``; ``mmkv-calibrate`` is pointed at the loaded model instead of loading it again."""
    import pytest

    from mmkv.calibrate import main

    text = _calibration_text(root)
    out = root / "art"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mmkv.models.load_model", lambda name, device="cpu", **kw: loaded)
        try:
            assert main(["skvq", "--model", str(folder), "--data", str(text), "--tokens", "128", "--seq-len", "64",
                         "--group", "32", "--k-bits", "2", "--v-bits", "2", "--q-stride", "16", "--threads", "1",
                         "--out", str(out)]) == 0
        finally:
            torch.set_num_threads(threads)
    return out


def aquakv_artifact_for(loaded, root: Path) -> Path:
    """AQUA-KV predictors (2-bit HIGGS, the method's defaults) of a tiny model fitted on a short repeated text: four
    windows of 64 tokens, one held out; written under ``root``, the folder a spec's ``artifact=`` names."""
    from mmkv.calibrate.aquakv import run
    from mmkv.methods.aquakv import AquaKV

    folder, _ = run(loaded, AquaKV(), _calibration_text(root), seq_len=64, max_tokens=256, out=root / "aquakv",
                    log=lambda *a: None)
    return folder


# Every text method beside 1-bit CalibQuant on the visual tokens, and KIVI on both: the cases a family's
# "every method runs end to end" test takes (small groups, blocks and layer splits for the tiny models).
TEXT_SPECS = ["kivi:bits=2", "xquant:kq=1,vq=1,km=2,vm=1", "alignedkv", "fp16", "skvq:group=32,block=8", "aquakv"]
METHOD_CASES = [*(("calibquant:bits=1", t) for t in TEXT_SPECS), ("kivi:bits=2", "kivi:bits=2")]


def method_artifacts(loaded, folder: Path, root: Path) -> dict[str, Path]:
    """The calibration artifacts the text methods of ``TEXT_SPECS`` need, by method name."""
    return {"skvq": skvq_artifact_for(loaded, folder, root / "skvq"), "aquakv": aquakv_artifact_for(loaded, root)}


def with_artifact(text: str, artifacts: dict[str, Path]) -> str:
    """A text method spec with its artifact named, where it needs one."""
    name = text.split(":")[0]
    if name not in artifacts:
        return text
    return text + ("," if ":" in text else ":") + f"artifact={artifacts[name]}"


def family_folders(root: Path, tokenizer_src) -> dict[str, Path]:
    """One tiny folder of each VLM family issue 30 added, by the family name the adapter reports (Qwen-VL as
    Qwen2.5-VL, the one the budget bench runs)."""
    return {"idefics3": idefics3(root / "idefics3", tokenizer_src),
            "llava_next": llava_next(root / "llava_next", tokenizer_src),
            "llava_onevision": llava_onevision(root / "llava_onevision", tokenizer_src),
            "gemma3": gemma3(root / "gemma3", tokenizer_src),
            "qwen_vl": qwen_vl(root / "qwen_vl", tokenizer_src, "qwen2_5_vl")}
