"""mmkv's CPU forwards (mmkv/models/cpu_forward.py): q|k|v as one GEMM (kernels/ops/row_linear.py,
mmkv/models/projections.py), the in-place MLP and the rotary embedding with fewer temporaries (mmkv/models/rotary.py).

The references are independent of the grouping: each projection's own ``F.linear`` on its own weight, and
transformers' forward of the same model before its weights were laid out back to back. A group's output is compared
with a tolerance (the GEMM over the joined weight may block its products differently at odd widths: rtol/atol 1e-5
for fp32 dot products of at most 97 terms), and the engine's greedy tokens must not move at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from kernels.ops import row_linear as rl
from mmkv.engine import Engine
from mmkv.models import cpu_forward as cf
from mmkv.models import rotary
from mmkv.models.cpu_forward import CpuForward
from mmkv.models.projections import cpu_groups, share_cpu_storage
from mmkv.models.rotary import fuse_rotary


def _slices(sizes, width, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    joined = torch.randn(sum(sizes), *(() if bias else (width,)), generator=g)
    parts, at = [], 0
    for n in sizes:
        parts.append(joined[at:at + n])
        at += n
    return joined, parts


@pytest.mark.parametrize("bias", [False, True])
def test_joined_finds_the_tensor_consecutive_slices_come_from(bias):
    joined, parts = _slices([5, 3, 3], 97, bias=bias)
    got = rl.joined(parts)
    assert got is not None and torch.equal(got, joined) and got.data_ptr() == joined.data_ptr()
    assert rl.joined(parts[1:]) is not None and torch.equal(rl.joined(parts[1:]), joined[5:])


def test_joined_refuses_other_layouts():
    joined, parts = _slices([5, 3, 3], 97)
    assert rl.joined([parts[0], parts[2]]) is None  # a gap
    assert rl.joined([parts[1], parts[0]]) is None  # out of order
    assert rl.joined([parts[0], parts[1].clone()]) is None  # another storage
    assert rl.joined([joined[:, :50], joined[:, 50:]]) is None  # column slices are not contiguous
    assert rl.joined([parts[0], parts[1].half()]) is None


class _Qkv(torch.nn.Module):
    """Three projections of one input whose weights (and biases) are slices of one tensor, like a laid-out layer."""

    def __init__(self, width=97, sizes=(10, 4, 4), bias=True):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(width, n, bias=bias) for n in sizes)
        share = [self.q, self.k, self.v]
        with torch.no_grad():
            for name in ("weight", "bias") if bias else ("weight",):
                j = torch.cat([getattr(m, name).detach() for m in share])
                at = 0
                for m in share:
                    p = getattr(m, name)
                    p.data = j[at:at + p.shape[0]]
                    at += p.shape[0]

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


@pytest.mark.parametrize("rows", [1, 3, rl.MAX_ROWS + 1, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_a_group_runs_one_gemm_and_gives_each_projection_its_own_output(two_threads, rows, bias):
    mod = _Qkv(bias=bias)
    x = torch.randn(2, rows, 97)
    want = [F.linear(x, m.weight.clone(), None if m.bias is None else m.bias.clone()) for m in (mod.q, mod.k, mod.v)]
    lin = rl.SplitLinears(mod, [[mod.q, mod.k, mod.v]])
    assert set(lin.forwards) == {mod.q, mod.k, mod.v}
    with lin:
        got = mod(x)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # one output: the siblings are views of the first's storage
    assert got[1].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr() == \
        got[2].untyped_storage().data_ptr()
    assert lin.stashes[0] == {}  # the last sibling released it
    assert all("forward" not in m.__dict__ for m in mod.modules())


def test_a_sibling_called_with_another_input_computes_its_own(two_threads):
    mod = _Qkv()
    x, y = torch.randn(1, 7, 97), torch.randn(1, 7, 97)
    with rl.SplitLinears(mod, [[mod.q, mod.k, mod.v]]):
        q = mod.q(x)
        k = mod.k(y)  # not the first's input: its own product
        v = mod.v(x)
    torch.testing.assert_close(k, F.linear(y, mod.k.weight, mod.k.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, F.linear(x, mod.v.weight, mod.v.bias), rtol=1e-5, atol=1e-5)
    assert k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    assert v.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()


def test_a_group_not_laid_out_in_one_storage_is_left_alone(two_threads):
    mod = torch.nn.ModuleList([torch.nn.Linear(8, 6), torch.nn.Linear(8, 6)])
    lin = rl.SplitLinears(mod, [list(mod)])
    assert lin.stashes == []
    assert set(lin.forwards) == set(mod)  # each still gets its own row split


def test_an_exception_mid_group_releases_the_output():
    mod = _Qkv()
    lin = rl.SplitLinears(mod, [[mod.q, mod.k, mod.v]], split=False)
    with pytest.raises(RuntimeError, match="boom"):
        with lin:
            mod.q(torch.randn(1, 5, 97))
            assert lin.stashes[0]
            raise RuntimeError("boom")
    assert lin.stashes[0] == {}
    assert all("forward" not in m.__dict__ for m in mod.modules())


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=131, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_share_cpu_storage_keeps_values_and_transformers_forward():
    model = _tiny_llama()
    ids = torch.randint(0, 131, (1, 19))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        want = model(ids).logits
    assert share_cpu_storage(model) == 2  # q|k|v of two layers
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for group in cpu_groups(model):
        assert rl.joined([m.weight for m in group]) is not None
        assert all(type(m) is torch.nn.Linear for m in group)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want)
        with rl.SplitLinears(model, cpu_groups(model), split=False):
            torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_inplace_mlp_gives_the_modules_own_bits():
    model = _tiny_llama()
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 23, 96)
    with torch.inference_mode():
        want = mlp(x)
        with CpuForward(model, split=False, groups=False, inplace_mlp=True) as fwd:
            assert set(fwd.mlps) == {layer.mlp for layer in model.model.layers}
            got = mlp(x)
    assert torch.equal(got, want)
    assert all("forward" not in vars(layer.mlp) for layer in model.model.layers)


@pytest.mark.parametrize("n", [65, 200, 257])
def test_a_long_prompt_goes_through_the_mlp_in_pieces(n, monkeypatch):
    model = _tiny_llama()
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, n, 96, generator=torch.Generator().manual_seed(n))
    sizes = []
    real_mm = torch.mm

    def mm(a, b, out=None):
        sizes.append(a.shape[0])
        return real_mm(a, b, out=out)

    with torch.inference_mode():
        want = mlp(x)
        monkeypatch.setattr(torch, "mm", mm)
        got = cf._inplace_mlp(mlp, rows=64)(x)
    # at a few dozen rows MKL may pick another kernel than for the whole product: fp32 rounding apart
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    pieces = -(-n // 64)
    assert len(sizes) == 3 * pieces and sum(sizes) == 3 * n  # gate, up and down of every piece, each row once
    size = -(-n // pieces)
    assert max(sizes) == size and min(sizes) >= size - pieces + 1 >= 32  # pieces of about equal size, no short tail


def test_an_mlp_with_a_bias_or_a_wrapped_linear_runs_whole():
    model = _tiny_llama()
    mlp = model.model.layers[0].mlp
    mlp.up_proj.bias = torch.nn.Parameter(torch.randn(160))
    x = torch.randn(1, 150, 96)
    with torch.inference_mode():
        assert torch.equal(cf._inplace_mlp(mlp, rows=64)(x), mlp(x))  # the whole-input path, bias included


def test_inplace_mlp_leaves_other_activations_and_training_alone():
    model = _tiny_llama()
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    fwd = CpuForward(model, split=False, groups=False, inplace_mlp=True)
    assert set(fwd.mlps) == {model.model.layers[0].mlp}
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 5, 96)
    mlp.gate_proj.weight.requires_grad_(True)
    with fwd:
        y = mlp(x)  # grad enabled and a weight that wants it: the out-of-place expression, so backward works
    y.sum().backward()
    assert mlp.gate_proj.weight.grad is not None and bool(torch.isfinite(mlp.gate_proj.weight.grad).all())


def test_rope_path_gives_transformers_bits_and_only_inside_the_context():
    from transformers.models.llama import modeling_llama

    model = _tiny_llama()
    fuse_rotary(model, "cpu", cpu_path=True)
    fn = modeling_llama.apply_rotary_pos_emb
    assert hasattr(fn, "mmkv_original")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 19, 6, 16, generator=g).transpose(1, 2)  # as the attention hands them: strided
    k = torch.randn(2, 19, 2, 16, generator=g).transpose(1, 2)
    ang = torch.rand(2, 19, 8, generator=g) * 50
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    want = fn.mmkv_original(q, k, cos, sin)
    calls = []
    real = rotary._cpu_rope
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rotary, "_cpu_rope", lambda *a: calls.append(1) or real(*a))
        fn(q, k, cos, sin)
        assert calls == []  # outside mmkv's forwards: transformers' own code
        with CpuForward(model, split=False, groups=False, inplace_mlp=False, rope=True):
            got = fn(q, k, cos, sin)
        assert calls == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not getattr(rotary.CPU, "active", False)
    ids = torch.randint(0, 131, (1, 23))
    with torch.inference_mode():
        plain = model(ids).logits
        with CpuForward(model, split=False, groups=False, inplace_mlp=False, rope=True):
            assert torch.equal(model(ids).logits, plain)


SWITCHES = ("MMKV_CPU_SPLIT_LINEAR", "MMKV_CPU_GROUP_LINEAR", "MMKV_CPU_INPLACE_MLP", "MMKV_CPU_ROPE",
            "MMKV_LAST_ROW")


@pytest.mark.parametrize("spec", ["fp16", "text=kivi:bits=2 window=16 sinks=4"])
def test_engine_uses_the_cpu_forward_and_tokens_do_not_move(smollm2, two_threads, monkeypatch, spec):
    eng = Engine(smollm2)
    ids = smollm2.prepare([{"role": "user", "content": "Name three colours of the rainbow."}]).input_ids
    groups = cpu_groups(smollm2.model)
    assert len(groups) == len(smollm2.model.model.layers)
    assert all(rl.joined([m.weight for m in g]) is not None for g in groups)  # laid out at load
    for name in SWITCHES:
        monkeypatch.setenv(name, "0")
    plain = eng.generate(ids, spec, max_new_tokens=24)
    made = []
    real = rl._group_forwards
    monkeypatch.setattr(rl, "_group_forwards", lambda *a: made.append(1) or real(*a))
    for name in SWITCHES:
        monkeypatch.setenv(name, "1")
    fast = eng.generate(ids, spec, max_new_tokens=24)
    assert plain.tokens.shape[1] >= 8
    assert torch.equal(fast.tokens, plain.tokens)
    assert len(made) >= 2 * len(groups)  # the prefill's and the decode steps' contexts both grouped every layer
