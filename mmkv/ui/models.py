"""The model the app serves: one at a time, loaded through ``mmkv.load_model`` (or a stand-in loader in tests)."""

from __future__ import annotations

import html
import threading
import traceback
from collections.abc import Callable

DEFAULT_MODEL = "smollm2-135m"
FALLBACK_CHOICES = ["smollm2-135m", "demo-llava", "demo-internvl"]
# Checkpoints of each VLM family mmkv loads through native transformers classes (docs/MODELS.md), offered in the
# model box after the built-ins. They download on first use (or load from the local Hugging Face cache offline);
# any other hub id or local folder of these families is accepted as typed.
FAMILY_HUB_IDS = {
    "llava": ["llava-hf/llava-1.5-7b-hf"],
    "internvl": ["OpenGVLab/InternVL2_5-8B-MPO-hf"],
    "idefics3": ["HuggingFaceTB/SmolVLM-256M-Instruct", "HuggingFaceTB/SmolVLM2-2.2B-Instruct"],
    "llava_next": ["llava-hf/llava-v1.6-mistral-7b-hf"],
    "llava_onevision": ["llava-hf/llava-onevision-qwen2-0.5b-ov-hf", "llava-hf/llava-onevision-qwen2-7b-ov-hf"],
    "qwen_vl": ["Qwen/Qwen2-VL-2B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct",
                "Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3-VL-30B-A3B-Instruct"],
    "gemma3": ["google/gemma-3-4b-it"],
}
MODEL_BOX_HELP = (
    "A built-in name, or a hub id or local folder of: Llama / Mistral / Qwen2-3 / Gemma 3 text models; "
    "LLaVA-1.5; InternVL (-hf); Idefics3 / SmolVLM (images); LLaVA-NeXT (images); LLaVA-OneVision (images, video); "
    "Qwen2-VL / Qwen2.5-VL / Qwen3-VL, dense or MoE (images, video); Gemma 3 (images). "
    "Native transformers classes and safetensors only; remote code is never run unless the app was started with "
    "--trust-remote-code.")


def model_choices() -> list[str]:
    """The built-in names (the ones needing no download first), then a checkpoint or two of every VLM family."""
    try:
        import mmkv

        names = list(mmkv.available_models())
    except Exception:  # the registry not importable yet: the names the product card promises
        names = list(FALLBACK_CHOICES)
    head = [n for n in FALLBACK_CHOICES if n in names]
    hub = [h for ids in FAMILY_HUB_IDS.values() for h in ids]
    return head + [n for n in names if n not in head] + [h for h in hub if h not in names]


def mmkv_loader(name: str, trust_remote_code: bool = False):
    """(engine, info, loaded model) for a registry name, hub id or local folder."""
    import mmkv

    lm = mmkv.load_model(name, trust_remote_code=True) if trust_remote_code else mmkv.load_model(name)
    ad = lm.adapter
    info = {
        "name": name,
        "family": getattr(ad, "family", "text"),
        "synthetic": getattr(ad, "synthetic", None),
        "takes_images": bool(getattr(ad, "takes_images", False)),
        "takes_video": bool(getattr(ad, "takes_video", False)),
        "num_layers": getattr(ad, "num_layers", None),
        "num_q_heads": getattr(ad, "num_q_heads", None),
    }
    return mmkv.Engine(lm), info, lm


def pick_loader(name: str) -> Callable:
    if name in ("fake", "fake-vlm"):
        from mmkv.ui.fake import fake_loader

        return fake_loader
    return mmkv_loader


class ModelHost:
    """Holds the served model. ``load`` keeps the previous model when a new one fails to load."""

    def __init__(self, loader: Callable | None = None, trust_remote_code: bool = False):
        self.loader = loader
        self.trust_remote_code = trust_remote_code
        self.engine = None
        self.info: dict | None = None
        self.lm = None
        self.error: str | None = None
        self.lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def load(self, name: str) -> dict:
        name = (name or "").strip()
        if not name:
            raise ValueError("Type a model name, a hub id or a local folder.")
        loader = self.loader or pick_loader(name)
        with self.lock:
            try:
                if self.trust_remote_code and loader is mmkv_loader:
                    engine, info, lm = loader(name, trust_remote_code=True)
                else:
                    engine, info, lm = loader(name)
            except Exception as e:
                self.error = f"Could not load {name}: {type(e).__name__}: {e}"
                traceback.print_exc()
                raise
            self.engine, self.info, self.lm, self.error = engine, info, lm, None
            return info


def badge_html(info: dict | None, error: str | None = None) -> str:
    """The model line under the picker; synthetic models carry a visible badge."""
    if error:
        return f'<div id="model-status" class="mmkv-error">⚠ {html.escape(error)}</div>'
    if not info:
        return '<div id="model-status">No model loaded.</div>'
    kinds = [k for k, on in (("images", info.get("takes_images")), ("video", info.get("takes_video"))) if on]
    reads = "text + " + " + ".join(kinds) if kinds else "text only"
    badge = ""
    if info.get("synthetic"):
        badge = f' <span id="synthetic-badge" class="mmkv-badge">⚠ {html.escape(str(info["synthetic"]))}</span>'
    return (f'<div id="model-status" data-model="{html.escape(info["name"])}">'
            f"<b>{html.escape(info['name'])}</b> · {html.escape(str(info.get('family')))} · reads {reads}{badge}</div>")
