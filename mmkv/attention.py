"""The ``mmkv`` attention implementation, registered with transformers' attention interface.

* prefill (no history): exact attention (torch SDPA) on the prompt's fp16 K/V, with transformers' mask;
* decode (one new token): ``kernels.decode_attention`` reads every segment of the layer as stored (packed codes,
  post-scaling, calibration), one fused pass on GPU; nothing rebuilds the layer's fp16 K/V;
* extend (a later chat turn, or chunked scoring): the new tokens attend to the stored history and causally to each
  other, merged by log-sum-exp; on the CPU both through PyTorch's fused attention (``kernels/decode/cpu.py``); on
  the GPU the history through the decode kernels with the new tokens folded into query rows
  (``kernels/decode/extend.py``: codes read as stored), the layouts they do not read exactly through the reference,
  and the new tokens' causal part in fp32; a sliding-window layer's extend masks by window in PyTorch's fused
  attention (``mmkv/cache/sliding.py``: it holds one fp16 segment of at most its window).

transformers does not pass the cache to attention functions, so ``MMKVLayer.update`` tags the key tensor it
returns with ``(layer, mode)``; untagged keys (a plain ``DynamicCache``, or no cache) get ordinary SDPA.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kernels
from kernels.decode import cpu_row
from kernels.decode.cpu import causal_attention_cpu, history_attention_cpu
from kernels.decode.extend import extend_attention, extend_kernel_ok
from kernels.reference import attention_over_segments, merge_partials

from .cache.sliding import window_attention

NAME = "mmkv"
LAST_ROW = "_mmkv_last_row"  # set on an attention module while its prefill attends for the last position only


def causal_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention of the new tokens among themselves: ``(out, lse)`` in fp32 for a log-sum-exp merge."""
    hq, hk = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(hq // hk, dim=1)
    v = v.float().repeat_interleave(hq // hk, dim=1)
    x = torch.einsum("bhqd,bhtd->bhqt", q.float(), k) * scale
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    x = x.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(x, dim=-1)
    out = torch.einsum("bhqt,bhtd->bhqd", torch.softmax(x, dim=-1), v)
    return out, lse


def last_row_attention(sdpa, module, query, key, value, attention_mask, **kwargs):
    """The prefill attention of the last position: ``sdpa`` (transformers' SDPA forward) over the query's and the
    mask's last rows, as ``[B, T, H, D]`` with that row repeated by a zero stride (the module reshapes it to its
    input's rows; ``o_proj`` then reads only the last)."""
    mask = attention_mask[..., -1:, :] if attention_mask is not None else None
    out, weights = sdpa(module, query[:, :, -1:], key, value, mask, **kwargs)
    return out.expand(out.shape[0], query.shape[2], *out.shape[2:]), weights


def mmkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    tag = getattr(key, "_mmkv", None)
    if tag is None or tag[1] == "prefill":
        if tag is not None and getattr(module, LAST_ROW, False):  # mmkv/models/last_row.py
            return last_row_attention(sdpa_attention_forward, module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer, mode = tag
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    if mode == "decode":
        segs = layer.segments()
        todo = cpu_row.plan(query, segs) if kernels.use_cpu_path(query) else None
        if todo is not None:  # one row on the CPU, a short history: straight to the compiled loops
            return cpu_row.attend(query, todo, scale)[0].transpose(1, 2).to(query.dtype), None
        out = kernels.decode_attention(query[:, :, 0], segs, scale)
        return out.unsqueeze(1).to(query.dtype), None
    if layer.is_sliding:  # each new token sees only its own window of the held tokens (mmkv/cache/sliding.py)
        return window_attention(layer, query, key, value, scale).to(query.dtype).contiguous(), None
    if kernels.use_cpu_path(query):
        o_hist, lse_hist = history_attention_cpu(query, layer.segments(), scale)
        o_new, lse_new = causal_attention_cpu(query, key, value, scale)
    else:
        segs = layer.segments()
        if kernels.use_triton(query) and extend_kernel_ok(segs):
            out = extend_attention(query, segs, key, value, scale)
            return out.transpose(1, 2).to(query.dtype).contiguous(), None
        o_hist, lse_hist = attention_over_segments(query, segs, scale)
        o_new, lse_new = causal_partial(query, key, value, scale)
    out = merge_partials([o_hist, o_new], [lse_hist, lse_new])
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def register() -> None:
    AttentionInterface.register(NAME, mmkv_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def install_attention(lm_config) -> None:
    """Make the language model's attention layers use ``mmkv`` (vision towers keep their own implementation)."""
    register()
    lm_config._attn_implementation = NAME


register()
