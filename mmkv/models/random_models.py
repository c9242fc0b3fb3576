"""``random:*``: full-size LLaVA-1.5 / InternVL2.5 architectures with random weights.

Why: KV-cache memory and decode speed depend only on the language model's shapes (layers, heads, KV heads,
head_dim) and on how many visual tokens a prompt carries; real weights cannot be downloaded here. These models
reproduce both exactly, so GPU benchmarks measure what the real checkpoints would cost. Outputs are
meaningless, and every adapter, log line and table says ``random weights``.

Shapes follow the released configs (language models expressed as Llama configs, which transformers'
InternVL accepts; InternLM2 is a Llama-type decoder):
- llava-1.5-7b: Llama-2-7B (32 layers, 32 q / 32 kv heads, head_dim 128, hidden 4096, MLP 11008) behind
  CLIP ViT-L/14-336 (24 layers, 1024 wide): 576 visual tokens per image.
- internvl2.5-8b: internlm2.5-7b-chat (32 layers, 32 q / 8 kv heads, head_dim 128, hidden 4096, MLP 14336)
  behind InternViT-300M-448px-V2_5 (24 layers, 1024 wide): 256 visual tokens per 448 px tile.
- smollm2-135m: SmolLM2-135M's own shapes (30 layers, 9 q / 3 kv heads, head_dim 64), text only: the real
  weights do not fit the GPU tool's transfer limit, so text-cache speed is measured on these.
- internvl2.5-26b: internlm2.5-20b-chat (48 layers, 48 q / 8 kv heads, head_dim 128, hidden 6144,
  MLP 16384) behind InternViT-6B-448px-V2_5 (45 layers, 3200 wide, QK-norm, RMSNorm): 256 per tile.
- qwen2.5-vl-7b: Qwen2.5-VL-7B-Instruct's own classes and config (28 layers, 28 q / 4 kv heads, head_dim 128,
  hidden 3584, MLP 18944, M-RoPE sections 16/24/24) behind its 32-layer window-attention ViT (1280 wide):
  dynamic resolution, one visual token per 28 x 28 px (a 1792 x 1344 image: 3072 tokens).

The processor is the SmolLM2 tokenizer plus the family's image processor (``processors.py``); its ids
(< 49,216) index into the random embedding table. InternLM2's vocab (92,553) already covers them; LLaVA's
(32,064) does not, so that table is widened to 49,216 rows, which changes no KV-cache shape.

Weights are created directly on the target device in the target dtype (``torch.device`` context), so a 26B
model never passes through CPU memory or fp32; with ``device_map`` each weight is created on its own GPU
(``sharding.py``). ``tiny=True`` keeps the family and the visual-token geometry
but shrinks the language model and vision tower, for CPU tests.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import LlamaConfig

from . import smollm2
from .adapter import adapter_for
from .configs import TINY_VISION, internvl_config, llava_config
from .processors import internvl_processor, llava_processor, visual_token_ids
from .qwen_vl import random_processor as qwen_vl_processor
from .sharding import build_random_sharded

SYNTHETIC = "random weights"
SEED = 0
SMOLLM2_VOCAB = 49152
# Ids the processors give their added tokens: SmolLM2's vocab ends at 49151, added tokens follow in order.
LLAVA_IMAGE_ID = SMOLLM2_VOCAB  # <image>
INTERNVL_CONTEXT_ID = SMOLLM2_VOCAB + 2  # <img>, </img>, <IMG_CONTEXT>, <video>
QWEN_IDS = {"vision_start_token_id": SMOLLM2_VOCAB, "vision_end_token_id": SMOLLM2_VOCAB + 1,
            "image_token_id": SMOLLM2_VOCAB + 2, "video_token_id": SMOLLM2_VOCAB + 3}  # qwen_vl.TOKENS in order
TOKENIZER_ROWS = 49216  # SmolLM2 + added tokens, padded to a multiple of 64

_LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, head_dim=128, vocab_size=TOKENIZER_ROWS, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
_INTERNLM25_7B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=92553, max_position_embeddings=32768,
                      rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)
_INTERNLM25_20B = dict(hidden_size=6144, intermediate_size=16384, num_hidden_layers=48, num_attention_heads=48,
                       num_key_value_heads=8, head_dim=128, vocab_size=92553, max_position_embeddings=32768,
                       rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)
_SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=SMOLLM2_VOCAB, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
_QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # SmolLM2's <|im_start|>, <|im_end|>
_QWEN25_VIT = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                   fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
_CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                   hidden_act="quick_gelu", layer_norm_eps=1e-5)
_INTERNVIT_300M = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       attention_bias=True, use_qk_norm=False, norm_type="layer_norm")
_INTERNVIT_6B = dict(hidden_size=3200, intermediate_size=12800, num_hidden_layers=45, num_attention_heads=25,
                     attention_bias=False, use_qk_norm=True, norm_type="rms_norm")

# name -> (family, language model, vision tower, image token id, default video frames)
SPECS = {
    "llava-1.5-7b": ("llava", _LLAMA2_7B, _CLIP_L_336, LLAVA_IMAGE_ID, 8),
    "internvl2.5-8b": ("internvl", _INTERNLM25_7B, _INTERNVIT_300M, INTERNVL_CONTEXT_ID, 16),
    "internvl2.5-26b": ("internvl", _INTERNLM25_20B, _INTERNVIT_6B, INTERNVL_CONTEXT_ID, 16),
    "smollm2-135m": ("text", _SMOLLM2_135M, None, None, 0),
    "qwen2.5-vl-7b": ("qwen_vl", _QWEN25_7B, _QWEN25_VIT, QWEN_IDS["image_token_id"], 16),
}
RANDOM_NAMES = tuple(f"random:{k}" for k in SPECS)


def _spec(name: str):
    key = name.removeprefix("random:")
    if key not in SPECS:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(RANDOM_NAMES)}")
    return SPECS[key]


def _tiny(text: dict) -> dict:
    # Same q:kv head ratio as the real model, so GQA code paths match.
    ratio = text["num_attention_heads"] // text["num_key_value_heads"]
    return {**text, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": max(1, 4 // ratio), "head_dim": 64,
            "vocab_size": TOKENIZER_ROWS}


def random_config(name: str, tiny: bool = False):
    """The ``LlavaConfig`` / ``InternVLConfig`` of ``random:<name>`` (prefix optional); allocates nothing."""
    family, text, vision, image_id, _ = _spec(name)
    text = _tiny(text) if tiny else dict(text)
    if family == "text":
        return LlamaConfig(**text)
    if family == "qwen_vl":
        from transformers import Qwen2_5_VLConfig

        if tiny:  # M-RoPE sections cover head_dim / 2 = 32; the patch/merge geometry stays the real one
            text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [8, 12, 12]}
            text.pop("head_dim")
            vision = {**vision, "depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                      "fullatt_block_indexes": [0]}
        vision = {**vision, "out_hidden_size": text["hidden_size"]}
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **QWEN_IDS)
    vision = dict(TINY_VISION) if tiny else dict(vision)
    build = llava_config if family == "llava" else internvl_config
    return build(LlamaConfig(**text), vision, image_token_id=image_id)


@contextlib.contextmanager
def _seeded(device):
    """The same random weights on every build (whatever the tests or the app drew before), without moving the
    caller's random state."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        torch.manual_seed(SEED)
        yield


def load_random(name: str, device: torch.device, dtype: torch.dtype, tiny: bool = False, device_map=None,
                max_memory=None):
    """(model, processor, adapter) with random weights, built on ``device`` in ``dtype``, or with ``device_map``
    spread over several devices (``sharding.build_random_sharded``: allocated and initialized on each GPU)."""
    from transformers import (
        AutoTokenizer,
        InternVLForConditionalGeneration,
        LlamaForCausalLM,
        LlavaForConditionalGeneration,
    )

    family, _, _, _, frames = _spec(name)
    config = random_config(name, tiny=tiny)
    folder = smollm2.ensure_tokenizer()
    if family == "text":
        if device_map is not None:
            model = build_random_sharded(LlamaForCausalLM, config, dtype, device_map, max_memory, SEED)
        else:
            with _seeded(device), torch.device(device):
                model = LlamaForCausalLM._from_config(config, dtype=dtype)
        model.eval()
        model.config.name_or_path = name
        return model, AutoTokenizer.from_pretrained(folder), adapter_for(name, "text", model.config, (), SYNTHETIC)
    processor = {"llava": llava_processor, "internvl": internvl_processor, "qwen_vl": qwen_vl_processor}[family](folder)
    if processor.image_token_id != config.image_token_id:
        raise RuntimeError(f"tokenizer gives the image token id {processor.image_token_id}, config expects "
                           f"{config.image_token_id}: has the SmolLM2 tokenizer changed?")
    visual = visual_token_ids(processor)
    if family == "qwen_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration as cls

        visual = (processor.image_token_id, processor.video_token_id)
    else:
        cls = LlavaForConditionalGeneration if family == "llava" else InternVLForConditionalGeneration
    if device_map is not None:
        model = build_random_sharded(cls, config, dtype, device_map, max_memory, SEED)
    else:
        with _seeded(device), torch.device(device):
            model = cls._from_config(config, dtype=dtype)
    model.eval()
    model.config.name_or_path = name
    adapter = adapter_for(name, family, model.config.text_config, visual, SYNTHETIC, default_video_frames=frames)
    return model, processor, adapter
