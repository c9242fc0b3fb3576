"""Rotary position embedding of the decoder's q and k in one kernel (``kernels/ops/rotary.py``) on CUDA.

Why: transformers' Llama-type attention applies it as ten elementwise kernels per layer; at batch 139 on the H100
they took ~34 us per layer of a decode step, ~1 ms per step of InternVL2.5-8B's language model (docs/BENCHMARKS.md).

How: the attention's ``forward`` calls the function ``apply_rotary_pos_emb`` of its modeling module, so that name
is replaced there by a wrapper that runs the kernel on inputs it takes (CUDA, fp16/bf16, the usual shapes; the
Triton interpreter on CPU under ``TRITON_INTERPRET=1``) and the original function on anything else. The kernel
reproduces torch's roundings, so a module is patched only where the original and the kernel give the same bits on a
random input: a model whose rotary rule differs (interleaved pairs, partial rotary) keeps its own. The replacement
is per modeling module, so it holds for every model of that module in the process, with the same results.
Not for sharded models (the other swaps of ``load_model`` skip them too).

On the CPU (``fuse_rotary(model, "cpu", cpu_path=True)`` at load) the same wrapper takes a torch path with fewer
temporaries, but only while the thread is inside one of mmkv's own CPU forwards (``CPU.active``, set by
``mmkv/models/cpu_forward.py``): transformers' ``generate`` on the same model keeps its own code.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch import nn

from kernels import use_triton
from kernels.ops.rotary import rotary, supports

NAME = "apply_rotary_pos_emb"


CPU = threading.local()  # .active: inside one of mmkv's CPU forwards (mmkv/models/cpu_forward.py) on this thread


def _cpu_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with two half-width temporaries instead of four full ones, rounded the
    same way: ``(-b) * s == -(b * s)`` and ``a + (-c) == a - c`` exactly in IEEE arithmetic."""
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h] -= x[..., h:] * sin[..., :h]
    out[..., h:] += x[..., :h] * sin[..., h:]
    return out


def _cpu_ok(q, k, cos, sin) -> bool:
    return (getattr(CPU, "active", False) and q.device.type == "cpu" and not q.requires_grad
            and q.shape[-1] % 2 == 0 and cos.shape[-1] == q.shape[-1] == k.shape[-1] and cos.dim() == 3)


def _wrap(orig):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kw):
        if not args and kw in ({}, {"unsqueeze_dim": 1}):
            if use_triton(q) and supports(q, k, cos, sin):
                return rotary(q, k, cos, sin, check=False)
            if _cpu_ok(q, k, cos, sin):
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                return _cpu_rope(q, cos, sin), _cpu_rope(k, cos, sin)
        return orig(q, k, cos, sin, *args, **kw)

    apply_rotary_pos_emb.mmkv_original = orig
    apply_rotary_pos_emb.__doc__ = orig.__doc__
    return apply_rotary_pos_emb


def _same_bits(orig, wrapped, heads: int, head_dim: int, device, dtype, cpu_path: bool = False) -> bool:
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(2, 3, heads, head_dim, generator=g).to(device, dtype).transpose(1, 2)
    k = torch.randn(2, 3, 2, head_dim, generator=g).to(device, dtype).transpose(1, 2)
    ang = torch.rand(2, 3, head_dim // 2, generator=g) * 100
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    before = getattr(CPU, "active", False)
    if not cpu_path and not supports(q, k, cos, sin):
        return False
    with torch.no_grad():
        try:
            want = orig(q, k, cos, sin)
        except Exception:  # another signature: not the rule the kernel follows
            return False
        CPU.active = cpu_path  # the path under test only
        try:
            got = wrapped(q, k, cos, sin)
        finally:
            CPU.active = before
    return (isinstance(want, tuple) and len(want) == 2
            and all(torch.equal(a, b) for a, b in zip(want, got, strict=True)))


def fuse_rotary(model: nn.Module, device_type: str = "cuda", cpu_path: bool = False) -> int:
    """Replace ``apply_rotary_pos_emb`` in the modeling module of every attention of ``model`` on ``device_type``
    that has one, where the kernel (``cpu_path``: the CPU path, taken inside mmkv's CPU forwards only) reproduces
    it; returns how many modules were patched (0 for a sharded model)."""
    if getattr(model, "hf_device_map", None):
        return 0
    patched = 0
    seen = set()
    for mod in model.modules():
        module = sys.modules.get(type(mod).__module__)
        orig = getattr(module, NAME, None)
        head_dim = getattr(mod, "head_dim", None)
        proj = getattr(mod, "q_proj", None)
        if (module is None or module in seen or not callable(orig) or hasattr(orig, "mmkv_original")
                or not isinstance(head_dim, int) or not isinstance(getattr(proj, "weight", None), torch.Tensor)):
            continue
        w = proj.weight
        if w.device.type != device_type:
            continue
        seen.add(module)
        wrapped = _wrap(orig)
        if _same_bits(orig, wrapped, max(1, w.shape[0] // head_dim), head_dim, w.device, w.dtype, cpu_path):
            setattr(module, NAME, wrapped)
            patched += 1
    return patched
