"""What mmkv's own forwards of a model on the CPU run with: a context installed for the span of one forward.

transformers' modules are written for every device; on a 2-core CPU four things cost mmkv's prefill and decode
time that the same values can be had without (docs/BENCHMARKS.md, "CPU generation"):

* a decode step's linear layers run on one thread (MKL's gemv): their output rows are shared among torch's threads
  (``kernels/ops/row_linear.py``, ``MMKV_CPU_SPLIT_LINEAR``);
* q, k and v are three GEMMs over one input: one GEMM over their joined weights
  (``mmkv.models.projections.cpu_groups``, ``MMKV_CPU_GROUP_LINEAR``);
* rotary embedding (transformers': four prompt-sized temporaries for q and for k) writes its output and two
  half-width products (``mmkv.models.rotary``, where the modeling module's ``apply_rotary_pos_emb`` is wrapped at
  load and takes this path only inside the context, ``MMKV_CPU_ROPE``);
* the gated MLP ``down(silu(gate(x)) * up(x))`` allocates four prompt-sized intermediates per layer (50 MB each for
  SmolLM2 at 8k tokens, fresh pages every layer): the activation and the product run in place on the gate's output,
  and a prompt of more than ``MLP_ROWS`` rows goes through in pieces of at most that many rows, into two buffers reused
  across pieces (``MMKV_CPU_INPLACE_MLP``; one SmolLM2 MLP at 8k tokens: 332-363 ms as transformers runs it, 288-317
  in place on the whole prompt, 250-267 in pieces, no page faults).

Each gives the same bits as the module's own forward on SmolLM2 (tests/test_cpu_forward.py), except that the MLP's
pieces may round a prompt's rows differently in the last bit for other shapes or thread counts (MKL splits a
product among its threads by its shape); an MLP class whose in-place forward does not reproduce its own on a random
input of a few rows keeps its own. Outside the context the model object is unchanged, so transformers' ``generate``
on the same object runs as it always does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from kernels.ops.row_linear import SplitLinears
from kernels.switches import switch

from . import rotary
from .projections import cpu_groups

MLP_ROWS = 1024  # rows of a prompt's MLP at a time: its two intermediates stay 1024 x I (6 MB each for SmolLM2)


def _plain(lin) -> bool:
    return type(lin) is torch.nn.Linear and lin.bias is None


def _inplace_mlp(mod, rows: int = MLP_ROWS):
    plain = all(_plain(getattr(mod, n)) for n in ("gate_proj", "up_proj", "down_proj"))

    def forward(x):
        xs = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled() and (x.requires_grad or mod.gate_proj.weight.requires_grad):
            return mod.down_proj(mod.act_fn(mod.gate_proj(x)) * mod.up_proj(x))  # in place would break autograd
        if not plain or xs.shape[0] <= rows:
            g = mod.gate_proj(x)
            F.silu(g, inplace=True)
            g.mul_(mod.up_proj(x))
            return mod.down_proj(g)
        # A long prompt in pieces: whole-prompt intermediates (50 MB each for SmolLM2 at 8k) come from fresh pages
        # every layer (~25k page faults a layer) and spill the caches; two buffers reused across pieces do neither.
        # Pieces of equal size (at least rows / 2): MKL rounds a few-row product differently from the whole one.
        # Even so a piece's product may differ from the whole one's in the last bit (MKL shares a product among its
        # threads by its shape): on SmolLM2 with 2 threads they agreed bit for bit at every length tried.
        n = xs.shape[0]
        size = -(-n // -(-n // rows))
        wg, wu, wd = mod.gate_proj.weight, mod.up_proj.weight, mod.down_proj.weight
        out = xs.new_empty(n, wd.shape[0])
        gb, ub = xs.new_empty(size, wg.shape[0]), xs.new_empty(size, wu.shape[0])
        for s in range(0, n, size):
            piece = xs[s : s + size]
            m = piece.shape[0]
            g = torch.mm(piece, wg.t(), out=gb[:m])
            F.silu(g, inplace=True)
            g.mul_(torch.mm(piece, wu.t(), out=ub[:m]))
            torch.mm(g, wd.t(), out=out[s : s + m])
        return out.view(*x.shape[:-1], wd.shape[0])

    return forward


def _silu_mlps(model) -> list:
    out = []
    for mod in model.modules():
        act = getattr(mod, "act_fn", None)
        if (all(isinstance(getattr(mod, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
                and type(act).__name__ in ("SiLU", "SiLUActivation") and "forward" not in vars(mod)
                and mod.gate_proj.weight.device.type == "cpu"):
            out.append(mod)
    return out


_SAME: dict = {}  # MLP class -> whether the in-place forward gave its own forward's bits


def _same_bits(mod) -> bool:
    if type(mod) not in _SAME:
        w = mod.gate_proj.weight
        x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        with torch.inference_mode():
            _SAME[type(mod)] = torch.equal(mod(x), _inplace_mlp(mod)(x))
    return _SAME[type(mod)]


class CpuForward:
    """``with CpuForward(model):`` the three changes above; the weights are taken when it is made (one per
    generation)."""

    def __init__(self, model, split: bool, groups: bool, inplace_mlp: bool, rope: bool = False):
        self.rope = rope
        self.linears = SplitLinears(model, cpu_groups(model) if groups else (), split=split)
        self.mlps = {m: _inplace_mlp(m) for m in _silu_mlps(model) if _same_bits(m)} if inplace_mlp else {}

    def __enter__(self):
        self.linears.__enter__()
        for mod, fwd in self.mlps.items():
            mod.__dict__["forward"] = fwd
        self.rope_before = getattr(rotary.CPU, "active", False)
        rotary.CPU.active = self.rope
        return self

    def __exit__(self, *exc):
        rotary.CPU.active = self.rope_before
        for mod in self.mlps:
            mod.__dict__.pop("forward", None)
        return self.linears.__exit__(*exc)


def cpu_forward(model, devices=None):
    """The context for one of mmkv's forwards of ``model``: :class:`CpuForward` on the CPU as the switches say, a
    no-op context elsewhere."""
    from .sharding import model_devices

    devices = devices if devices is not None else model_devices(model)
    if devices[0].type != "cpu":
        return contextlib.nullcontext()
    flags = [switch(n) == "1" for n in ("MMKV_CPU_SPLIT_LINEAR", "MMKV_CPU_GROUP_LINEAR", "MMKV_CPU_INPLACE_MLP",
                                        "MMKV_CPU_ROPE")]
    return CpuForward(model, *flags) if any(flags) else contextlib.nullcontext()
