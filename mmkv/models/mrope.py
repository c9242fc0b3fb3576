"""Qwen-VL's multimodal RoPE positions, exactly as the model computes them, for a cache it does not manage.

The engine always passes ``position_ids`` (it numbers tokens itself: left padding, decode steps, later chat
turns), and a 2-D ``position_ids`` would make a Qwen-VL model rotate every token with one 1-D position, images
included. So for these models the engine passes ``[4, B, T]``: row 0 the 1-D text positions the attention mask is
built from (``cumsum(mask) - 1``, the engine's usual numbering), rows 1..3 the temporal/height/width positions from
the model's own ``get_rope_index`` (the same call ``generate`` makes, with the processor's ``mm_token_type_ids``,
grids and Qwen2.5-VL's ``second_per_grid_ts``). After the prompt every new token is text, whose three M-RoPE
positions equal ``text position + rope delta`` (the delta is how far the prompt's largest position sits from its
length), which is how ``generate`` continues too. A later chat turn recomputes the whole conversation's positions
with ``get_rope_index`` and feeds the part the cache has not seen: the positions a fresh run of that conversation
would give.
"""

from __future__ import annotations

import torch

ROPE_INPUTS = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def prompt_positions(model, ids: torch.Tensor, mask: torch.Tensor, kwargs: dict):
    """``([4, B, T] positions, [B] rope deltas)`` of a prompt (``kwargs``: the processor's outputs)."""
    text = (mask.long().cumsum(-1) - 1).clamp(min=0)
    extra = {k: kwargs[k] for k in ROPE_INPUTS if kwargs.get(k) is not None}
    if extra.get("image_grid_thw") is None and extra.get("video_grid_thw") is None:
        return torch.cat([text[None], text[None].expand(3, -1, -1)]), text.new_zeros(text.shape[0])
    if "mm_token_type_ids" not in extra:
        raise ValueError("Qwen-VL positions need the processor's mm_token_type_ids beside its image/video grids")
    rope, delta = model.model.get_rope_index(ids, attention_mask=mask, **extra)
    return torch.cat([text[None], rope.to(text)]), delta.reshape(-1).to(text)


def step_positions(text: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``[4, B, t]`` positions of text tokens at 1-D positions ``text [B, t]``."""
    shifted = text + delta.to(text)[:, None]
    return torch.cat([text[None], shifted[None].expand(3, -1, -1)])
