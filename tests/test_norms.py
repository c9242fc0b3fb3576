"""mmkv/models/norms.py: which RMSNorm modules are swapped for the one-kernel norm, and that a model's output does not
change (on CPU the swapped module runs the torch reference, the same rule; the kernel itself is tested against it in
tests/test_kernels.py, on CPU under Triton's interpreter and on the GPU compiled)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from mmkv.models.norms import FusedRMSNorm, fuse_rms_norms


class GemmaLikeRMSNorm(nn.Module):  # another rule: (1 + weight); must keep its own forward
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1.0 + self.weight) * h.to(x.dtype)


def _tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=3,
                      num_key_value_heads=1, vocab_size=211, max_position_embeddings=128)
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
