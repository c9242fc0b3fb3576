"""User inputs -> left-padded model inputs with a visual-token mask.

Accepted forms (all families): a prompt string; a chat (list of ``{"role", "content"}`` where content is a
string or a list of ``{"type": "text"|"image"|"video", ...}`` items); a LongTensor of ids (``[T]`` or
``[B, T]``); or a list of prompts/chats, which is a batch. Images are file paths or PIL images, videos are
file paths or already decoded frames (``{"type": "video", "frames": [PIL images]}``, sampled like a file's
frames: what the demo towers' trainer feeds, so training and inference see the same layout). Batches are padded on the left so that every row's last token is the next-token position, which is
what batched decoding and the cache's "recent window" assume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .adapter import Adapter
from .video import MAX_FRAMES, load_video_frames, sample_indices

_IMAGE_KEYS = ("image", "path", "url")
_VIDEO_KEYS = ("video", "path", "url")


@dataclass
class Prepared:
    """Model-ready inputs for one batch. ``model_kwargs`` holds everything else the forward needs."""

    input_ids: torch.LongTensor  # [B, T], left-padded
    attention_mask: torch.LongTensor  # [B, T]
    visual_mask: torch.BoolTensor  # [B, T], True where a visual (image/video) token sits
    model_kwargs: dict = field(default_factory=dict)

    def to(self, device) -> Prepared:
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.model_kwargs.items()}
        return Prepared(self.input_ids.to(device), self.attention_mask.to(device), self.visual_mask.to(device), kw)


def load_image(src):
    """An RGB ``PIL.Image`` from a path, a PIL image or an HxWx3 array; ValueError names a bad file."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if isinstance(src, Image.Image):
        return src.convert("RGB")
    if isinstance(src, np.ndarray):
        return Image.fromarray(src).convert("RGB")
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise ValueError(f"image URLs are not fetched (no network access): {src}; pass a local file")
    if not isinstance(src, (str, Path)):
        raise ValueError(f"an image must be a file path or a PIL image, got {type(src).__name__}")
    path = Path(src).expanduser()
    if not path.is_file():
        raise ValueError(f"image file not found: {path}")
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{path} is not a readable image ({e.__class__.__name__}: {e})") from e


def _payload(item: dict, keys: tuple[str, ...], kind: str):
    for k in keys:
        if item.get(k) is not None:
            return item[k]
    raise ValueError(f"a {kind} content item needs one of the keys {keys}: {item!r}")


def _sample_frames(frames, num_frames: int | None, fps: float | None, native_fps: float | None) -> list:
    """Decoded frames sampled as ``load_video_frames`` samples a file's (middles of equal segments, or ``fps``)."""
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ValueError("a video item's 'frames' must be a non-empty list of images")
    if fps is not None and native_fps is None:
        raise ValueError("sampling decoded frames at a rate (video_fps) needs the item's own 'fps'")
    idx = sample_indices(len(frames), native_fps or 1.0, num_frames, fps, MAX_FRAMES)
    return [load_image(frames[i]) for i in idx]


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(m, dict) for m in x)


class _Conversation:
    """One sample: messages with images/videos replaced by template placeholders, plus the images in order."""

    def __init__(self, adapter: Adapter, raw, video_frames: int | None, video_fps: float | None):
        self.images: list = []
        self.videos: list = []  # native video inputs (Qwen-VL, OneVision); other families get a video as per-frame images
        self.has_video = False
        if isinstance(raw, str):
            raw = [{"role": "user", "content": raw}]
        if not _is_chat(raw):
            raise ValueError("each input must be a prompt string or a chat (a list of {'role', 'content'} dicts), "
                             f"got {type(raw).__name__}")
        self.messages = [self._message(adapter, m, video_frames, video_fps) for m in raw]
        has_text = any(it["type"] == "text" and it["text"].strip() for m in self.messages for it in m["content"])
        if not has_text and not self.images and not self.videos:
            raise ValueError("empty prompt: the input has no text and no images")

    def _message(self, adapter, m: dict, video_frames, video_fps) -> dict:
        if "role" not in m or "content" not in m:
            raise ValueError(f"a chat message needs 'role' and 'content' keys: {m!r}")
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ValueError(f"message content must be a string or a list of items, got {type(content).__name__}")
        items = []
        for it in content:
            kind = it.get("type") if isinstance(it, dict) else None
            if kind == "text":
                items.append({"type": "text", "text": str(it.get("text", ""))})
            elif kind in ("image", "video") and not adapter.takes_images:
                raise ValueError(f"{adapter.name} is a text-only model; it does not take {kind}s "
                                 "(load a VLM such as demo-llava or llava-hf/llava-1.5-7b-hf)")
            elif kind == "video" and not adapter.takes_video:
                raise ValueError(f"{adapter.name} ({adapter.family}) takes images, not videos, in mmkv")
            elif kind == "image":
                self.images.append(load_image(_payload(it, _IMAGE_KEYS, "image")))
                items.append({"type": "image"})
            elif kind == "video":
                n = None if video_fps is not None else (video_frames or adapter.default_video_frames)
                if it.get("frames") is not None:
                    frames = _sample_frames(it["frames"], n, video_fps, it.get("fps"))
                else:
                    frames = load_video_frames(_payload(it, _VIDEO_KEYS, "video"), num_frames=n, fps=video_fps)
                self.has_video = True
                if adapter.family in ("qwen_vl", "llava_onevision"):  # the model's own video input
                    self.videos.append(frames)
                    items.append({"type": "video"})
                    continue
                # Each frame becomes its own visual span, labelled the way InternVL's video prompt does.
                for i, frame in enumerate(frames):
                    items += [{"type": "text", "text": f"Frame{i + 1}: "}, {"type": "image"}]
                    self.images.append(frame)
            else:
                raise ValueError(f"unknown content item (type must be text, image or video): {it!r}")
        return {"role": m["role"], "content": items}

    def text_only_messages(self) -> list[dict]:
        # Text models' templates (SmolLM2, Llama, Qwen) expect string content.
        return [{"role": m["role"], "content": "".join(it["text"] for it in m["content"])} for m in self.messages]


def _render(template_owner, messages: list[dict]) -> str:
    return template_owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _add_special(tokenizer, text: str) -> bool:
    """Add BOS only if the chat template did not already write it (SmolLM2/Llama-3 do, LLaVA-1.5 does not)."""
    bos = tokenizer.bos_token
    return not (bos and text.startswith(bos))


def template_ids(adapter: Adapter, chat, processor) -> torch.Tensor:
    """The chat's template text tokenized with its media placeholders left as they are (no pixels processed): the
    ids ``prepare_inputs`` has before the processor expands each placeholder into its image's tokens. Trainers use
    it to share one image's processed prefix among several questions."""
    conv = _Conversation(adapter, chat, None, None)
    tokenizer = getattr(processor, "tokenizer", processor)
    if adapter.family == "text":
        text = _render(tokenizer, conv.text_only_messages())
    else:
        text = _render(processor, conv.messages)
    return tokenizer(text, add_special_tokens=_add_special(tokenizer, text), return_tensors="pt").input_ids[0]


def _from_ids(adapter: Adapter, ids: torch.Tensor) -> Prepared:
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() not in (1, 2):
        raise ValueError(f"token ids must be an integer tensor of shape [T] or [B, T], got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    ids = ids.long().reshape(-1, ids.shape[-1])
    if ids.numel() == 0:
        raise ValueError("empty prompt: the id tensor has no tokens")
    return Prepared(ids, torch.ones_like(ids), adapter.visual_mask(ids), {})


def _batch(inputs) -> list:
    if isinstance(inputs, str) or _is_chat(inputs):
        return [inputs]
    if isinstance(inputs, (list, tuple)):
        if not inputs:
            raise ValueError("empty prompt: the input list is empty")
        return list(inputs)
    raise ValueError(f"unsupported input type {type(inputs).__name__}: give a string, a chat, a list of them, "
                     "or a LongTensor of token ids")


def prepare_inputs(adapter: Adapter, inputs, processor, device=None, video_frames: int | None = None,
                   video_fps: float | None = None) -> Prepared:
    if isinstance(inputs, torch.Tensor):
        out = _from_ids(adapter, inputs)
        return out.to(device) if device is not None else out
    for x in _batch(inputs):
        if isinstance(x, str) and not x.strip():
            raise ValueError("empty prompt: the prompt string is empty or whitespace")
    convs = [_Conversation(adapter, x, video_frames, video_fps) for x in _batch(inputs)]
    tokenizer = getattr(processor, "tokenizer", processor)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    common = {"padding": True, "padding_side": "left", "return_tensors": "pt"}

    if adapter.family == "text":
        if tokenizer.chat_template:
            texts = [_render(tokenizer, c.text_only_messages()) for c in convs]
        else:  # a base model without a template: the plain text of the turns
            texts = ["\n".join(m["content"] for m in c.text_only_messages()) for c in convs]
        enc = tokenizer(texts, add_special_tokens=_add_special(tokenizer, texts[0]), **common)
    else:
        texts = [_render(processor, c.messages) for c in convs]
        images = [im for c in convs for im in c.images]
        if adapter.family == "llava_onevision" and images:  # per sample: several images take its multi-image layout
            images = [c.images for c in convs]
        videos = [v for c in convs for v in c.videos]
        kw = {"videos": videos} if videos else {}
        if adapter.family == "internvl" and any(c.has_video for c in convs):
            kw["crop_to_patches"] = False  # InternVL's video recipe: one 448 px tile per frame, no tiling
        enc = processor(text=texts, images=images or None, add_special_tokens=_add_special(tokenizer, texts[0]),
                        **common, **kw)
    enc = dict(enc)
    ids, mask = enc.pop("input_ids"), enc.pop("attention_mask")
    if adapter.family != "gemma3":  # Gemma 3 needs them: they mark its image tokens, which see each other both ways
        enc.pop("token_type_ids", None)
    pixel_dtype = getattr(adapter, "pixel_dtype", None)
    for key in ("pixel_values", "pixel_values_videos"):
        if pixel_dtype is not None and key in enc:
            enc[key] = enc[key].to(pixel_dtype)
    out = Prepared(ids.long(), mask.long(), adapter.visual_mask(ids), enc)
    return out.to(device) if device is not None else out
