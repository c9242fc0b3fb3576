"""``demo-llava`` and ``demo-internvl``: the real SmolLM2-135M language model behind a small vision tower.

Why: real LLaVA/InternVL weights cannot be fetched here, yet the cache, kernels and UI must be exercised on a
real VLM forward with real processors and the real number of visual tokens per image (576 / 256 per tile).
The language model is real (so text after the image is real text). The vision tower and projector are either
trained on generated images and clips (``eval/train/towers.py``; shipped in ``assets/demo_towers/<name>/``, used by
default when present) or random (fixed seed, so runs repeat); the adapter's ``synthetic`` says which. Which one:
``tower_dir`` ("auto": the shipped weights if present, else random; "random"/None; a folder), and when it is
"auto", the environment variable ``MMKV_DEMO_TOWER`` (same values; the test suite sets "random" so its fast tests
keep the tiny random tower).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from . import smollm2
from .adapter import adapter_for
from .configs import TINY_VISION, internvl_config, llava_config
from .processors import internvl_processor, llava_processor, visual_token_ids

DEMO_NAMES = ("demo-llava", "demo-internvl")
SYNTHETIC = "random vision tower"
TRAINED = "vision tower trained on generated images (eval/synth); answers about real photos are not meaningful"
SEED = 0
SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "demo_towers"
TOWER_ENV = "MMKV_DEMO_TOWER"
# demo-internvl's dynamic-tiling cap (GotOcr2 ``max_patches``; a thumbnail is added when there are >1 tiles): the
# trainer tiles with the same processor, so train and inference agree. Real InternVL2.5 uses 12 (6 in many evals);
# 4 keeps a training row at <= 5 x 256 visual tokens.
DEMO_MAX_TILES = 4


def shipped_tower(name: str) -> Path | None:
    """``assets/demo_towers/<name>/`` when it holds trained weights, else None."""
    d = SHIPPED / name
    return d if (d / "tower.safetensors").is_file() and (d / "tower.json").is_file() else None


def tower_vision(folder) -> dict:
    """The vision config an exported tower folder was trained with (its ``tower.json``)."""
    return json.loads((Path(folder) / "tower.json").read_text())["vision"]


def resolve_tower(name: str, tower_dir="auto") -> Path | None:
    """The folder of trained weights to load, or None for the random tower (see the module docstring)."""
    if tower_dir == "auto":
        tower_dir = os.environ.get(TOWER_ENV) or "auto"
    if tower_dir is None or tower_dir == "random":
        return None
    if tower_dir == "auto":
        return shipped_tower(name)
    d = Path(tower_dir).expanduser()
    if not (d / "tower.safetensors").is_file() or not (d / "tower.json").is_file():
        raise ValueError(f"{d} holds no trained tower (tower.safetensors and tower.json, written by "
                         "python -m eval.train.towers --export)")
    return d


def _padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def grow_vocab(source_lm, vocab_size: int) -> None:
    """Widen the (tied) embedding table for the added tokens (``<image>``, ``<img>``, ...); new rows start at the
    mean embedding so those tokens are in-distribution for the real language model."""
    old = source_lm.get_input_embeddings().weight.shape[0]
    source_lm.resize_token_embeddings(vocab_size, mean_resizing=False)
    with torch.no_grad():
        emb = source_lm.get_input_embeddings().weight
        emb[old:] = emb[:old].mean(0)
        head = source_lm.get_output_embeddings().weight
        if head.data_ptr() != emb.data_ptr():
            head[old:] = head[:old].mean(0)


def assemble(cls, config, source_lm):
    """The VLM with ``source_lm`` as its language model (moved in, not copied) and a fresh seeded vision tower.

    The skeleton is built on the meta device, so the 135M language-model parameters are never randomly
    initialized only to be overwritten (that alone took seconds on CPU).
    """
    from transformers import AutoModel

    config.text_config = source_lm.config  # one config object: what install_attention edits is what layers read
    with torch.device("meta"):
        model = cls(config)
    inner = model.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        inner.vision_tower = AutoModel.from_config(config.vision_config)
        inner.multi_modal_projector = type(inner.multi_modal_projector)(config)
    inner.language_model = source_lm.model
    model.lm_head = source_lm.lm_head
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"demo model has uninitialized tensors: {left[:5]}")
    return model


def load_demo(name: str, device, dtype, vision: dict | None = None, tower_dir="auto"):
    """(model, processor, adapter) for ``demo-llava`` / ``demo-internvl``.

    ``tower_dir``: "auto" (the shipped trained weights when present, else random; ``MMKV_DEMO_TOWER`` overrides),
    "random" or None (the seeded random tower of size ``vision``, default ``TINY_VISION``), or a folder with trained
    weights (``tower.safetensors`` and its ``tower.json``, written by ``eval.train.towers --export``), whose
    config replaces ``vision``; the adapter says which."""
    from transformers import (
        AutoModelForCausalLM,
        InternVLForConditionalGeneration,
        LlavaForConditionalGeneration,
    )

    folder, _ = smollm2.ensure_converted()
    if name == "demo-llava":
        processor = llava_processor(folder)
        build, cls, family, frames = llava_config, LlavaForConditionalGeneration, "llava", 8
    elif name == "demo-internvl":
        processor = internvl_processor(folder, max_tiles=DEMO_MAX_TILES)
        build, cls, family, frames = internvl_config, InternVLForConditionalGeneration, "internvl", 16
    else:
        raise ValueError(f"unknown demo model {name!r}; expected one of {DEMO_NAMES}")
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    grow_vocab(source, _padded_vocab(len(processor.tokenizer)))
    synthetic = SYNTHETIC
    tower_dir = resolve_tower(name, tower_dir)
    if tower_dir is not None:
        vision = tower_vision(tower_dir)
        synthetic = TRAINED
    config = build(source.config, dict(vision or TINY_VISION), image_token_id=processor.image_token_id)
    if name == "demo-llava":
        # LLaVA-1.5 reads CLIP's penultimate layer; in a 4-layer demo tower that would leave a quarter of it unused.
        config.vision_feature_layer = -1
    model = assemble(cls, config, source)
    if tower_dir is not None:
        from safetensors.torch import load_file

        state = load_file(str(Path(tower_dir) / "tower.safetensors"))
        inner = model.model
        for prefix, module in (("vision_tower.", inner.vision_tower),
                               ("multi_modal_projector.", inner.multi_modal_projector)):
            module.load_state_dict({k[len(prefix):]: v.float() for k, v in state.items() if k.startswith(prefix)})
    model = model.to(device=device, dtype=dtype).eval()
    model.config.name_or_path = name
    adapter = adapter_for(name, family, model.config.text_config, visual_token_ids(processor), synthetic,
                          default_video_frames=frames)
    return model, processor, adapter
