"""Collect a model's queries, keys and values on calibration text (WikiText-2 ``valid.txt`` by default).

The language model runs plain forwards (no cache) over consecutive windows of the text with a capturing attention
function in place of mmkv's; per layer it records ``q [N, Hq, D]``, ``k, v [N, H, D]`` (N tokens over all windows),
keys and queries after RoPE as the cache sees them. ``unrotate_keys`` turns post-RoPE keys back into pre-RoPE keys
(AQUA-KV predicts those) with the model's own rotary embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..paths import wikitext

CAPTURE = "mmkv_capture"


@dataclass
class Collected:
    q: list[torch.Tensor]  # per layer [N, Hq, D]
    k: list[torch.Tensor]  # per layer [N, H, D], post-RoPE
    v: list[torch.Tensor]  # per layer [N, H, D]
    positions: torch.Tensor  # [N] position of each token inside its window
    meta: dict  # what was used: file, tokens, windows, fraction


def text_windows(tokenizer, path: str | Path, seq_len: int, max_tokens: int, fraction: float = 1.0) -> torch.Tensor:
    """``[n, seq_len]`` token windows from the start of ``path``: ``fraction`` of the file, at most ``max_tokens``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration text {path} not found (WikiText-2 valid.txt, or pass --data FILE)")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    text = path.read_text(encoding="utf-8")
    text = text[: max(1, int(len(text) * fraction))]
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    n = min(len(ids), max_tokens) // seq_len
    if n == 0:
        raise ValueError(f"{path} (fraction {fraction}) gives {len(ids)} tokens, fewer than one window of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def collect_qkv(lm, path: str | Path | None = None, seq_len: int = 512, max_tokens: int = 8192,
                fraction: float = 1.0, dtype: torch.dtype = torch.float16) -> Collected:
    """Run the language model of ``lm`` (a ``LoadedModel``) over calibration windows and keep every layer's q/k/v.

    Memory: ``N * (Hq + 2H) * D`` elements per layer in ``dtype`` on the CPU (SmolLM2, 8192 tokens: ~0.5 GB fp16).
    ``path`` None: WikiText-2 ``valid.txt`` (``mmkv.paths.wikitext``).
    """
    path = wikitext("valid") if path is None else path
    model, processor, adapter = lm
    tok = getattr(processor, "tokenizer", processor)
    windows = text_windows(tok, path, seq_len, max_tokens, fraction)
    store = {"q": [[] for _ in range(adapter.num_layers)], "k": [[] for _ in range(adapter.num_layers)],
             "v": [[] for _ in range(adapter.num_layers)]}

    def capture(module, query, key, value, attention_mask, **kw):
        i = module.layer_idx
        for name, x in (("q", query), ("k", key), ("v", value)):  # [B, heads, T, D] -> [B*T, heads, D]
            store[name][i].append(x.detach().transpose(1, 2).flatten(0, 1).to("cpu", dtype))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(CAPTURE, capture)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    cfg = adapter.lm_config
    previous = cfg._attn_implementation
    cfg._attn_implementation = CAPTURE
    device = model.get_input_embeddings().weight.device
    lm_model = language_model(model)
    try:
        with torch.inference_mode():
            for row in windows:
                lm_model(input_ids=row[None].to(device), use_cache=False)
    finally:
        cfg._attn_implementation = previous
    out = {name: [torch.cat(parts) for parts in per_layer] for name, per_layer in store.items()}
    positions = torch.arange(seq_len).repeat(windows.shape[0])
    meta = {"data": str(path), "fraction": fraction, "seq_len": seq_len, "windows": int(windows.shape[0]),
            "tokens": int(windows.numel())}
    return Collected(out["q"], out["k"], out["v"], positions, meta)


def language_model(model):
    """The decoder stack that owns the attention layers (the VLMs' ``language_model``, Idefics3/SmolVLM's
    ``text_model``, else the model's base)."""
    for attr in ("language_model", "model"):
        inner = getattr(model, attr, None)
        if inner is not None and inner is not model:
            if hasattr(inner, "layers"):
                return inner
            for name in ("language_model", "text_model"):
                deeper = getattr(inner, name, None)
                if deeper is not None and hasattr(deeper, "layers"):
                    return deeper
    if hasattr(model, "layers"):
        return model
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def rope_cos_sin(model, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [N, D]`` of the model's rotary embedding at ``positions [N]``."""
    rot = language_model(model).rotary_emb
    dummy = torch.zeros(1, dtype=dtype, device=rot.inv_freq.device)
    cos, sin = rot(dummy, positions.to(rot.inv_freq.device)[None])
    return cos[0].to(dtype), sin[0].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (the rotate-half convention of Llama/Qwen/Mistral): ``k [N, H, D]``, ``cos/sin [N, D]`` (moved to
    ``k``'s device: collected K/V live on the CPU while a GPU model's rotary tables do not)."""
    cos, sin = cos.to(k.device), sin.to(k.device)
    return k * cos[:, None] + _rotate_half(k) * sin[:, None]


def unrotate_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation: post-RoPE keys -> pre-RoPE keys."""
    cos, sin = cos.to(k.device), sin.to(k.device)
    return k * cos[:, None] - _rotate_half(k) * sin[:, None]
