"""LLaVA-OneVision's processor without torchvision, video included.

transformers' ``LlavaOnevisionProcessor`` needs a video processor, and ``LlavaOnevisionVideoProcessor`` is
torchvision-only (whose PyPI wheel does not import beside the CPU torch used here). Images go through the PIL
backend of OneVision's image processor (anyres grids, as the checkpoint configures them); the processor class is
OneVision's own (its placeholder expansion: base features, unpadded grid features, newline features, and per video
``frames x pooled patches + 1`` tokens), with ``VideoFrames`` in place of the video processor. ``VideoFrames`` does
what ``LlavaOnevisionVideoProcessor`` does with its defaults: every frame resized to the video ``size`` (384x384,
bicubic), rescaled and normalized (CLIP statistics), a video ``[frames, C, H, W]``; mmkv samples the frames
(``video_frames``, default 8).
"""

from __future__ import annotations

import numpy as np
import torch

from .video import Clip

VIDEO_DEFAULTS = {"size": {"height": 384, "width": 384}, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                  "image_std": [0.26862954, 0.26130258, 0.27577711]}


class VideoFrames:
    """Clips -> ``pixel_values_videos [videos, frames, C, H, W]`` (every video the same number of frames)."""

    model_input_names = ["pixel_values_videos"]

    def __init__(self, image_processor, cfg: dict | None = None):
        cfg = {**VIDEO_DEFAULTS, **{k: v for k, v in (cfg or {}).items() if v is not None}}
        self.image_processor = image_processor
        self.size, self.image_mean, self.image_std = cfg["size"], cfg["image_mean"], cfg["image_std"]

    def _frames(self, clip) -> np.ndarray:
        from transformers.image_utils import PILImageResampling, SizeDict

        ip = self.image_processor
        size = SizeDict(height=self.size["height"], width=self.size["width"])
        out = []
        for frame in clip:
            x = ip.process_image(frame, do_convert_rgb=True)
            x = ip.resize(x, size=size, resample=PILImageResampling.BICUBIC)
            x = ip.rescale(x, ip.rescale_factor)
            out.append(ip.normalize(x, self.image_mean, self.image_std).astype(np.float32))
        return np.stack(out)

    def __call__(self, videos, **_):
        from transformers.image_processing_utils import BatchFeature

        if not isinstance(videos, (list, tuple)) or not videos or not all(isinstance(v, Clip) for v in videos):
            raise ValueError("the LLaVA-OneVision video input is a list of mmkv.models.video.Clip")
        if len({len(v) for v in videos}) != 1:
            raise ValueError(f"videos of one batch must have the same number of frames, got {[len(v) for v in videos]}")
        return BatchFeature({"pixel_values_videos": torch.from_numpy(np.stack([self._frames(v) for v in videos]))})


def processor_class():
    from transformers import LlavaOnevisionProcessor

    class LlavaOnevisionProcessorNoTorchvision(LlavaOnevisionProcessor):
        """``video_processor`` out of ``__init__``'s signature (transformers checks each sub-processor against the
        class the signature names, a placeholder without torchvision); set afterwards, which is all
        ``ProcessorMixin.__call__`` reads (as ``qwen_vl._without_video_processor`` does)."""

        def __init__(self, image_processor=None, tokenizer=None, video: VideoFrames | None = None,
                     num_image_tokens=None, vision_feature_select_strategy=None, chat_template=None,
                     image_token="<image>", video_token="<video>", vision_aspect_ratio="anyres_max_9", **kwargs):
            super().__init__(image_processor, tokenizer, None, num_image_tokens=num_image_tokens,
                             vision_feature_select_strategy=vision_feature_select_strategy,
                             chat_template=chat_template, image_token=image_token, video_token=video_token,
                             vision_aspect_ratio=vision_aspect_ratio, **kwargs)
            self.video_processor = video or VideoFrames(image_processor)

    return LlavaOnevisionProcessorNoTorchvision


PROCESSOR_KEYS = ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio", "image_token",
                  "video_token")


def load_processor(name: str, **shared):
    """The checkpoint's tokenizer, image processor (PIL backend), processor settings, chat template and video
    settings (``video_preprocessor_config.json``)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from .qwen_vl import _chat_template, _read_json

    tokenizer = AutoTokenizer.from_pretrained(name, **shared)
    image_processor = AutoImageProcessor.from_pretrained(name, backend="pil", **shared)
    cfg = _read_json(name, "processor_config.json", **shared) or {}
    kw = {k: cfg[k] for k in PROCESSOR_KEYS if cfg.get(k) is not None}
    video = VideoFrames(image_processor, _read_json(name, "video_preprocessor_config.json", **shared))
    return processor_class()(image_processor=image_processor, tokenizer=tokenizer, video=video,
                             chat_template=_chat_template(name, tokenizer, **shared), **kw)
