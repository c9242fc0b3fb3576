"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) processors that need no torchvision.

transformers 5 ships a PIL backend for Qwen's image processor (``Qwen2VLImageProcessorPil``, which
``AutoImageProcessor`` picks when torchvision is absent) but its video processors are torchvision-only, and a
processor whose video-processor class cannot be built cannot be built at all. torchvision is not added as a
dependency: the PyPI wheel matching this machine's CPU torch fails to import beside it, and the model itself
needs nothing from it. So mmkv keeps the family's own processor classes (their placeholder expansion: one
``<|image_pad|>`` per merged patch, Qwen3-VL's per-frame ``<t seconds>`` timestamps) and hands them a small video
processor, ``VideoPatches``, that builds the model's video input the way transformers' ``Qwen2VLVideoProcessor``
does: every frame resized to one grid (Qwen2-VL's ``smart_resize`` within the video size bounds), rescaled and
normalized by the checkpoint's own image processor, frames grouped by ``temporal_patch_size`` (the last frame
repeated to fill a group) and flattened in the patch order the vision tower reads. The PIL resize differs from
torchvision's by resampling round-off only; grids and token counts follow the rule above (Qwen3-VL's own video
processor budgets pixels over the whole clip, so its token count for a long clip can be smaller).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .video import Clip

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


class VideoPatches:
    """Frames -> ``pixel_values_videos`` / ``video_grid_thw`` / ``video_metadata`` (see the module docstring)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, image_processor, size: dict | None = None, image_mean=None, image_std=None,
                 patch_size: int | None = None, temporal_patch_size: int | None = None, merge_size: int | None = None):
        self.image_processor = image_processor
        self.size = dict(size or image_processor.size)
        self.image_mean = image_mean if image_mean is not None else image_processor.image_mean
        self.image_std = image_std if image_std is not None else image_processor.image_std
        self.patch_size = patch_size or image_processor.patch_size
        self.temporal_patch_size = temporal_patch_size or image_processor.temporal_patch_size
        self.merge_size = merge_size or image_processor.merge_size

    @classmethod
    def from_config(cls, image_processor, cfg: dict | None) -> VideoPatches:
        cfg = cfg or {}
        size = cfg.get("size")
        if size is None and ("min_pixels" in cfg or "max_pixels" in cfg):
            size = {"shortest_edge": cfg.get("min_pixels"), "longest_edge": cfg.get("max_pixels")}
        return cls(image_processor, size=size, image_mean=cfg.get("image_mean"), image_std=cfg.get("image_std"),
                   patch_size=cfg.get("patch_size"), temporal_patch_size=cfg.get("temporal_patch_size"),
                   merge_size=cfg.get("merge_size"))

    def _frames(self, clip) -> np.ndarray:
        from transformers.image_utils import SizeDict

        ip = self.image_processor
        size = SizeDict(shortest_edge=self.size["shortest_edge"], longest_edge=self.size["longest_edge"])
        out = []
        for frame in clip:
            x = ip.process_image(frame, do_convert_rgb=True)
            x = ip.resize(x, size=size, resample=ip.resample, factor=self.patch_size * self.merge_size)
            x = ip.rescale(x, ip.rescale_factor)
            out.append(ip.normalize(x, self.image_mean, self.image_std).astype(np.float32))
        if len({f.shape for f in out}) != 1:
            raise ValueError(f"the frames of a video must share one size, got {sorted({f.shape for f in out})}")
        return np.stack(out)

    def patchify(self, frames: np.ndarray) -> tuple[torch.Tensor, list[int]]:
        """``[T, C, H, W]`` -> ``[grid_t * grid_h * grid_w, C * tps * p * p]`` in the vision tower's order."""
        p, m, tps = self.patch_size, self.merge_size, self.temporal_patch_size
        if pad := -len(frames) % tps:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, 0)])
        t, c, h, w = frames.shape
        gt, gh, gw = t // tps, h // p, w // p
        x = torch.from_numpy(frames).view(gt, tps, c, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gt * gh * gw, c * tps * p * p), [gt, gh, gw]

    def __call__(self, videos, **_):
        from transformers.image_processing_utils import BatchFeature
        from transformers.video_utils import VideoMetadata

        if not isinstance(videos, (list, tuple)) or not videos or not all(isinstance(v, Clip) for v in videos):
            raise ValueError("the Qwen-VL video input is a list of mmkv.models.video.Clip (frames with their indices "
                             "and frame rate)")
        patches, grids, meta = [], [], []
        for clip in videos:
            x, grid = self.patchify(self._frames(clip))
            patches.append(x)
            grids.append(grid)
            h, w = clip[0].height, clip[0].width
            meta.append(VideoMetadata(total_num_frames=clip.total, fps=clip.native_fps, width=w, height=h,
                                      duration=clip.total / clip.native_fps, frames_indices=list(clip.indices)))
        return BatchFeature({"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids),
                             "video_metadata": meta})


def _without_video_processor(base):
    """``base`` (a Qwen-VL processor class) built with ``VideoPatches`` in place of its torchvision video processor.

    transformers checks each sub-processor against the class its signature names, and the video-processor class is
    a placeholder without torchvision; taking ``video_processor`` out of ``__init__``'s signature takes it out of
    that check (as ``processors.InternVLImageTextProcessor`` does), and the attribute is set afterwards, which is
    all ``ProcessorMixin.__call__`` reads."""

    class Processor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, video: VideoPatches | None = None,
                     **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
            self.video_processor = video or VideoPatches(image_processor)

    Processor.__name__ = Processor.__qualname__ = base.__name__ + "NoTorchvision"
    return Processor


def processor_class(model_type: str):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    bases = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor,
             "qwen3_vl_moe": Qwen3VLProcessor}  # the MoE checkpoints ship Qwen3-VL's processor
    if model_type not in bases:
        raise ValueError(f"not a Qwen-VL model_type: {model_type!r}; expected one of {MODEL_TYPES}")
    return _without_video_processor(bases[model_type])


def _read_json(name: str, filename: str, **shared) -> dict | None:
    from transformers.utils import cached_file

    path = cached_file(name, filename, _raise_exceptions_for_missing_entries=False, **shared)
    return json.loads(Path(path).read_text()) if path else None


def _chat_template(name: str, tokenizer, **shared) -> str | None:
    from transformers.utils import cached_file

    path = cached_file(name, "chat_template.jinja", _raise_exceptions_for_missing_entries=False, **shared)
    if path:
        return Path(path).read_text()
    cfg = _read_json(name, "chat_template.json", **shared)
    return (cfg or {}).get("chat_template") or tokenizer.chat_template


def load_processor(name: str, model_type: str, **shared):
    """The checkpoint's tokenizer, image processor (PIL backend), chat template and video size bounds
    (``video_preprocessor_config.json``; the image bounds where it has none)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, **shared)
    # the PIL backend even where torchvision is installed: VideoPatches calls its numpy resize/normalize
    image_processor = AutoImageProcessor.from_pretrained(name, backend="pil", **shared)
    video = VideoPatches.from_config(image_processor, _read_json(name, "video_preprocessor_config.json", **shared))
    return processor_class(model_type)(image_processor=image_processor, tokenizer=tokenizer,
                                       chat_template=_chat_template(name, tokenizer, **shared), video=video)


# --- random:qwen2.5-vl-7b: SmolLM2's tokenizer + Qwen's special tokens and image processor --------------------------

TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# SmolLM2's ChatML (processors.py) with Qwen's image and video placeholders, bracketed as Qwen's template does.
_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5-VL-7B-Instruct's preprocessor_config.json (min/max_pixels) and Qwen2VLVideoProcessor's video bounds.
IMAGE_PIXELS = {"shortest_edge": 3136, "longest_edge": 12845056}  # 56 x 56 .. 28 x 28 x 16384
VIDEO_PIXELS = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}


def random_processor(tokenizer_folder, model_type: str = "qwen2_5_vl"):
    """Qwen's processor around the SmolLM2 tokenizer: 14-px patches merged 2 x 2 (one token per 28 x 28 px), the
    released checkpoints' pixel bounds, so an image costs the visual tokens it costs the real model."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_folder, extra_special_tokens=list(TOKENS))
    tok.padding_side = "left"
    ip = Qwen2VLImageProcessorPil(size=dict(IMAGE_PIXELS), patch_size=14, merge_size=2, temporal_patch_size=2)
    return processor_class(model_type)(image_processor=ip, tokenizer=tok, chat_template=_CHATML,
                                       video=VideoPatches(ip, size=dict(VIDEO_PIXELS)))
