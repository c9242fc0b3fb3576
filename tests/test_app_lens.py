"""Attention lens: the quantize/calibrate math on random tensors, and the K/V capture on the real SmolLM2."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from kernels.reference import dequant_channel
from mmkv.cache import cache_kwargs
from mmkv.models.inputs import prepare_inputs
from mmkv.ui import lens
from mmkv.ui.lens_tab import analyze, calib_info
from mmkv.ui.session import Session


def qkv(hq=6, hk=3, t=45, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(hq, d, generator=g), torch.randn(hk, t, d, generator=g), torch.randn(hk, t, d, generator=g)
    vis = torch.zeros(t, dtype=torch.bool)
    vis[5:38] = True  # 33 visual tokens: not a multiple of 8, so packing pads
    return q, k, v, vis


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_channelwise_roundtrip_within_half_step(bits):
    x = torch.randn(1, 3, 33, 64)
    codes, scale, zero, tp = lens.quantize_channelwise(x, bits)
    assert codes.shape == (1, 3, tp // (8 // bits), 64) and tp % (8 // bits) == 0
    back = dequant_channel(codes, scale, zero, bits, block=tp)[:, :, :33]
    assert (back - x).abs().max() <= scale.max() / 2 + 1e-5


def test_constant_channel_is_exact():
    x = torch.ones(1, 1, 9, 4) * 3.0
    codes, scale, zero, tp = lens.quantize_channelwise(x, 1)
    assert torch.allclose(dequant_channel(codes, scale, zero, 1, tp)[:, :, :9], x)


def test_visual_logits_shapes_and_8bit_close():
    q, k, v, vis = qkv()
    lg = lens.visual_logits(q, k, v, vis, head=5, bits=8, tau=(0.0, 3.0))
    assert set(lg) == {"exact", "quantized", "calibrated"} and all(x.shape == (33,) for x in lg.values())
    assert torch.allclose(lg["quantized"], lg["exact"], atol=0.05)
    # calibration maps [min, max] onto [min - tau1, max - tau2]
    assert lg["calibrated"].max() == pytest.approx(float(lg["quantized"].max()) - 3.0, abs=1e-4)
    assert lg["calibrated"].min() == pytest.approx(float(lg["quantized"].min()), abs=1e-4)


def test_one_bit_widens_the_logit_range():
    q, k, v, vis = qkv()
    lg = lens.visual_logits(q, k, v, vis, head=0, bits=1, tau=(0.0, 3.0))
    rng = {n: float(x.max() - x.min()) for n, x in lg.items()}
    assert rng["quantized"] > rng["exact"] and rng["calibrated"] < rng["quantized"]


def test_attention_error_falls_with_bits():
    q, k, v, vis = qkv()
    errs = [lens.attention_error(q, k, v, vis, b, (0.0, 0.0))["quantized"] for b in (1, 2, 4, 8)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.01
    # tau1 = tau2 = 0 leaves calibration a no-op
    e = lens.attention_error(q, k, v, vis, 2, (0.0, 0.0))
    assert e["calibrated"] == pytest.approx(e["quantized"], rel=1e-5)


def test_frames():
    q, k, v, vis = qkv()
    lg = lens.visual_logits(q, k, v, vis, head=1, bits=2, tau=(0.0, 3.0))
    dist = lens.logit_distribution(lg, bins=20)
    assert list(dist.columns) == ["logit", "share", "series"] and len(dist) == 60
    assert dist.groupby("series")["share"].sum().round(6).eq(1.0).all()
    layers = [{"q": q, "k": k, "v": v, "scale": None}] * 3
    errs = lens.layer_errors(layers, vis, 2, (0.0, 3.0))
    assert len(errs) == 6 and set(errs["kind"]) == {"quantized", "quantized + calibrated"}


def test_analyze_with_a_fake_capture():
    q, k, v, vis = qkv()
    s = Session()
    s.last_messages = [{"role": "user", "content": "x"}]
    calls = []

    def capture(lm, messages):
        calls.append(messages)
        return {"layers": [{"q": q, "k": k.half(), "v": v.half(), "scale": None}] * 2, "visual": vis}

    lm = object()
    dist, summary, errs, note = analyze(s, lm, 7, 99, 1, 0.0, 3.0, capture=capture)
    assert isinstance(dist, pd.DataFrame) and len(errs) == 4 and "Layer 1, head 5" in note
    analyze(s, lm, 0, 0, 2, 0.0, 3.0, capture=capture)
    assert len(calls) == 1  # the capture is reused until the next answer


def test_analyze_messages():
    s = Session()
    assert "Load a model" in analyze(s, None, 0, 0, 1, 0, 3)[-1]
    assert "Chat tab first" in analyze(s, object(), 0, 0, 1, 0, 3)[-1]
    s.last_messages = [{"role": "user", "content": "x"}]
    no_vis = lambda lm, m: {"layers": [], "visual": torch.zeros(4, dtype=torch.bool)}  # noqa: E731
    assert "no visual tokens" in analyze(s, object(), 0, 0, 1, 0, 3, capture=no_vis)[-1]
    boom = lambda lm, m: 1 / 0  # noqa: E731
    assert "Lens failed: ZeroDivisionError" in analyze(s, object(), 0, 0, 1, 0, 3, capture=boom)[-1]


def test_calib_info_from_registry():
    info = calib_info([{"name": "cq", "modalities": ["visual"], "params": {
        "bits": {"choices": [1, 2]}, "tau1": {"default": 0.5}, "tau2": {"default": 2.0}}}])
    assert info == {"bits": [1, 2], "tau1": 0.5, "tau2": 2.0}


@pytest.mark.slow
def test_capture_matches_dynamic_cache_on_smollm2():
    """The captured K/V equal a plain transformers DynamicCache run, and mmkv attention is restored after."""
    mmkv = pytest.importorskip("mmkv")
    from transformers import DynamicCache

    from mmkv.ui.lens_tab import capture_prompt

    lm = mmkv.load_model("smollm2-135m")
    model, processor, adapter = lm
    msgs = [{"role": "user", "content": "Name a color."}]
    data = capture_prompt(lm, msgs)
    assert adapter.lm_config._attn_implementation == "mmkv"
    assert len(data["layers"]) == adapter.num_layers and not bool(data["visual"].any())
    prep = prepare_inputs(adapter, msgs, processor)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **cache_kwargs(model, cache),
              use_cache=True)
    k0 = cache.layers[0].keys[0]
    assert data["layers"][0]["k"].shape == k0.shape
    assert torch.allclose(data["layers"][0]["k"].float(), k0.float().cpu(), atol=1e-2)
    assert data["layers"][0]["q"].shape == (adapter.num_q_heads, adapter.head_dim)
