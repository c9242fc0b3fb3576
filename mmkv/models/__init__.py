"""Load a text LLM or a VLM with what the quantized KV cache needs to know about it.

    lm = mmkv.load_model("demo-llava")  # model, processor, adapter = ... unpacks it
    batch = lm.prepare([{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                                     {"type": "text", "text": "What is this?"}]}])
    batch.visual_mask  # True exactly at the 576 image-token positions

Names: ``available_models()`` (built-ins: the embedded SmolLM2, ``demo-*`` VLMs with a small trained (shipped) or random vision tower,
``random:*`` full-size shapes with random weights), or any local folder / hub id of a supported family.
The language model's attention is switched to mmkv's (``mmkv.attention.install_attention``) before return.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mmkv.attention import install_attention

from . import sharding
from .adapter import Adapter
from .head import pad_lm_head
from .inputs import Prepared, prepare_inputs
from .mlp import fuse_silu_mul
from .norms import fuse_rms_norms
from .projections import fuse_projections, share_cpu_storage
from .random_models import random_config
from .registry import BUILTIN, DEFAULT_MODEL, available_models, load_by_name, resolve_device_dtype
from .rotary import fuse_rotary
from .video import load_video_frames

__all__ = ["Adapter", "BUILTIN", "DEFAULT_MODEL", "LoadedModel", "Prepared", "available_models", "load_model",
           "load_video_frames", "prepare_inputs", "random_config"]


@dataclass
class LoadedModel:
    """``model, processor, adapter = load_model(name)`` unpacks it; the object also keeps them together."""

    model: Any
    processor: Any
    adapter: Adapter
    load_seconds: float = 0.0

    def __iter__(self):
        yield self.model
        yield self.processor
        yield self.adapter

    @property
    def name(self) -> str:
        return self.adapter.name

    def prepare(self, inputs, device=None, **kw) -> Prepared:
        """``inputs.prepare_inputs`` with this model's adapter and processor."""
        return prepare_inputs(self.adapter, inputs, self.processor, device=device, **kw)

    def __repr__(self) -> str:
        a = self.adapter
        dev = getattr(self.model, "device", "?")
        dtype = getattr(self.model, "dtype", "?")
        label = f", synthetic={a.synthetic!r}" if a.synthetic else ""
        return (f"LoadedModel(name={a.name!r}, family={a.family!r}, layers={a.num_layers}, "
                f"q_heads={a.num_q_heads}, kv_heads={a.num_kv_heads}, head_dim={a.head_dim}, "
                f"visual_token_ids={a.visual_token_ids}, device={dev}, dtype={dtype}{label})")


def load_model(name: str = DEFAULT_MODEL, device=None, dtype=None, trust_remote_code: bool = False,
               device_map=None, max_memory=None, **kw) -> LoadedModel:
    """Load ``name`` on ``device`` (default: cuda if available, else cpu) in ``dtype`` (default fp16 on GPU,
    fp32 on CPU). ``trust_remote_code`` is never enabled implicitly. Extra keyword arguments go to
    ``from_pretrained`` for hub/folder models; ``tiny=True`` builds a small test variant of a ``random:*``
    model. ``device_map`` (``"auto" | "balanced" | "sequential" | "layers" | {module: device}``) and
    ``max_memory`` (``{0: "70GiB", 1: "70GiB"}`` or ``"0=70GiB,1=70GiB"``) shard the model over several GPUs
    with accelerate instead (``sharding.py``; ``device`` must then be left out). Raises ValueError (bad name,
    unsupported architecture, remote code needed, bad device map) or ImportError (a missing optional package,
    with the pip command)."""
    start = time.perf_counter()
    if device_map is not None:
        if device is not None:
            raise ValueError("pass either device or device_map, not both (device_map places every layer)")
        sharding.check_device_map(device_map)
        max_memory = sharding.parse_max_memory(max_memory)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # only picks the default dtype
    elif max_memory is not None:
        raise ValueError("max_memory only applies with device_map (e.g. device_map='auto')")
    device, dtype = resolve_device_dtype(device, dtype)
    model, processor, adapter = load_by_name(name, device, dtype, trust_remote_code=trust_remote_code,
                                             device_map=device_map, max_memory=max_memory, **kw)
    model.requires_grad_(False)  # inference only: no autograd graphs, no .grad buffers
    pad_lm_head(model)
    fuse_rms_norms(model)
    fuse_projections(model)
    share_cpu_storage(model)
    fuse_rotary(model)
    fuse_rotary(model, "cpu", cpu_path=True)  # active only inside mmkv's own CPU forwards (mmkv/models/cpu_forward.py)
    fuse_silu_mul(model)
    if adapter.takes_images:
        vision = getattr(model.model, "vision_tower", None)
        adapter.pixel_dtype = next(vision.parameters()).dtype if vision is not None else dtype
    install_attention(adapter.lm_config)
    return LoadedModel(model, processor, adapter, load_seconds=time.perf_counter() - start)
