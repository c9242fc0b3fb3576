"""A prefill's last decoder layer for the last position only (mmkv/models/last_row.py, ``MMKV_LAST_ROW``).

The reference is the same prefill without it: every position through every layer, the last position's logits
kept. The last row's logits may differ by fp32 rounding (a one-row SDPA sums in another order than the causal
kernel: rtol/atol 1e-4 on logits of magnitude ~10-30); the cache must hold the same keys and values, which the
next step's logits (same tolerance) and greedy tokens check. A batch with left padding checks that the last row
keeps its mask (without it the padded row would attend to its pad tokens).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mmkv.attention import LAST_ROW
from mmkv.cache import MMKVCache, cache_kwargs
from mmkv.engine import Engine
from mmkv.models.cpu_forward import cpu_forward
from mmkv.models.last_row import LastRow, last_row
from mmkv.spec import CacheSpec


def _prefill_and_step(loaded, ids, mask, spec, last: bool):
    model = loaded.model
    cache = MMKVCache.for_model(CacheSpec.parse(spec), loaded.adapter)
    cache.set_inputs(mask, None)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode(), LastRow(model) if last else contextlib.nullcontext():
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache),
                      use_cache=True, logits_to_keep=1).logits[:, -1]
    cache.finalize()
    nxt = first.argmax(-1, keepdim=True)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    with torch.inference_mode():
        step = model(input_ids=nxt, attention_mask=mask, position_ids=pos[:, -1:] + 1,
                     **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    return first, step


@pytest.mark.parametrize("spec", ["fp16", "text=kivi:bits=2 window=8 sinks=2"])
def test_last_row_prefill_gives_the_whole_prefills_logits_and_cache(smollm2, spec):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 2000, (2, 37), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0  # row 0 left-padded
    ref = _prefill_and_step(smollm2, ids, mask, spec, last=False)
    got = _prefill_and_step(smollm2, ids, mask, spec, last=True)
    for r, x in zip(ref, got):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-4)
    assert torch.equal(ref[0].argmax(-1), got[0].argmax(-1)) and torch.equal(ref[1].argmax(-1), got[1].argmax(-1))


def test_last_row_context_puts_every_forward_back(smollm2):
    model = smollm2.model
    layer = model.model.layers[-1]
    cpu = [torch.device("cpu")]
    with cpu_forward(model) as ctx, last_row(model, cpu):
        assert getattr(layer.self_attn, LAST_ROW) is True
        inner_mlp = layer.mlp.__dict__.get("forward")
        assert inner_mlp is not None and inner_mlp is not ctx.mlps.get(layer.mlp)  # wrapped over the in-place MLP
        assert "forward" in layer.self_attn.o_proj.__dict__
        assert not getattr(model.model.layers[-2].self_attn, LAST_ROW, False)  # the last layer only
    assert getattr(layer.self_attn, LAST_ROW) is False
    assert "forward" not in layer.mlp.__dict__ and "forward" not in layer.self_attn.o_proj.__dict__
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.inference_mode(), cpu_forward(model):  # decode steps and score: every position as usual
        assert not getattr(layer.self_attn, LAST_ROW, False)
        assert layer.self_attn.o_proj(x).shape[1] == 3 and layer.mlp(x).shape[1] == 3
    with torch.inference_mode(), cpu_forward(model), last_row(model, cpu):
        assert layer.self_attn.o_proj(x).shape[1] == 1 and layer.mlp(x).shape[1] == 1


def test_engine_prefill_takes_the_last_row_and_tokens_do_not_move(smollm2, monkeypatch):
    eng = Engine(smollm2)
    ids = smollm2.prepare([{"role": "user", "content": "What is the capital of France?"}]).input_ids
    monkeypatch.setenv("MMKV_LAST_ROW", "0")
    plain = eng.generate(ids, "fp16", max_new_tokens=16)
    rows = []
    hook = smollm2.model.model.layers[-1].mlp.register_forward_hook(lambda m, a, out: rows.append(out.shape[-2]))
    monkeypatch.setenv("MMKV_LAST_ROW", "1")
    try:
        fast = eng.generate(ids, "fp16", max_new_tokens=16)
    finally:
        hook.remove()
    assert torch.equal(fast.tokens, plain.tokens)
    assert rows and rows[0] == 1  # the prefill's last MLP saw one row, not the prompt's


@pytest.mark.parametrize("mode, kind, on", [("cpu", "cpu", True), ("cpu", "cuda", False), ("1", "cuda", True),
                                            ("1", "cpu", True), ("0", "cpu", False)])
def test_the_switch_picks_the_devices(smollm2, monkeypatch, mode, kind, on):
    monkeypatch.setenv("MMKV_LAST_ROW", mode)
    assert isinstance(last_row(smollm2.model, [torch.device(kind)]), LastRow) is on
