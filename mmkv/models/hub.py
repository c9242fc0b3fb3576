"""Hub ids and local folders: detect the family from ``config.json`` and load with the native transformers class.

Only native classes are used: a checkpoint whose config points at custom code (``auto_map`` with no
transformers class for its ``model_type``) is refused unless the caller passes ``trust_remote_code=True``;
mmkv never turns that on by itself. Weights are read with ``use_safetensors=True`` so no pickle is unpickled.
Offline, a hub id loads only if it is already in the local Hugging Face cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .adapter import adapter_for

FAMILY_OF = {"llama": "text", "mistral": "text", "qwen2": "text", "qwen3": "text", "gemma3_text": "text",
             "llava": "llava", "internvl": "internvl", "idefics3": "idefics3", "smolvlm": "idefics3",
             "llava_next": "llava_next", "llava_onevision": "llava_onevision",
             "qwen2_vl": "qwen_vl", "qwen2_5_vl": "qwen_vl", "qwen3_vl": "qwen_vl",
             "qwen3_vl_moe": "qwen_vl", "gemma3": "gemma3"}
SUPPORTED = ("text: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3 text (model_type llama/mistral/qwen2/qwen3/"
             "gemma3_text); "
             "llava: LLaVA-1.5 (llava-hf/llava-1.5-7b-hf, -13b-hf); internvl: InternVL -hf checkpoints; "
             "idefics3: Idefics3 and SmolVLM (HuggingFaceTB/SmolVLM-256M-Instruct, images); llava_next: LLaVA-NeXT "
             "-hf checkpoints (images); llava_onevision: LLaVA-OneVision -hf checkpoints (images and video); "
             "qwen_vl: Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense and MoE (Qwen/Qwen2.5-VL-7B-Instruct; images and video); "
             "gemma3: Gemma 3 (google/gemma-3-4b-it; images, sliding-window layers)")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SHARED_KW = ("revision", "cache_dir", "local_files_only", "token")  # meaningful to tokenizer and model alike


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and ".." not in name


def read_config(name: str, **kw) -> dict:
    folder = Path(name).expanduser()
    if folder.is_dir():
        f = folder / "config.json"
        if not f.is_file():
            raise ValueError(f"{folder} has no config.json, so it is not a model folder")
        return json.loads(f.read_text())
    from transformers import PretrainedConfig

    try:
        cfg, _ = PretrainedConfig.get_config_dict(name, **{k: kw[k] for k in _SHARED_KW if k in kw})
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read config.json of {name!r} (not a local folder, and not in the local "
                         f"Hugging Face cache or reachable hub): {str(e).splitlines()[0]}") from e
    return cfg


def detect_family(cfg: dict, name: str, trust_remote_code: bool = False) -> str:
    """The family (``adapter.FAMILIES``) of a config, or ValueError saying why not."""
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if model_type in FAMILY_OF:
        return FAMILY_OF[model_type]
    auto_map = cfg.get("auto_map") or {}
    if auto_map and model_type not in CONFIG_MAPPING:
        if not trust_remote_code:
            raise ValueError(
                f"{name}: config.json needs custom code from the model repository (auto_map, model_type "
                f"{model_type!r} has no transformers class). mmkv never runs remote code by itself; pass "
                "trust_remote_code=True (CLI: --trust-remote-code) only if you trust that repository.")
        if "AutoModelForCausalLM" in auto_map:
            return "text"
    raise ValueError(f"{name}: unsupported architecture (model_type={model_type!r}, "
                     f"architectures={cfg.get('architectures')}); supported families: {SUPPORTED}")


def load_processor(name: str, family: str, trust_remote_code: bool = False, model_type: str | None = None,
                   **shared):
    """The checkpoint's own processor. InternVL's ``AutoProcessor`` also loads a video processor, which needs
    torchvision and a video_preprocessor_config.json; failing either, we assemble the same processor minus video
    (image processor, tokenizer, ``image_seq_length`` from processor_config.json), which is all mmkv uses."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import cached_file, is_torchvision_available

    if family == "qwen_vl":
        from . import qwen_vl

        return qwen_vl.load_processor(name, model_type, **shared)
    if family == "llava_onevision":
        from . import onevision

        return onevision.load_processor(name, **shared)
    if family == "gemma3":
        proc = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code, **shared)
        return honour_pan_and_scan(proc)
    if family != "internvl":
        return AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code, **shared)
    if is_torchvision_available():
        try:
            return AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code, **shared)
        except (OSError, ValueError, TypeError, AttributeError):
            pass  # e.g. no video_preprocessor_config.json: the image/text processor below still serves
    from .processors import InternVLImageTextProcessor

    tokenizer = AutoTokenizer.from_pretrained(name, **shared)
    image_processor = AutoImageProcessor.from_pretrained(name, **shared)
    seq = 256
    path = cached_file(name, "processor_config.json", _raise_exceptions_for_missing_entries=False, **shared)
    if path:
        seq = json.loads(Path(path).read_text()).get("image_seq_length", seq)
    return InternVLImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=seq,
                                      chat_template=tokenizer.chat_template)


PAN_AND_SCAN = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                "pan_and_scan_min_ratio_to_activate")


def honour_pan_and_scan(processor):
    """Gemma 3's processor class passes its own pan-and-scan settings (off, crops of 256 px or more) to its image
    processor on every call, over what the checkpoint's ``preprocessor_config.json`` says (``null`` on the released
    models). A checkpoint whose config turns pan-and-scan on gets it, with the crop settings it gives."""
    ip = processor.image_processor
    if getattr(ip, "do_pan_and_scan", None):
        own = {k: getattr(ip, k) for k in PAN_AND_SCAN if getattr(ip, k, None) is not None}
        processor.images_kwargs = {**processor.images_kwargs, **own}  # this instance only, not the class's dict
    return processor


def load_hub(name: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False, **kw):
    """(model, processor, adapter) for a hub id or a local folder of a supported family."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
        InternVLForConditionalGeneration,
        LlavaForConditionalGeneration,
    )

    cfg = read_config(name, **kw)
    family = detect_family(cfg, name, trust_remote_code)
    shared = {k: kw[k] for k in _SHARED_KW if k in kw}
    model_kw = {"dtype": dtype, "use_safetensors": True, "trust_remote_code": trust_remote_code, **kw}
    sharded = model_kw.get("device_map") is not None  # several devices: from_pretrained dispatches (sharding.py)
    if not sharded and device.type != "cpu":
        model_kw["device_map"] = str(device)  # load straight onto the GPU, not through CPU memory
    cls = {"text": AutoModelForCausalLM, "llava": LlavaForConditionalGeneration,
           "internvl": InternVLForConditionalGeneration, "idefics3": AutoModelForImageTextToText,
           "llava_next": AutoModelForImageTextToText, "qwen_vl": AutoModelForImageTextToText,
           "llava_onevision": AutoModelForImageTextToText, "gemma3": AutoModelForImageTextToText}[family]
    if sharded:
        from transformers import AutoConfig

        from .sharding import hub_device_map

        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **shared)
        model_kw["device_map"] = hub_device_map(name, model_kw["device_map"], model_kw.get("max_memory"), dtype,
                                                cls, config)
    try:
        model = cls.from_pretrained(name, **model_kw)
    except OSError as e:
        why = str(e).splitlines()[0]
        if "safetensors" in why:
            raise ValueError(f"{name}: no safetensors weights ({why}); mmkv never loads pickle-based "
                             ".bin/.pt checkpoints") from e
        raise ValueError(f"{name}: could not load the weights: {why}") from e
    if device.type == "cpu" and not sharded:
        model = model.to(device)
    model.eval()
    if family == "text":
        processor = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **shared)
        tokenizer, lm_config, visual, frames = processor, model.config, (), 8
    else:
        processor = load_processor(name, family, trust_remote_code, cfg.get("model_type"), **shared)
        tokenizer, lm_config = processor.tokenizer, model.config.text_config
        visual, frames = (model.config.image_token_id,), (8 if family == "llava" else 16)
        if family in ("qwen_vl", "llava_onevision"):  # Qwen's <|vision_start|>/<|vision_end|> stay text
            visual = (model.config.image_token_id, model.config.video_token_id)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    adapter = adapter_for(name, family, lm_config, visual, None, default_video_frames=frames)
    return model, processor, adapter
