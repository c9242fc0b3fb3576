"""Config builders for the two VLM families, shared by ``demo-*`` (tiny vision, real SmolLM2) and ``random:*``.

Both families keep the real checkpoints' visual geometry so the KV cache sees the same visual-token counts:
LLaVA-1.5 = CLIP ViT-L/14 at 336 px -> 24 x 24 = 576 tokens per image (CLS dropped);
InternVL2.5 = InternViT at 448 px tiles, patch 14 -> 32 x 32 patches, pixel-shuffle 0.5 -> 256 tokens per tile.
"""

from __future__ import annotations

from transformers import CLIPVisionConfig, InternVLConfig, InternVLVisionConfig, LlavaConfig, PretrainedConfig

LLAVA_IMAGE_SIZE, LLAVA_PATCH = 336, 14
INTERNVL_TILE, INTERNVL_PATCH, INTERNVL_DOWNSAMPLE = 448, 14, 0.5

# Small enough that a forward of several tiles costs well under a second on two CPU cores.
TINY_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}


def llava_tokens_per_image(config: LlavaConfig) -> int:
    v = config.vision_config
    return (v.image_size // v.patch_size) ** 2


def internvl_tokens_per_tile(config: InternVLConfig) -> int:
    v = config.vision_config
    return int((v.image_size[0] // v.patch_size[0]) * (v.image_size[1] // v.patch_size[1])
               * config.downsample_ratio ** 2)


def llava_config(text: PretrainedConfig, vision: dict, image_token_id: int) -> LlavaConfig:
    vision_config = CLIPVisionConfig(image_size=LLAVA_IMAGE_SIZE, patch_size=LLAVA_PATCH,
                                     projection_dim=vision["hidden_size"], **vision)
    cfg = LlavaConfig(vision_config=vision_config, text_config=text.to_dict(), image_token_index=image_token_id,
                      image_seq_length=(LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2, projector_hidden_act="gelu",
                      vision_feature_select_strategy="default", vision_feature_layer=-2,
                      tie_word_embeddings=text.tie_word_embeddings)
    return cfg


def internvl_config(text: PretrainedConfig, vision: dict, image_token_id: int) -> InternVLConfig:
    vision_config = InternVLVisionConfig(image_size=INTERNVL_TILE, patch_size=INTERNVL_PATCH, **vision)
    tokens = int((INTERNVL_TILE // INTERNVL_PATCH) ** 2 * INTERNVL_DOWNSAMPLE ** 2)
    return InternVLConfig(vision_config=vision_config, text_config=text.to_dict(), image_token_id=image_token_id,
                          image_seq_length=tokens, downsample_ratio=INTERNVL_DOWNSAMPLE,
                          projector_hidden_act="gelu", vision_feature_layer=-1,
                          vision_feature_select_strategy="default",
                          tie_word_embeddings=text.tie_word_embeddings)
