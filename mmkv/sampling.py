"""Next-token choice: greedy, or temperature + top-p sampling from a seeded generator."""

from __future__ import annotations

import torch


def choose(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """``logits [B, V]`` -> token ids ``[B]``."""
    if not do_sample or temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def validate(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
