"""Gemma 3 through mmkv (issue 30), on tiny random-weight checkpoints of the real architecture written to folders
with their own processor (``tiny_vlms.gemma3``: sliding-window layers of window 12 beside full-attention ones) and
loaded as a hub id would be: image soft tokens found exactly, the fp16 cache giving the logits of the model's own
DynamicCache (sliding layers and all) on prompts longer than the window and over decode steps that cross it, the
model's own greedy tokens, a second turn equal to a fresh run, every method's spec run end to end (AQUA-KV refused),
sliding layers whose memory stops at the window, the text-only Gemma3ForCausalLM, the budget bench's tiled batch
decoding each row as the single request, and pan-and-scan crops as visual spans with the model's own logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_vlms import GEMMA3_WINDOW, gemma3, own_cache_logits, skvq_artifact_for

import mmkv
from mmkv.cache import MMKVCache, cache_kwargs
from mmkv.models.inputs import prepare_inputs

pytestmark = pytest.mark.slow
W = GEMMA3_WINDOW


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_load_info):
    from mmkv.models.smollm2 import ensure_tokenizer

    root = tmp_path_factory.mktemp("gemma3")
    return {"vlm": gemma3(root / "vlm", ensure_tokenizer()), "text": gemma3(root / "text", ensure_tokenizer(), True)}


@pytest.fixture(scope="module")
def tiny(folders):
    return mmkv.load_model(str(folders["vlm"]), device="cpu")


@pytest.fixture(scope="module")
def tiny_text(folders):
    return mmkv.load_model(str(folders["text"]), device="cpu")


def _img(seed, h, w):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _images_chat(text="What differs between them?"):
    return [{"role": "user", "content": [{"type": "text", "text": "Look at these:"},
                                         {"type": "image", "image": _img(0, 40, 70)},
                                         {"type": "image", "image": _img(1, 64, 64)},
                                         {"type": "text", "text": text}]}]


def test_loads_as_gemma3_with_its_windows_and_every_soft_token_visual(tiny):
    model, processor, adapter = tiny
    tok = processor.tokenizer
    assert adapter.family == "gemma3" and adapter.takes_images and not adapter.takes_video
    assert adapter.windows == (W, None, W, None)
    assert adapter.visual_token_ids == (tok.image_token_id,)
    prep = prepare_inputs(adapter, _images_chat(), processor)
    ids, vis = prep.input_ids[0], prep.visual_mask[0]
    assert int(vis.sum()) == 2 * 16  # mm_tokens_per_image soft tokens per image
    with torch.inference_mode():
        feats = model.model.get_image_features(prep.model_kwargs["pixel_values"]).pooler_output
    assert feats.shape[:2] == (2, 16)  # the vision tower's own count
    # the processor's token types mark exactly the soft tokens: they drive the model's bidirectional image mask
    assert torch.equal(prep.model_kwargs["token_type_ids"][0].bool(), vis)
    for marker in (tok.boi_token_id, tok.eoi_token_id):  # <start_of_image>/<end_of_image> are text
        at = ids == marker
        assert int(at.sum()) == 2 and not bool(vis[at].any())


def _mmkv_logits(model, adapter, prep, steps, spec="fp16"):
    cache = MMKVCache.for_model(spec, adapter)
    t = prep.input_ids.shape[1]
    cache.set_inputs(prep.attention_mask, prep.visual_mask)
    with torch.inference_mode():
        out = model(input_ids=prep.input_ids, attention_mask=prep.attention_mask, position_ids=torch.arange(t)[None],
                    **cache_kwargs(model, cache), use_cache=True, **prep.model_kwargs)
        cache.finalize()
        logits = [out.logits[:, -1]]
        for s in range(steps):
            out = model(input_ids=logits[-1].argmax(-1, keepdim=True), position_ids=torch.tensor([[t + s]]),
                        **cache_kwargs(model, cache), use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


@pytest.mark.parametrize("prompt", ["images", "short"])
def test_fp16_cache_gives_the_models_own_logits_across_the_window(tiny, prompt):
    model, processor, adapter = tiny
    # "images": 58 tokens, far past the window; "short": 10 tokens, so decoding crosses the window
    msgs = _images_chat() if prompt == "images" else [{"role": "user", "content": "Hi"}]
    prep = prepare_inputs(adapter, msgs, processor)
    assert (prep.input_ids.shape[1] > 3 * W) == (prompt == "images")
    ref, hf_cache = own_cache_logits(model, prep, steps=2 * W)
    ours, cache = _mmkv_logits(model, adapter, prep, steps=2 * W)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    n = prep.input_ids.shape[1] + 2 * W  # tokens fed
    assert [l.dense_len[0] for l in cache.layers if l.is_sliding] == [W, W]
    assert cache.tokens_by_modality()["visual"] + cache.tokens_by_modality()["fp16"] == n
    # the baseline reported is what transformers' own cache holds for the same tokens
    hf_bytes = sum(t.numel() * t.element_size() for l in hf_cache.layers for t in (l.keys, l.values))
    assert cache.fp16_equivalent_bytes() == hf_bytes
    if prompt == "images":  # the image tokens see each other both ways: without that the logits differ
        plain = {k: v for k, v in prep.model_kwargs.items() if k != "token_type_ids"}
        with torch.inference_mode():
            causal = model(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **plain).logits[:, -1]
        assert not torch.allclose(causal, ref[0], rtol=1e-3, atol=1e-3)


def test_engine_is_token_equal_to_the_models_own_generate(tiny):
    model, processor, adapter = tiny
    msgs = _images_chat()
    ours = mmkv.Engine(tiny).generate(msgs, spec="fp16", max_new_tokens=2 * W)
    prep = prepare_inputs(adapter, msgs, processor)
    with torch.inference_mode():
        ref = model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_kwargs,
                             max_new_tokens=2 * W, min_new_tokens=2 * W, do_sample=False)
    assert torch.equal(ours.tokens[0], ref[0, prep.input_ids.shape[1]:])
    assert ours.stats["prompt_tokens"]["visual"] == ours.stats["cache_tokens"]["visual"] == 32


def test_second_turn_equals_a_fresh_run_and_the_models_own_generate(tiny):
    model, processor, adapter = tiny
    eng = mmkv.Engine(tiny)
    first = eng.generate(_images_chat(), spec="fp16", max_new_tokens=6)
    history = _images_chat() + [{"role": "assistant", "content": first.text[0]},
                                {"role": "user", "content": "And which one is brighter, and why do you think so?"}]
    second = eng.generate(history, spec="fp16", max_new_tokens=8, past=first)
    fresh = eng.generate(history, spec="fp16", max_new_tokens=8)
    assert torch.equal(second.tokens, fresh.tokens)
    prep = prepare_inputs(adapter, history, processor)
    assert prep.input_ids.shape[1] - first.fed_ids.shape[1] > W  # the new turn alone is longer than the window
    with torch.inference_mode():
        gen = model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_kwargs,
                             max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(second.tokens[0], gen[0, prep.input_ids.shape[1]:])
    later = history + [{"role": "assistant", "content": second.text[0]},
                       {"role": "user", "content": [{"type": "image", "image": _img(3, 48, 48)}]}]
    with pytest.raises(ValueError, match="attend to each other in both directions"):
        eng.generate(later, spec="fp16", max_new_tokens=2, past=second)


def test_sliding_layers_stop_growing_at_their_window(tiny):
    eng = mmkv.Engine(tiny)
    spec = "visual=calibquant:bits=1 text=kivi:bits=2 window=8 sinks=2"
    short, long = (eng.generate(_images_chat(), spec=spec, max_new_tokens=n) for n in (4, 40))
    assert long.tokens.shape[1] == 40
    a, b = short.cache.nbytes_by_layer(used=True), long.cache.nbytes_by_layer(used=True)
    ad = tiny.adapter
    for i, w in enumerate(ad.windows):
        if w is not None:  # W tokens and a spare of the spec's window (8) of K and V in fp32, whatever the length
            assert a[i] == b[i] == (w + 8) * 2 * ad.num_kv_heads * ad.head_dim * 4
        else:
            assert b[i] > a[i]


@pytest.fixture(scope="module")
def skvq_artifact(tiny, folders, tmp_path_factory):
    return skvq_artifact_for(tiny, folders["vlm"], tmp_path_factory.mktemp("skvq"))


TEXT_SPECS = ["kivi:bits=2", "xquant:kq=1,vq=1,km=2,vm=1", "alignedkv", "fp16", "skvq:group=32,block=8"]


@pytest.mark.parametrize("visual,text", [*(("calibquant:bits=1", t) for t in TEXT_SPECS), ("kivi:bits=2", "kivi:bits=2")])
def test_every_method_runs_end_to_end_on_the_full_attention_layers(tiny, skvq_artifact, visual, text):
    if text.startswith("skvq"):
        text += f",artifact={skvq_artifact}"
    msgs = _images_chat("Say what differs between the two pictures, one line for each of them. " * 4)
    out = mmkv.Engine(tiny).generate(msgs, spec=f"visual={visual} text={text} window=8 sinks=2",
                                     max_new_tokens=4)
    assert out.tokens.shape == (1, 4)
    assert out.stats["cache_tokens"]["visual"] == 32 and out.stats["cache_tokens"]["text"] > 0
    layers = out.cache.layers
    assert all(not l.is_sliding or (not l.visual and l.text is None) for l in layers)  # only their window, in fp16
    if text.startswith("xquant"):  # odd layers share codes with the layer before, a sliding one here: they keep their own
        assert [l.text_method.k_shared or l.text_method.v_shared for l in layers[1::2]] == [False, False]
        assert all(l.partner is None for l in layers[1::2])


def test_pre_rope_key_methods_are_refused_with_the_reason(tiny):
    with pytest.raises(ValueError, match="aquakv predicts each layer's keys.*sliding-window layers"):
        mmkv.Engine(tiny).generate(_images_chat(), spec="text=aquakv", max_new_tokens=2)


def test_video_is_refused(tiny, video_path):
    with pytest.raises(ValueError, match="takes images, not videos"):
        mmkv.Engine(tiny).generate([{"role": "user", "content": [{"type": "video", "path": str(video_path)}]}])


def test_text_only_gemma3_scores_and_decodes_as_the_model_does(tiny_text):
    model, tok, adapter = tiny_text
    assert type(model).__name__ == "Gemma3ForCausalLM" and adapter.family == "text"
    assert adapter.windows == (W, None, W, None)
    prep = prepare_inputs(adapter, "Tell me a long story about a tower by the sea, please.", tok)
    ref, _ = own_cache_logits(model, prep, steps=2 * W)
    ours, _ = _mmkv_logits(model, adapter, prep, steps=2 * W)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    ids = torch.randint(0, len(tok), (2, 5 * W), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
    eng = mmkv.Engine(tiny_text)
    for chunk in (1, 7, 2 * W):  # chunks over the stored window (extend) and one token at a time (decode)
        assert eng.score(ids, spec="fp16", chunk=chunk)["nll"] == pytest.approx(nll, rel=1e-5)
    out = eng.generate("Tell me a story.", spec="text=kivi:bits=2 window=8 sinks=2", max_new_tokens=3 * W)
    assert out.stats["cache_tokens"]["text"] > 0


@pytest.mark.parametrize("n_visual,n_text", [(16, 40), (4, 4)])
def test_bench_tiles_one_request_into_a_batch_whose_rows_decode_as_it_does(tiny, n_visual, n_text):
    """``tile_cache`` (the budget bench) over sliding layers: 56 tokens fill and wrap every ring and its spare, 8
    leave it filling; each row of the tiled batch must then decode, over steps that wrap the ring again, exactly as
    the untiled request does (its own ring slot and spare: rows hold separate memory)."""
    from eval.bench.common import one_request_cache, tile_cache

    model, _, adapter = tiny
    spec = "visual=calibquant:bits=1 text=kivi:bits=2 window=8 sinks=2"
    cpu = torch.device("cpu")
    one = one_request_cache(spec, adapter, n_visual, n_text, cpu, torch.float32)
    rows = 3
    tiled = tile_cache(one_request_cache(spec, adapter, n_visual, n_text, cpu, torch.float32), rows)
    for layer in tiled.layers:
        if layer.is_sliding:
            assert layer.slot.shape == (rows,) and layer.dense.k.shape[0] == rows
            assert layer.spare is None or (layer.spare.k.shape[0] == rows and len(layer.spare_len) == rows)
    n, tok = n_visual + n_text, torch.tensor([[5]])
    with torch.inference_mode():
        for s in range(2 * W):
            pos = torch.tensor([[n + s]])
            ref = model(input_ids=tok, position_ids=pos, **cache_kwargs(model, one), use_cache=True).logits[:, -1]
            got = model(input_ids=tok.expand(rows, 1), position_ids=pos.expand(rows, 1),
                        **cache_kwargs(model, tiled), use_cache=True).logits[:, -1]
            torch.testing.assert_close(got, ref.expand(rows, -1), rtol=1e-5, atol=1e-5)
            tok = ref.argmax(-1, keepdim=True)
    for a, b in zip(one.layers, tiled.layers):
        if a.is_sliding:  # every row wrapped its ring as the request did
            assert b.slot.tolist() == [int(a.slot[0])] * rows and b.dense_len == a.dense_len * rows


def test_bench_room_to_decode_never_grows_a_ring_past_its_window(tiny):
    from eval.bench.common import one_request_cache, reserve_room
    from mmkv.cache import segments as S

    cpu = torch.device("cpu")
    for n in (40, 6):  # a full ring (its window and spare already held) and one still filling
        cache = reserve_room(one_request_cache("fp16 window=8", tiny.adapter, 0, n, cpu, torch.float32), 20)
        for layer in cache.layers:
            if layer.is_sliding:  # W tokens and the spare of 8, all a decode step ever holds on this layer
                assert S.capacity(layer.dense) == W and S.capacity(layer.spare) == 8
            else:  # a full-attention layer's fp16 window grows as decoding would grow it
                assert S.capacity(layer.dense) >= max(layer.dense_len) + 20


@pytest.fixture(scope="module")
def tiny_pan_and_scan(tmp_path_factory, smollm2_load_info):
    from mmkv.models.smollm2 import ensure_tokenizer

    folder = gemma3(tmp_path_factory.mktemp("gemma3_pas") / "vlm", ensure_tokenizer(), pan_and_scan=True)
    return mmkv.load_model(str(folder), device="cpu")


def _spans(visual: torch.Tensor) -> list[int]:
    """Lengths of the runs of True in a 1-D mask."""
    edges = torch.diff(torch.cat([visual.new_zeros(1), visual, visual.new_zeros(1)]).int()).tolist()
    starts = [i for i, e in enumerate(edges) if e == 1]
    ends = [i for i, e in enumerate(edges) if e == -1]
    return [e - s for s, e in zip(starts, ends)]


def test_pan_and_scan_crops_are_visual_spans_and_cached_as_the_model_does(tiny, tiny_pan_and_scan):
    model, processor, adapter = tiny_pan_and_scan
    wide = _img(5, 40, 130)  # 3.25:1, so pan-and-scan cuts three 44x40 crops beside the whole image
    ip = processor.image_processor
    alone = ip(wide, do_pan_and_scan=True, pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=4,
               pan_and_scan_min_ratio_to_activate=1.2, return_tensors="pt")
    assert alone["num_crops"].tolist() == [3]  # the image processor's own count
    msgs = [{"role": "user", "content": [{"type": "image", "image": wide}, {"type": "text", "text": "What is it?"}]}]
    prep = prepare_inputs(adapter, msgs, processor)
    assert prep.model_kwargs["pixel_values"].shape[0] == 1 + 3
    assert _spans(prep.visual_mask[0]) == [16] * 4  # the whole image, then each crop: its own span of soft tokens
    assert torch.equal(prep.model_kwargs["token_type_ids"][0].bool(), prep.visual_mask[0])
    # a checkpoint that leaves pan-and-scan off (the released models' config) gets one span for the same image
    assert _spans(prepare_inputs(tiny.adapter, msgs, tiny.processor).visual_mask[0]) == [16]
    ref, _ = own_cache_logits(model, prep, steps=W)
    ours, _ = _mmkv_logits(model, adapter, prep, steps=W)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    out = mmkv.Engine(tiny_pan_and_scan).generate(msgs, spec="visual=calibquant:bits=1 window=8", max_new_tokens=3)
    assert out.stats["cache_tokens"]["visual"] == 64


def test_requests_join_and_leave_a_batch_and_decode_as_they_do_alone(tiny):
    """Continuous batching (``cache/rows.py``, what mmkv-serve runs) over sliding layers: a request whose rings are
    full and wrapped (56 tokens) and one whose rings are still filling (8 tokens, no spare yet) join one batch, decode
    past the window, then the first leaves; every row gives the logits it gives decoding alone."""
    from eval.bench.common import one_request_cache
    from mmkv.cache.rows import keep_rows, merge_rows

    model, _, adapter = tiny
    spec = "visual=calibquant:bits=1 text=kivi:bits=2 window=8 sinks=2"
    sizes = [(16, 40), (4, 4)]
    cpu = torch.device("cpu")
    alone = [one_request_cache(spec, adapter, v, t, cpu, torch.float32) for v, t in sizes]
    batch = one_request_cache(spec, adapter, *sizes[0], cpu, torch.float32)
    merge_rows(batch, one_request_cache(spec, adapter, *sizes[1], cpu, torch.float32))
    pos = [v + t for v, t in sizes]
    toks = [5, 7]

    def step(rows):
        with torch.inference_mode():
            refs = [model(input_ids=torch.tensor([[toks[r]]]), position_ids=torch.tensor([[pos[r]]]),
                          **cache_kwargs(model, alone[r]), use_cache=True).logits[:, -1] for r in rows]
            got = model(input_ids=torch.tensor([[toks[r]] for r in rows]),
                        position_ids=torch.tensor([[pos[r]] for r in rows]), **cache_kwargs(model, batch),
                        use_cache=True).logits[:, -1]
        torch.testing.assert_close(got, torch.cat(refs), rtol=1e-5, atol=1e-5)
        for r, ref in zip(rows, refs):
            toks[r], pos[r] = int(ref.argmax()), pos[r] + 1

    for _ in range(W + 2):  # the filling rings fill, wrap and start their spare inside the batch
        step([0, 1])
    keep_rows(batch, [1])
    for _ in range(3):
        step([1])
