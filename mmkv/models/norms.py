"""transformers' RMSNorm modules swapped for one-kernel ones on CUDA (``kernels/ops/rmsnorm.py``).

Why: ``LlamaRMSNorm`` (and the Qwen2/Mistral copies of it) runs ~8 small kernels per call, and a 32-layer decoder
calls it 65 times per decode step. On the H100 (``random:internvl2.5-8b``, eager under the profiler) the swap took the
fp16 step at batch 11 from 10.52 to 9.35 ms and the 1-bit CalibQuant step at batch 139 from 13.17 to 11.61 ms
(docs/BENCHMARKS.md, budget section). The swap keeps the module's
weight (the same Parameter: no copy) and epsilon, and is made only for a class whose output on a random input
matches ``kernels.reference.rms_norm`` (so a norm with another rule, e.g. Gemma's ``1 + weight``, keeps its own
forward). Not for a sharded model (accelerate's hooks sit on the modules).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import reference
from kernels.ops.rmsnorm import MAX_N, rms_norm


class FusedRMSNorm(nn.Module):
    """Drop-in for a Llama-type RMSNorm: the one-kernel norm on CUDA tensors of the weight's dtype (rows of up to
    ``kernels.ops.rmsnorm.MAX_N`` values), the torch reference elsewhere."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype and x.shape[-1] <= MAX_N:
            return rms_norm(x, self.weight, self.variance_epsilon)
        return reference.rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, one kernel"


def _follows_reference(norm: nn.Module) -> bool:
    w = norm.weight
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g, device=w.device).to(w.dtype)
    with torch.no_grad():
        got = norm(x)
        ref = reference.rms_norm(x, w, norm.variance_epsilon)
    return got.shape == ref.shape and got.dtype == ref.dtype and torch.allclose(got.float(), ref.float(), rtol=1e-2,
                                                                                 atol=1e-3)


def fuse_rms_norms(model: nn.Module, device_type: str = "cuda") -> int:
    """Swap every RMSNorm module of ``model`` on ``device_type`` whose class follows the Llama rule for a
    ``FusedRMSNorm``; returns how many were swapped."""
    if getattr(model, "hf_device_map", None):
        return 0
    ok: dict = {}
    swaps = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if (not type(mod).__name__.endswith("RMSNorm") or isinstance(mod, FusedRMSNorm)
                or not isinstance(getattr(mod, "variance_epsilon", None), float)
                or not isinstance(w, nn.Parameter) or w.dim() != 1 or w.device.type != device_type):
            continue
        if type(mod) not in ok:
            ok[type(mod)] = _follows_reference(mod)
        if ok[type(mod)]:
            swaps.append(name)
    for name in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, FusedRMSNorm(getattr(parent, attr)))
    return len(swaps)
