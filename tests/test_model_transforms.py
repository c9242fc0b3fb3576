"""Load-time speed changes to a model (mmkv/models/norms.py, projections.py, rotary.py, mlp.py): which modules are
swapped, and that the model's output does not change. On CPU the swapped norm runs the torch reference (the same
rule; the kernel itself is tested against it in tests/test_kernels.py, on CPU under Triton's interpreter and on the
GPU compiled); grouped projections run one GEMM, or their own where a sibling is called with another input; the
rotary and silu*up patches are checked here with their references in place of the kernels (which equal them bit
for bit: tests/test_kernels.py), and compiled on the GPU in tests/test_gpu_e2e.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from mmkv.models import mlp as mmlp
from mmkv.models import rotary as mrot
from mmkv.models.norms import FusedRMSNorm, fuse_rms_norms
from mmkv.models.projections import MAX_ROWS, GroupedLinear, fuse_projections


class GemmaLikeRMSNorm(nn.Module):  # another rule: (1 + weight); must keep its own forward
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1.0 + self.weight) * h.to(x.dtype)


def _tiny_llama(bias: bool = False):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=3,
                      num_key_value_heads=1, vocab_size=211, max_position_embeddings=128, attention_bias=bias,
                      mlp_bias=bias)
    model = LlamaForCausalLM(cfg).eval()
    for m in model.modules():  # random norm weights, so a swap that dropped them would show
        if type(m).__name__.endswith("RMSNorm"):
            m.weight.data = 1 + 0.3 * torch.randn_like(m.weight)
    return model


def test_swaps_llama_norms_and_keeps_the_output():
    model = _tiny_llama()
    ids = torch.randint(0, 211, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    w0 = model.model.norm.weight
    assert fuse_rms_norms(model, device_type="cuda") == 0  # CPU weights: nothing on the GPU to swap
    assert fuse_rms_norms(model, device_type="cpu") == 2 * 3 + 1
    assert isinstance(model.model.norm, FusedRMSNorm) and model.model.norm.weight is w0  # shared, not copied
    assert isinstance(model.model.layers[2].post_attention_layernorm, FusedRMSNorm)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert fuse_rms_norms(model, device_type="cpu") == 0  # already swapped


def test_keeps_norms_with_another_rule_and_sharded_models():
    box = nn.Module()
    box.norm = GemmaLikeRMSNorm(64)
    assert fuse_rms_norms(box, device_type="cpu") == 0 and isinstance(box.norm, GemmaLikeRMSNorm)
    model = _tiny_llama()
    model.hf_device_map = {"": "cpu"}
    assert fuse_rms_norms(model, device_type="cpu") == 0


def test_grouped_projections_keep_the_output_and_the_parameters():
    for bias in (False, True):
        model = _tiny_llama(bias)
        ids = torch.randint(0, 211, (2, 13), generator=torch.Generator().manual_seed(1))
        k_rows = model.model.layers[1].self_attn.k_proj.weight.detach().clone()
        n_params = sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            before = model(ids).logits
        assert fuse_projections(model, device_type="cuda") == 0  # CPU weights: nothing to group on the GPU
        assert fuse_projections(model, device_type="cpu") == 3 * 2
        attn = model.model.layers[1].self_attn
        assert isinstance(attn.k_proj, GroupedLinear) and torch.equal(attn.k_proj.weight, k_rows)
        assert (attn.k_proj.bias is None) != bias
        assert sum(p.numel() for p in model.parameters()) == n_params  # the concatenation replaced the originals
        with torch.no_grad():
            after = model(ids).logits
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        assert all(m.group.pending is None for m in model.modules() if isinstance(m, GroupedLinear))
        assert fuse_projections(model, device_type="cpu") == 0  # already grouped


def test_sibling_with_another_input_computes_its_own():
    model = _tiny_llama(True)
    fuse_projections(model, device_type="cpu")
    mlp = model.model.layers[0].mlp
    x, other = torch.randn(4, 96), torch.randn(4, 96)
    with torch.no_grad():
        gate = mlp.gate_proj(x)
        up_other = mlp.up_proj(other)  # not the input gate_proj saw
        up_x = mlp.up_proj(x)
    torch.testing.assert_close(gate, F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
    torch.testing.assert_close(up_other, F.linear(other, mlp.up_proj.weight, mlp.up_proj.bias))
    torch.testing.assert_close(up_x, F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias))
    assert mlp.gate_proj.group.pending is None


def test_many_rows_take_separate_gemms():
    model = _tiny_llama(False)
    fuse_projections(model, device_type="cpu")
    attn = model.model.layers[2].self_attn
    x = torch.randn(MAX_ROWS + 1, 96)
    with torch.no_grad():
        q = attn.q_proj(x)
        assert attn.q_proj.group.pending is None  # nothing kept for the siblings
        k = attn.k_proj(x)
    torch.testing.assert_close(q, F.linear(x, attn.q_proj.weight))
    torch.testing.assert_close(k, F.linear(x, attn.k_proj.weight))


def _patch_keeps_logits(fuse, calls: list, prepare=None) -> int:
    """``fuse`` (a load-time patch of mmkv/models) leaves an fp32 model (its kernel takes fp16/bf16), a sharded one
    and CPU weights asked for as "cuda" alone; on the fp16 tiny Llama (after ``prepare``) it keeps the logits bit
    for bit, its kernel (recorded in ``calls``) runs once per layer, and a second call patches nothing. Returns
    how many patches the first call made."""
    model = _tiny_llama()
    assert fuse(model, device_type="cpu") == 0  # fp32
    sharded = _tiny_llama().half()
    sharded.hf_device_map = {"": "cpu"}
    assert fuse(sharded, device_type="cpu") == 0
    model = model.half()
    if prepare is not None:
        prepare(model)
    ids = torch.randint(0, 211, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        assert fuse(model, device_type="cuda") == 0  # CPU weights
        made = fuse(model, device_type="cpu")
        calls.clear()
        after = model(ids).logits
    assert len(calls) == 3  # one call per layer
    assert torch.equal(before, after)
    assert fuse(model, device_type="cpu") == 0  # already patched
    return made


def test_rotary_patch_keeps_the_output(monkeypatch):
    """``apply_rotary_pos_emb`` of the Llama modeling module is replaced by the wrapper, which sends the inputs it
    takes to the kernel (here its spec, ``reference.rotary``: the kernel equals it bit for bit, tests/test_kernels.py;
    compiled on the GPU, tests/test_gpu_e2e.py) and keeps the logits bit for bit; patched once; an fp32 model (the
    kernel takes fp16/bf16) or a sharded one is left alone."""
    import transformers.models.llama.modeling_llama as ml

    from kernels import reference

    orig = getattr(ml.apply_rotary_pos_emb, "mmkv_original", ml.apply_rotary_pos_emb)  # a GPU load patched it
    monkeypatch.setattr(ml, "apply_rotary_pos_emb", orig)  # restored after the test
    calls = []
    monkeypatch.setattr(mrot, "rotary", lambda *a, check: calls.append(1) or reference.rotary(*a))
    monkeypatch.setattr(mrot, "use_triton", lambda q: True)  # as on CUDA
    assert _patch_keeps_logits(mrot.fuse_rotary, calls) == 1  # one modeling module


def test_rotary_patch_skips_another_rule(monkeypatch):
    """A modeling module whose ``apply_rotary_pos_emb`` rotates interleaved pairs (GPT-J style) keeps it."""
    import transformers.models.llama.modeling_llama as ml

    from kernels import reference

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rot(x):
            x2 = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
            return x * cos.unsqueeze(unsqueeze_dim) + x2 * sin.unsqueeze(unsqueeze_dim)
        return rot(q), rot(k)

    monkeypatch.setattr(ml, "apply_rotary_pos_emb", interleaved)
    monkeypatch.setattr(mrot, "rotary", lambda *a, check: reference.rotary(*a))
    monkeypatch.setattr(mrot, "use_triton", lambda q: True)
    assert mrot.fuse_rotary(_tiny_llama().half(), device_type="cpu") == 0
    assert ml.apply_rotary_pos_emb is interleaved


def test_silu_mul_patch_keeps_the_output(monkeypatch):
    """Each Llama MLP gets the forward that runs ``silu(gate) * up`` as one kernel (here its spec,
    ``reference.silu_mul``; the kernel itself: tests/test_kernels.py) on the grouped projections' output: same
    logits bit for bit, patched once; fp32 (the kernel takes fp16/bf16) and sharded models are left alone."""
    from kernels import reference

    calls = []
    monkeypatch.setattr(mmlp, "silu_mul", lambda g, u, check: calls.append(1) or reference.silu_mul(g, u))
    monkeypatch.setattr(mmlp, "use_triton", lambda t: True)  # as on CUDA
    def group(model):  # gate and up as strided halves of one GEMM
        assert fuse_projections(model, device_type="cpu") == 6

    assert _patch_keeps_logits(mmlp.fuse_silu_mul, calls, prepare=group) == 3  # one MLP per layer


def test_silu_mul_patch_skips_other_activations():
    model = _tiny_llama().half()
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.GELU()
    assert mmlp.fuse_silu_mul(model, device_type="cpu") == 0
