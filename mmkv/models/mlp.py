"""The gated MLP's ``silu(gate) * up`` in one kernel (``kernels/ops/silu_mul.py``) on CUDA.

Why: transformers' Llama-type MLP (``down(act(gate(x)) * up(x))``) runs the activation and the product as two
elementwise kernels; at batch 139 on the H100 they took 6.6 us each per layer of InternVL2.5-8B's language model
(docs/BENCHMARKS.md). How: each such MLP module gets its own ``forward`` that calls the same three projections and
the one kernel in between where it takes the tensors (CUDA fp16/bf16; the torch expression elsewhere). The kernel
follows torch's arithmetic, so a class is patched only where the patched and the original forward give the same
bits on a random input; an MLP with another activation or layout keeps its own. Not for sharded models.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from kernels import use_triton
from kernels.ops.silu_mul import DTYPES, silu_mul, supports


def _forward(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    if use_triton(gate) and supports(gate, up):
        return self.down_proj(silu_mul(gate, up, check=False))
    return self.down_proj(self.act_fn(gate) * up)


def _is_silu_mlp(mod: nn.Module) -> bool:
    act = getattr(mod, "act_fn", None)
    return (all(isinstance(getattr(mod, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLU", "SiLUActivation") and "forward" not in vars(mod))


def _same_bits(mod: nn.Module) -> bool:
    w = next(mod.parameters())
    x = torch.randn(3, mod.gate_proj.in_features, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        want = mod(x)
        got = _forward(mod, x)
    return torch.equal(want, got)


def fuse_silu_mul(model: nn.Module, device_type: str = "cuda") -> int:
    """Give every Llama-type SiLU MLP of ``model`` on ``device_type`` the one-kernel forward where it reproduces
    the module's own; returns how many modules were patched (0 for a sharded model)."""
    if getattr(model, "hf_device_map", None):
        return 0
    ok: dict = {}
    patched = 0
    for mod in model.modules():
        if not _is_silu_mlp(mod) or not isinstance(getattr(mod.gate_proj, "in_features", None), int):
            continue
        w = next(mod.parameters(), None)
        if w is None or w.device.type != device_type or w.dtype not in DTYPES:
            continue
        if type(mod) not in ok:
            ok[type(mod)] = _same_bits(mod)
        if ok[type(mod)]:
            mod.forward = types.MethodType(_forward, mod)
            patched += 1
    return patched
