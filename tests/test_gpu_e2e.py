"""GPU only: the whole decode path (model forward -> MMKVCache -> Triton kernels) against the torch reference path.

A SmolLM2-shaped model with random weights (``random:smollm2-135m``, labelled so) runs on CUDA in fp16. For each
spec, the same prompt is prefilled and decoded teacher-forced twice: once with the kernels (what users run) and
once with ``kernels.decode_attention`` swapped for the pure-torch reference over the very same segments. The
logits must agree (relative error < 2e-2 over all steps: fp16 activations through 30 layers) and the greedy tokens
of the kernel run must match the reference run on most steps. Also: with spec ``fp16`` the mmkv path agrees with
transformers' own ``DynamicCache`` + SDPA. Run on the GPU box with ``python -m pytest tests/test_gpu_e2e.py``;
skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]

SPECS = ["fp16", "text=kivi:bits=2", "text=kivi:bits=1,group=64", "text=xquant:kq=20,vq=2,km=22,vm=10",
         "text=xquant:kq=10,vq=0,km=0,vm=0,share=average window=32 sinks=4"]


@pytest.fixture(scope="module")
def lm():
    import mmkv

    return mmkv.load_model("random:smollm2-135m", device="cuda", dtype=torch.float16)


def run(lm, spec: str, ids: torch.Tensor, reference: bool, monkeypatch) -> torch.Tensor:
    import kernels
    import mmkv.attention as att
    from kernels.reference import decode_attention_ref
    from mmkv.cache import MMKVCache

    if reference:
        monkeypatch.setattr(att.kernels, "decode_attention",
                            lambda q, segs, scale: decode_attention_ref(q.float(), segs, scale).to(q.dtype))
    else:
        monkeypatch.setattr(att.kernels, "decode_attention", kernels.decode_attention)
    model, _, adapter = lm
    cache = MMKVCache.for_model(spec, adapter)
    n_prompt = 300
    logits = []
    with torch.inference_mode():
        out = model(input_ids=ids[:, :n_prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.finalize()
        logits.append(out.logits[:, -1].float())
        for t in range(n_prompt, ids.shape[1]):
            pos = torch.full((ids.shape[0], 1), t, device=ids.device)
            out = model(input_ids=ids[:, t : t + 1], position_ids=pos, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


@pytest.mark.parametrize("spec", SPECS)
def test_kernel_path_equals_reference_path_in_a_real_forward(lm, spec, monkeypatch):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(200, 20000, (3, 300 + 40), generator=g).cuda()  # 40 decode steps: the window flushes
    got = run(lm, spec, ids, reference=False, monkeypatch=monkeypatch)
    ref = run(lm, spec, ids, reference=True, monkeypatch=monkeypatch)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"{spec}: relative logit error {err:.2e}"
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.9, f"{spec}: greedy agreement {agree:.2f}"


def test_fp16_spec_matches_transformers_dynamic_cache(lm):
    from transformers import DynamicCache

    from mmkv.cache import MMKVCache

    model, _, adapter = lm
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(200, 20000, (2, 220), generator=g).cuda()
    outs = []
    for cache in (MMKVCache.for_model("fp16", adapter), DynamicCache(config=adapter.lm_config)):
        with torch.inference_mode():
            out = model(input_ids=ids[:, :200], past_key_values=cache, use_cache=True, logits_to_keep=1)
            if isinstance(cache, MMKVCache):
                cache.finalize()
            steps = [out.logits[:, -1].float()]
            for t in range(200, 220):
                pos = torch.full((2, 1), t, device="cuda")
                out = model(input_ids=ids[:, t : t + 1], position_ids=pos, past_key_values=cache, use_cache=True)
                steps.append(out.logits[:, -1].float())
        outs.append(torch.stack(steps, 1))
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    assert err < 1e-2, f"mmkv fp16 vs DynamicCache: relative logit error {err:.2e}"
