"""AQUA-KV's per-layer codec: linear predictors from the previous layer, the residual quantized (App. A, Alg. 2-3).

Tensors are token-major ``[..., C]`` with ``C = H * D`` (every KV head's channels of one token, head-major):
the predictors of a layer map all of the previous layer's heads to all of this layer's (Sec. 3.2; GQA keeps
``C`` small). Keys are pre-RoPE.

* layer 0: ``K_q = Q(K)``, ``V_q = Q(V)`` (the first layer has no predictor; quantized at ``first_bits``, Table 1);
* layer l: ``K^ = Q^-1(Q(K - f_key(K^_prev))) + f_key(K^_prev)`` and
  ``V^ = Q^-1(Q(V - f_value([V^_prev ; K^]))) + f_value([V^_prev ; K^])`` (Alg. 2 lines 5-9, Alg. 3 lines 5-7).

The same functions run in calibration (Alg. 1 feeds ``K^, V^`` forward) and in the cache (flush = encode, read =
decode), so the predictors are trained on exactly the reconstructions the runtime feeds them.

Input order of the value predictor: mmkv concatenates ``[V^_prev ; K^]`` (``v_weight[:C]`` multiplies the previous
layer's values, ``v_weight[C:]`` this layer's keys); the reference code concatenates ``[K^ ; V^_prev]``
(``aquakv/cache_utils.py::predict_next_value_states``, ``train_predictors.py``). A linear map is the same either
way with its rows swapped, and mmkv's calibration and cache agree, so nothing differs in what is computed; a
weight matrix taken from the reference's predictors would need its two ``C``-row halves swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aquakv_quant import Codes, Quantizer

NAMES = ("k_weight", "k_bias", "v_weight", "v_bias")


@dataclass
class Predictors:
    """Layers ``1..L-1``: ``k_weight [L-1, C, C]``, ``k_bias [L-1, C]``, ``v_weight [L-1, 2C, C]``, ``v_bias``.

    Stored in fp16 (``nbytes`` counts what is stored); applied in fp32 (:meth:`to`)."""

    k_weight: torch.Tensor
    k_bias: torch.Tensor
    v_weight: torch.Tensor
    v_bias: torch.Tensor

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Predictors:
        missing = [n for n in NAMES if n not in t]
        if missing:
            raise ValueError(f"aquakv: the artifact lacks predictor tensors {missing}")
        return cls(*(t[n] for n in NAMES))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in NAMES}

    @property
    def num_layers(self) -> int:
        return self.k_weight.shape[0] + 1

    @property
    def channels(self) -> int:
        return self.k_weight.shape[-1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device, dtype=torch.float32) -> Predictors:
        return Predictors(*(t.to(device, dtype) for t in self.tensors().values()))

    def key(self, layer: int, k_prev: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.k_bias[layer - 1], k_prev.reshape(-1, k_prev.shape[-1]),
                           self.k_weight[layer - 1]).view(k_prev.shape)

    def value(self, layer: int, v_prev: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        c = self.channels  # [V_prev ; K] @ W = V_prev @ W[:C] + K @ W[C:], without materializing the concatenation
        w = self.v_weight[layer - 1]
        out = torch.addmm(self.v_bias[layer - 1], v_prev.reshape(-1, c), w[:c])
        return out.addmm_(k.reshape(-1, c), w[c:]).view(k.shape)


def encode(layer: int, k: torch.Tensor, v: torch.Tensor, prev: tuple | None, pred: Predictors | None,
           qk: Quantizer, qv: Quantizer) -> tuple[Codes, Codes, torch.Tensor, torch.Tensor]:
    """Alg. 2 for one layer: ``k`` (pre-RoPE), ``v`` ``[..., C]`` -> ``(K_q, V_q, K^, V^)`` (fp32 reconstructions,
    what the next layer's predictors take). ``prev = (K^_prev, V^_prev)``; ``pred=None`` quantizes directly."""
    k, v = k.float(), v.float()
    use = pred is not None and layer > 0
    if use and prev is None:
        raise RuntimeError(f"aquakv: layer {layer} encodes without layer {layer - 1}'s reconstruction")
    k_pred = pred.key(layer, prev[0]) if use else None
    kq, k_hat = qk.encode_decode(k - k_pred if use else k)
    if use:
        k_hat = k_hat + k_pred
    v_pred = pred.value(layer, prev[1], k_hat) if use else None
    vq, v_hat = qv.encode_decode(v - v_pred if use else v)
    if use:
        v_hat = v_hat + v_pred
    return kq, vq, k_hat, v_hat


def decode(layer: int, kq: Codes, vq: Codes, prev: tuple | None, pred: Predictors | None, qk: Quantizer,
           qv: Quantizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 3 for one layer: codes -> ``(K^, V^)`` fp32 (pre-RoPE keys)."""
    use = pred is not None and layer > 0
    if use and prev is None:
        raise RuntimeError(f"aquakv: layer {layer} decodes without layer {layer - 1}'s reconstruction")
    k_hat = qk.decode(kq)
    if use:
        k_hat += pred.key(layer, prev[0])
    v_hat = qv.decode(vq)
    if use:
        v_hat += pred.value(layer, prev[1], k_hat)
    return k_hat, v_hat
