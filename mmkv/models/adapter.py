"""What the rest of mmkv needs to know about a loaded model, independent of its family.

The cache router only needs two facts from a model: the language model's shapes (to size segments) and where
visual tokens sit in ``input_ids`` (to route them to CalibQuant). ``Adapter`` holds both; ``inputs.prepare_inputs``
(or ``LoadedModel.prepare``) turns user inputs (a prompt, a chat, image/video paths, a batch) into left-padded
model inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

FAMILIES = ("text", "llava", "internvl", "idefics3", "llava_next", "llava_onevision", "qwen_vl", "gemma3")


@dataclass
class Adapter:
    name: str
    # "text" | "llava" | "internvl" | "idefics3" (Idefics3, SmolVLM) | "llava_next" | "llava_onevision" | "qwen_vl"
    # | "gemma3"
    family: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    lm_config: PretrainedConfig
    visual_token_ids: tuple[int, ...] = ()
    synthetic: str | None = None  # None (real weights) | "random vision tower" | "random weights"
    takes_images: bool = False
    takes_video: bool = False
    # LLaVA-style models were tuned on few frames, InternVL on 16 (its own video recipe).
    default_video_frames: int = 8
    # The vision tower's dtype; prepare_inputs() casts pixel_values to it so callers need not know it.
    pixel_dtype: torch.dtype | None = None
    # Qwen-VL's multimodal RoPE: the engine feeds the model its own 3-D positions (``mrope.py``), and methods that
    # re-apply 1-D RoPE to stored keys refuse it.
    mrope: bool = False
    # Per layer: the sliding window (a local layer attends to its last W tokens only, itself included) or None for
    # a full-attention layer; empty when every layer attends to everything (``sliding_windows``).
    windows: tuple[int | None, ...] = ()

    def visual_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.visual_token_ids:
            return torch.zeros_like(input_ids, dtype=torch.bool)
        ids = torch.tensor(self.visual_token_ids, device=input_ids.device, dtype=input_ids.dtype)
        return torch.isin(input_ids, ids)

    def describe(self) -> str:
        """One line for logs, UIs and result tables; says loudly when weights are not real."""
        s = (f"{self.name} [{self.family}] {self.num_layers} layers, {self.num_q_heads} q heads, "
             f"{self.num_kv_heads} kv heads, head_dim {self.head_dim}")
        return s + (f" ({self.synthetic})" if self.synthetic else "")


def sliding_windows(lm_config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers' own cache reads it (``layer_types``; without them, every layer
    slides when the config has a ``sliding_window``, as Mistral v0.1 does); ``()`` when no layer slides. Attention
    variants mmkv's attention does not implement are refused here, before any cache is built."""
    n = lm_config.num_hidden_layers
    if getattr(lm_config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{type(lm_config).__name__}: attention logit soft-capping (attn_logit_softcapping="
                         f"{lm_config.attn_logit_softcapping}) is not implemented by mmkv's attention")
    if getattr(lm_config, "use_bidirectional_attention", False):
        raise ValueError(f"{type(lm_config).__name__}: use_bidirectional_attention=True (an encoder such as "
                         "EmbeddingGemma) has no causal KV cache to compress")
    window = getattr(lm_config, "sliding_window", None)
    types = getattr(lm_config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * n
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{type(lm_config).__name__}: layer types {unknown} are not supported by mmkv's cache "
                         "(it handles full_attention and sliding_attention layers)")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"{type(lm_config).__name__}: sliding_attention layers need a positive sliding_window, "
                         f"got {window!r}")
    if "sliding_attention" not in types:
        return ()
    return tuple(window if t == "sliding_attention" else None for t in types[:n])


def adapter_for(name: str, family: str, lm_config: PretrainedConfig, visual_token_ids=(), synthetic=None,
                default_video_frames: int = 8) -> Adapter:
    """Read the language model's shapes from its config (head_dim may be implicit: hidden / heads)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    heads = lm_config.num_attention_heads
    kv = getattr(lm_config, "num_key_value_heads", None) or heads
    head_dim = getattr(lm_config, "head_dim", None) or lm_config.hidden_size // heads
    visual = family != "text"
    # Idefics3/SmolVLM and LLaVA-NeXT: images only here (their own video inputs are not wired into mmkv's video
    # path); Gemma 3 takes no video at all
    return Adapter(name=name, family=family, num_layers=lm_config.num_hidden_layers, num_q_heads=heads,
                   num_kv_heads=kv, head_dim=head_dim, lm_config=lm_config,
                   visual_token_ids=tuple(int(i) for i in visual_token_ids), synthetic=synthetic,
                   takes_images=visual, takes_video=visual and family not in ("idefics3", "llava_next", "gemma3"),
                   default_video_frames=default_video_frames, mrope=family == "qwen_vl",
                   windows=sliding_windows(lm_config))
