"""Tiny random-weight checkpoints of VLM families, written to a folder with their own config, processor and
tokenizer (SmolLM2's, plus the family's special tokens), so that mmkv loads them through the same
``from_pretrained`` path as a hub id. Random weights: answers are noise; shapes, tokens and caching are real."""

from __future__ import annotations

from pathlib import Path

import torch

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
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                pad_token_id=tok.pad_token_id or 0, tie_word_embeddings=False)
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
