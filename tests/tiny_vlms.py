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
