"""A demo tower's weights on disk: the fp16 export that ``mmkv.models.demo`` loads, a new run's start from such an
export, and both towers' sizes (``python -m eval.train.towers --sizes``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def export(model, vision: dict, out: Path, meta: dict | None = None) -> Path:
    from safetensors.torch import save_file

    inner = model.model
    tensors = {f"{prefix}.{k}": v.detach().half().cpu().contiguous()
               for prefix, module in (("vision_tower", inner.vision_tower),
                                      ("multi_modal_projector", inner.multi_modal_projector))
               for k, v in module.state_dict().items()}
    save_file(tensors, str(out / "tower.safetensors"))
    (out / "tower.json").write_text(json.dumps({"vision": vision, **(meta or {})}, indent=1))
    return out / "tower.safetensors"


def sizes(config_for) -> dict:
    """Parameter counts and fp16 bytes of both towers at ``config_for(name)`` (meta device: nothing is allocated)."""
    from transformers import AutoConfig, InternVLForConditionalGeneration, LlavaForConditionalGeneration

    from mmkv.models import smollm2
    from mmkv.models.configs import internvl_config, llava_config

    text = AutoConfig.from_pretrained(smollm2.ensure_converted()[0])
    out = {}
    for name, build_cfg, cls in (("demo-llava", llava_config, LlavaForConditionalGeneration),
                                 ("demo-internvl", internvl_config, InternVLForConditionalGeneration)):
        with torch.device("meta"):
            m = cls(build_cfg(text, config_for(name), image_token_id=0))
        tower = sum(p.numel() for p in m.model.vision_tower.parameters())
        proj = sum(p.numel() for p in m.model.multi_modal_projector.parameters())
        out[name] = {"tower": tower, "projector": proj, "fp16_mb": 2 * (tower + proj) / 1e6}
    return out


def init_from(model, folder: Path) -> None:
    """Tower and projector weights from an exported folder (``tower.safetensors``; fp16 read into fp32)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(folder) / "tower.safetensors"))
    inner = model.model
    for prefix, module in (("vision_tower.", inner.vision_tower), ("multi_modal_projector.", inner.multi_modal_projector)):
        module.load_state_dict({k[len(prefix):]: v.float() for k, v in state.items() if k.startswith(prefix)})
