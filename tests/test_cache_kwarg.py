"""``cache_kwargs``: the cache reaches a model under the keyword its ``forward`` declares.

transformers 5.24 renamed ``past_key_values`` to ``cache``; before 5.24 ``cache=`` is silently ignored (the model runs
without a cache), from 5.24 ``past_key_values=`` warns and goes away in 5.40.
"""

import warnings

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from mmkv.cache import cache_kwargs


def test_the_installed_transformers_fills_the_cache_it_is_handed_and_does_not_warn():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=101)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 101, (2, 7))
    cache = DynamicCache(config=cfg)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        first = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
        nxt = first.argmax(-1, keepdim=True)
        step = model(input_ids=nxt, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
    assert cache.get_seq_length() == 8
    full = model(input_ids=torch.cat([ids, nxt], 1)).logits[:, -1]  # the step saw the cached prompt
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-5)


def test_the_keyword_follows_the_forward_signature():
    class Before524(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    class From524(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return cache

    marker = object()
    assert cache_kwargs(Before524(), marker) == {"past_key_values": marker}
    assert cache_kwargs(From524(), marker) == {"cache": marker}
    assert From524()(None, **cache_kwargs(From524(), marker)) is marker
