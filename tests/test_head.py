"""The padded LM head (``mmkv/models/head.py``): same logits as the plain head, used only where it pays."""

import pytest
import torch
from torch import nn

from mmkv.models.head import PaddedHead, pad_lm_head


@pytest.mark.parametrize("bias", [False, True])
def test_padded_head_matches_linear(bias):
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(40, 1001, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1001, 40, generator=g))
        if bias:
            head.bias.copy_(torch.randn(1001, generator=g))
    x = torch.randn(3, 5, 40, generator=g)
    padded = PaddedHead(head)
    assert padded.weight.shape == (1024, 40) and padded.out_features == 1001
    out = padded(x)
    assert out.shape == (3, 5, 1001)
    torch.testing.assert_close(out, head(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.weight[1001:], torch.zeros(23, 40))


class _LM(nn.Module):
    def __init__(self, vocab, tied):
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.lm_head = nn.Linear(16, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, head):
        self.lm_head = head


def test_pad_lm_head_only_where_it_pays():
    assert not pad_lm_head(_LM(1001, tied=False))  # CPU: cuBLAS is not involved
    if torch.cuda.is_available():
        assert not pad_lm_head(_LM(1024, tied=False).cuda())  # already aligned
        assert not pad_lm_head(_LM(1001, tied=True).cuda())  # a tied table would be copied
        lm = _LM(1001, tied=False).cuda()
        x = torch.randn(2, 16, device="cuda")
        ref = lm.lm_head(x)
        assert pad_lm_head(lm) and isinstance(lm.lm_head, PaddedHead)
        torch.testing.assert_close(lm.lm_head(x), ref)
