"""Real transformers processors (LlavaProcessor, InternVLProcessor) around the SmolLM2 tokenizer.

Used by ``demo-*`` (real SmolLM2 language model) and ``random:*`` (random weights): both need a processor that
expands image placeholders into exactly as many visual tokens as the real checkpoints do (576 per LLaVA-1.5
image, 256 per InternVL tile), without downloading the real checkpoints' processor files.

torchvision is not installed here, so both use the PIL image-processor backends that transformers ships
(``CLIPImageProcessorPil``, ``GotOcr2ImageProcessorPil``); they produce the same tensors as the torchvision ones
up to resampling round-off. InternVL's video processor needs torchvision, so mmkv feeds video to InternVL as
per-frame images in the family's own ``Frame{i}: <img>...</img>`` layout (see ``inputs.py``).
"""

from __future__ import annotations

from pathlib import Path

from transformers import InternVLProcessor

LLAVA_IMAGE_TOKEN = "<image>"
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

# SmolLM2's own ChatML template, extended to content lists (text / image items), as LLaVA and InternVL
# templates do. ``{placeholder}`` is what the processor later expands into visual tokens.
_CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '@PLACEHOLDER@\\n' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class InternVLImageTextProcessor(InternVLProcessor):
    """``InternVLProcessor`` without its video processor, whose base class needs torchvision.

    transformers checks every sub-processor's class when a processor is built; with torchvision absent the
    video-processor class is a placeholder and the check fails even for ``video_processor=None``. Dropping the
    argument from ``__init__``'s signature takes video out of the processor's attributes; images and text go
    through the unchanged ``InternVLProcessor.__call__`` (mmkv sends video as per-frame images anyway).
    """

    def __init__(self, image_processor=None, tokenizer=None, image_seq_length: int = 256, chat_template=None,
                 **kwargs):
        super().__init__(image_processor, tokenizer, None, image_seq_length=image_seq_length,
                         chat_template=chat_template, **kwargs)


def chat_template(placeholder: str) -> str:
    return _CHATML.replace("@PLACEHOLDER@", placeholder)


def llava_processor(tokenizer_folder: Path, image_size: int = 336, patch_size: int = 14):
    """LLaVA-1.5's processor: CLIP preprocessing (resize shortest edge, center crop) and ``<image>`` expanded to
    ``(image_size / patch_size) ** 2`` tokens (CLS dropped by the "default" feature strategy)."""
    from transformers import AutoTokenizer, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_folder, extra_special_tokens=[LLAVA_IMAGE_TOKEN])
    tok.padding_side = "left"
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=patch_size,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=chat_template(LLAVA_IMAGE_TOKEN), image_token=LLAVA_IMAGE_TOKEN)


def internvl_processor(tokenizer_folder: Path, tile_size: int = 448, tokens_per_tile: int = 256,
                       max_tiles: int = 12):
    """InternVL's processor: dynamic tiling into ``tile_size`` crops plus a thumbnail, each tile
    ``<img>`` + ``tokens_per_tile`` x ``<IMG_CONTEXT>`` + ``</img>``."""
    from transformers import AutoTokenizer
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_folder, extra_special_tokens=dict(INTERNVL_TOKENS))
    tok.padding_side = "left"
    # InternVL normalizes with ImageNet statistics (its -hf preprocessor_config), not CLIP's.
    image_processor = GotOcr2ImageProcessorPil(size={"height": tile_size, "width": tile_size},
                                               crop_to_patches=True, min_patches=1, max_patches=max_tiles,
                                               image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    return InternVLImageTextProcessor(
        image_processor=image_processor, tokenizer=tok, image_seq_length=tokens_per_tile,
        chat_template=chat_template(INTERNVL_TOKENS["context_image_token"]))


def visual_token_ids(processor) -> tuple[int, ...]:
    """The ids that mark visual positions: LLaVA's ``<image>``; InternVL's ``<IMG_CONTEXT>`` (the ``<img>``
    and ``</img>`` brackets are ordinary text embeddings, not vision features)."""
    return (int(processor.image_token_id),)
