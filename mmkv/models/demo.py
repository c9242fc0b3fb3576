"""``demo-llava`` and ``demo-internvl``: the real SmolLM2-135M language model behind a small random vision tower.

Why: real LLaVA/InternVL weights cannot be fetched here, yet the cache, kernels and UI must be exercised on a
real VLM forward with real processors and the real number of visual tokens per image (576 / 256 per tile).
The language model is real (so text after the image is real text), the vision tower and projector are random
(fixed seed, so runs repeat), and every adapter says ``synthetic="random vision tower"``. Nothing is cached:
building takes about a second on top of loading SmolLM2.
"""

from __future__ import annotations

import json
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


def load_demo(name: str, device, dtype, vision: dict | None = None, tower_dir=None):
    """(model, processor, adapter) for ``demo-llava`` / ``demo-internvl``.

    ``vision``: the tower's size (default ``TINY_VISION``); ``tower_dir``: a folder with trained weights
    (``tower.safetensors`` and its ``tower.json``, written by ``eval.train.towers --export``), which replace the
    random tower and projector; the adapter then says so."""
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
        processor = internvl_processor(folder)
        build, cls, family, frames = internvl_config, InternVLForConditionalGeneration, "internvl", 16
    else:
        raise ValueError(f"unknown demo model {name!r}; expected one of {DEMO_NAMES}")
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    grow_vocab(source, _padded_vocab(len(processor.tokenizer)))
    synthetic = SYNTHETIC
    if tower_dir is not None:
        vision = json.loads((Path(tower_dir) / "tower.json").read_text())["vision"]
        synthetic = TRAINED
    config = build(source.config, dict(vision or TINY_VISION), image_token_id=processor.image_token_id)
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
