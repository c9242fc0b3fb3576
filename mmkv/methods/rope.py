"""RoPE from a model's config, for caches that store keys before RoPE and re-apply it on read (AQUA-KV Sec. 3.3).

The cache never sees the model, only its adapter (config and shapes), so the rotary tables are rebuilt from the
config the way transformers builds them (``inv_freq`` and ``attention_scaling`` of the config's ``rope_type``);
``tests/test_aquakv.py`` checks them against the model's own ``rotary_emb``. Rotate-half convention
(Llama/Qwen/Mistral), as ``mmkv.calibrate.collect.rotate_keys``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNSUPPORTED = ("dynamic",)  # frequencies that change with the sequence length cannot be undone per token


@dataclass
class Rope:
    inv_freq: torch.Tensor  # [D / 2] fp32
    scaling: float

    @classmethod
    def from_config(cls, cfg, head_dim: int) -> Rope:
        if cfg is None:
            raise ValueError("aquakv needs the model's config for RoPE (adapter.lm_config is None)")
        if getattr(cfg, "partial_rotary_factor", 1.0) not in (None, 1.0):
            raise ValueError("aquakv: models with partial rotary embeddings are not supported")
        params = getattr(cfg, "rope_parameters", None) or {}
        kind = params.get("rope_type", "default")
        if kind in UNSUPPORTED or "mrope_section" in params:
            raise ValueError(f"aquakv: rope_type {kind!r} (or multimodal RoPE) is not supported")
        if kind == "default":
            theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            return cls(inv, 1.0)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        return cls(inv.float(), float(scaling))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [..., D]`` fp32 at integer ``positions [...]``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        f = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([f, f], -1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [..., D]`` with ``cos, sin`` broadcastable to it."""
    return x * cos + _rotate_half(x) * sin


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation (exact for ``scaling == 1``; divides by ``scaling**2`` otherwise)."""
    return (x * cos - _rotate_half(x) * sin) / (cos * cos + sin * sin)
