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

from mmkv.cache import cache_kwargs

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]

SPECS = ["fp16", "text=kivi:bits=2", "text=kivi:bits=1,group=64", "text=xquant:kq=20,vq=2,km=22,vm=10",
         "text=xquant:kq=10,vq=0,km=0,vm=0,share=average window=32 sinks=4",
         "text=skvq:k_bits=2,v_bits=1.5,group=32,fp8=true,reorder=off,clip=off window=32 sinks=5",
         "text=skvq:k_bits=3,v_bits=2,group=32 window=32 sinks=5",  # reorder + clip: synthetic artifact below
         "text=alignedkv:block=32 window=32 sinks=4"]


@pytest.fixture(scope="module")
def lm():
    import mmkv

    return mmkv.load_model("random:smollm2-135m", device="cuda", dtype=torch.float16)


def with_artifacts(spec: str, adapter, tmp) -> str:
    """SKVQ specs that need calibration get one made on synthetic q/k/v (random weights: speed and paths only)."""
    from mmkv.calibrate.skvq import attach_synthetic_artifacts

    return attach_synthetic_artifacts([spec], adapter, tmp)[0]


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
        out = model(input_ids=ids[:, :n_prompt], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        cache.finalize()
        logits.append(out.logits[:, -1].float())
        for t in range(n_prompt, ids.shape[1]):
            pos = torch.full((ids.shape[0], 1), t, device=ids.device)
            out = model(input_ids=ids[:, t : t + 1], position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


@pytest.mark.parametrize("spec", SPECS)
def test_kernel_path_equals_reference_path_in_a_real_forward(lm, spec, monkeypatch, tmp_path_factory):
    spec = with_artifacts(spec, lm.adapter, tmp_path_factory.getbasetemp() / "skvq")
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
            out = model(input_ids=ids[:, :200], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            if isinstance(cache, MMKVCache):
                cache.finalize()
            steps = [out.logits[:, -1].float()]
            for t in range(200, 220):
                pos = torch.full((2, 1), t, device="cuda")
                out = model(input_ids=ids[:, t : t + 1], position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
                steps.append(out.logits[:, -1].float())
        outs.append(torch.stack(steps, 1))
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    assert err < 1e-2, f"mmkv fp16 vs DynamicCache: relative logit error {err:.2e}"


@pytest.mark.parametrize("spec", ["fp16", "text=kivi:bits=2 window=32 sinks=4",
                                  "text=xquant:kq=20,vq=2,km=22,vm=10 window=16",
                                  "text=skvq:k_bits=2,v_bits=1.5,group=32,block=8 window=16 sinks=5",
                                  "text=alignedkv:block=32 window=16 sinks=4"])
def test_graph_replayed_decode_equals_eager_decode(lm, spec, tmp_path_factory):
    """100 teacher-forced steps through several flushes: CUDA-graph replays give the eager step's logits."""
    from mmkv.cache import MMKVCache
    from mmkv.graphs import DecodeStepper

    model, _, adapter = lm
    spec = with_artifacts(spec, adapter, tmp_path_factory.getbasetemp() / "skvq")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(200, 20000, (3, 150 + 100), generator=g).cuda()
    runs = []
    for graphs in (True, False):
        cache = MMKVCache.for_model(spec, adapter)
        with torch.inference_mode():
            model(input_ids=ids[:, :150], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            cache.finalize()
            stepper = DecodeStepper(model, cache, graphs=graphs)
            steps = []
            for t in range(150, ids.shape[1]):
                pos = torch.full((3, 1), t, device="cuda")
                steps.append(stepper(ids[:, t : t + 1], pos).float().clone())
        runs.append(torch.stack(steps, 1))
        if graphs:
            st = stepper.stats()
            assert st["graph_replays"] > 50 and st["eager_steps"] >= 1, st
    err = ((runs[0] - runs[1]).norm() / runs[1].norm()).item()
    assert err < 1e-3, f"{spec}: graph vs eager relative logit error {err:.2e}"


@pytest.mark.parametrize("spec", ["fp16", "text=kivi:bits=2", "text=xquant:kq=20,vq=2,km=22,vm=10",
                                  "text=skvq:v_bits=1.5,group=32,fp8=true,reorder=off,clip=off",
                                  "text=alignedkv"])
def test_cache_nbytes_equals_the_device_memory_it_holds(lm, spec):
    """``cache.nbytes()`` counts exactly what the cache allocated on the GPU (torch.cuda.memory_allocated delta)."""
    from mmkv.cache import MMKVCache

    model, _, adapter = lm
    g = torch.Generator().manual_seed(3)
    k = [torch.randn(2, adapter.num_kv_heads, 700, adapter.head_dim, generator=g).cuda().half()
         for _ in range(2 * adapter.num_layers)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = MMKVCache.for_model(spec, adapter)
    cache.set_inputs(torch.ones(2, 700, dtype=torch.long, device="cuda"), None)
    for layer in range(adapter.num_layers):
        cache.update(k[2 * layer], k[2 * layer + 1], layer)
    cache.finalize()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    # the allocator rounds each block up to 512 bytes: allow that much per tensor, nothing more
    n_tensors = sum(len(S_fields(seg)) + 1 for layer in cache.layers for _, seg, _ in layer.parts())
    assert cache.nbytes() <= held <= cache.nbytes() + 512 * n_tensors, (held, cache.nbytes())


def S_fields(seg):
    from mmkv.cache import segments as S

    return S.token_fields(seg)


@pytest.mark.parametrize("spec", ["visual=calibquant:bits=1 text=kivi:bits=2 window=16 sinks=4",
                                  "visual=calibquant:bits=2,calibrate=false window=16 sinks=4"])
def test_visual_segments_of_a_real_image_prompt_decode_through_the_kernel(spec, square_image_path):
    """A tiny random InternVL (labelled random weights) prefills an image prompt on the GPU; every layer's segments,
    as the cache built them (channel-wise visual codes, calibration, sinks/window, per-row lens), give the same
    attention through ``kernels.decode_attention`` (the Gluon channel kernels) as through the torch reference."""
    import kernels
    import mmkv
    from kernels.reference import decode_attention_ref

    lm = mmkv.load_model("random:internvl2.5-8b", device="cuda", dtype=torch.float16, tiny=True)
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(square_image_path)},
                                          {"type": "text", "text": "Describe it."}]}]
    out = mmkv.Engine(lm).generate(msgs, spec=spec, max_new_tokens=6)
    assert out.stats["prompt_tokens"]["visual"] == 256
    g = torch.Generator(device="cuda").manual_seed(3)
    for layer in out.cache.layers:
        segs = layer.segments()
        assert layer.visual, "the image's tokens must sit in a visual segment"
        kv_heads = layer.visual[0].k_codes.shape[1]
        d = layer.visual[0].k_codes.shape[-1]
        q = torch.randn(1, kv_heads * lm.adapter.lm_config.num_attention_heads // lm.adapter.lm_config.num_key_value_heads,
                        d, device="cuda", dtype=torch.float16, generator=g)
        got = kernels.decode_attention(q, segs, 1 / d**0.5)
        ref = decode_attention_ref(q.float(), segs, 1 / d**0.5)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, f"{spec}: relative error {err:.2e}"


def test_elementwise_kernel_patches_keep_the_logits(lm, monkeypatch):
    """``load_model`` replaced transformers' ``apply_rotary_pos_emb`` (mmkv/models/rotary.py) and the MLPs' forward
    (mmkv/models/mlp.py) by one-kernel versions; prefill and decode logits are bit for bit the originals'."""
    import transformers.models.llama.modeling_llama as ml

    from mmkv.cache import MMKVCache

    model, _, adapter = lm
    assert hasattr(ml.apply_rotary_pos_emb, "mmkv_original")
    mlps = [m for m in model.modules() if "forward" in vars(m) and hasattr(m, "gate_proj")]
    assert len(mlps) == adapter.num_layers
    ids = torch.randint(200, 20000, (3, 70), generator=torch.Generator().manual_seed(5)).cuda()
    runs = []
    for patched in (True, False):
        if not patched:
            monkeypatch.setattr(ml, "apply_rotary_pos_emb", ml.apply_rotary_pos_emb.mmkv_original)
            for m in mlps:
                monkeypatch.delattr(m, "forward")  # the class's own forward again
        cache = MMKVCache.for_model("fp16", adapter)
        with torch.inference_mode():
            out = [model(input_ids=ids[:, :64], **cache_kwargs(model, cache), use_cache=True).logits]
            cache.finalize()
            for t in range(64, 70):
                out.append(model(input_ids=ids[:, t:t + 1], **cache_kwargs(model, cache), use_cache=True).logits)
        runs.append(torch.cat(out, 1))
    assert torch.equal(runs[0], runs[1])
