"""``Engine.generate_many``: one prefill forward for several specs gives what a ``generate`` per spec gives (tokens,
text, every stored tensor of every cache, byte counts), with one forward of the prompt instead of one a spec."""

from __future__ import annotations

import pytest
import torch

from mmkv.cache import segments as S
from mmkv.engine import Engine

# XQuant's kq/vq/km/vm count layers: 2- and 1-bit codes, keys and values shared, within smollm2_first_layers' four
TEXT_SPECS = ["fp16", "text=kivi:bits=2 window=16 sinks=4", "text=xquant:kq=3,vq=2,km=2,vm=0 window=16 sinks=4",
              "text=alignedkv window=16 sinks=4", "text=kivi:bits=4 window=0 sinks=0"]


def _assert_same_cache(a, b):
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers, strict=True):
        pa, pb = la.parts(), lb.parts()
        assert [(m, lens) for m, _, lens in pa] == [(m, lens) for m, _, lens in pb]
        for (_, sa, _), (_, sb, _) in zip(pa, pb, strict=True):
            assert type(sa) is type(sb)
            assert torch.equal(sa.lens, sb.lens)
            for name, _ in S.token_fields(sa):
                assert torch.equal(getattr(sa, name), getattr(sb, name)), name


def _prompt_forwards(model) -> list:
    """Sequence lengths of the language model's forwards, recorded by a hook (prompts are the ones longer than 1)."""
    seen = []
    lm = model.get_decoder() if hasattr(model, "get_decoder") else model
    handle = lm.register_forward_pre_hook(
        lambda _m, args, kw: seen.append((kw.get("input_ids") if kw.get("input_ids") is not None
                                          else kw["inputs_embeds"]).shape[1]), with_kwargs=True)
    return seen, handle


def _check(engine, inputs, specs, **kw):
    seen, handle = _prompt_forwards(engine.model)
    try:
        many = engine.generate_many(inputs, specs, **kw)
        shared_prompts = sum(n > 1 for n in seen)
        seen.clear()
        alone = [engine.generate(inputs, s, **kw) for s in specs]
        alone_prompts = sum(n > 1 for n in seen)
    finally:
        handle.remove()
    assert shared_prompts == 1 and alone_prompts == len(specs)
    for m, a, spec in zip(many, alone, specs, strict=True):
        assert str(m.spec) == str(a.spec) == str(type(m.spec).parse(spec))
        assert torch.equal(m.tokens, a.tokens), spec
        assert m.text == a.text
        assert m.stats["cache_bytes"] == a.stats["cache_bytes"] and m.stats["effective_bits"] == a.stats["effective_bits"]
        assert m.stats["prompt_tokens"] == a.stats["prompt_tokens"]
        assert torch.equal(m.fed_ids, a.fed_ids) and torch.equal(m.next_position, a.next_position)
        _assert_same_cache(m.cache, a.cache)
    assert "shared_prefill" not in many[0].stats
    assert all(o.stats["shared_prefill"] and o.stats["prefill_ms"] == many[0].stats["prefill_ms"] for o in many[1:])
    return many


def test_text_specs_share_one_prefill_and_match_separate_runs(smollm2_first_layers):
    smollm2 = smollm2_first_layers  # bit-equal paths, not answers (conftest)
    eng = Engine(smollm2)
    # 60 prompt tokens and 24 new: past the 4 sinks and 16-token window, so every method flushes blocks
    text = "Summarise in one sentence why the sky looks blue during the day and red at sunset, please."
    ids = smollm2.prepare([{"role": "user", "content": text}]).input_ids
    assert ids.shape[1] > 40
    many = _check(eng, ids, TEXT_SPECS, max_new_tokens=24)
    assert many[1].stats["effective_bits"]["text"] < 16  # the quantized specs did quantize


@pytest.fixture(scope="module")
def aquakv_artifact(smollm2_first_layers, tmp_path_factory):
    """AQUA-KV predictors for SmolLM2's shape fitted (Alg. 1) on random layered keys and values: the method's
    cross-layer prediction and per-row state run as with a real artifact (the answers' quality is not the point)."""
    from mmkv.calibrate.aquakv import calibrate
    from mmkv.methods import aquakv as A
    from mmkv.methods.artifacts import Artifact, shape_of

    ad = smollm2_first_layers.adapter
    c = ad.num_kv_heads * ad.head_dim
    g = torch.Generator().manual_seed(0)
    k = torch.randn(400, c, generator=g)
    ks, vs = [], []
    for _ in range(ad.num_layers):
        k = 0.8 * k + 0.3 * torch.randn(400, c, generator=g)
        ks.append(k)
        vs.append(0.5 * k + torch.randn(400, c, generator=g))
    cfg = A.AquaKV(bits=2, quantizer="hadamard")
    res = calibrate(ks, vs, torch.arange(400) < 320, cfg, log=lambda *a: None)
    folder = tmp_path_factory.mktemp("aquakv-smollm2")
    Artifact("aquakv", ad.name, shape_of(ad), res["predictors"].tensors(), {"config": cfg.config()}).save(folder)
    return folder


def test_aquakv_shares_the_prefill(smollm2_first_layers, aquakv_artifact):
    smollm2 = smollm2_first_layers
    eng = Engine(smollm2)
    ids = smollm2.prepare([{"role": "user", "content": "Count from one to twenty in words, please."}]).input_ids
    spec = f"text=aquakv:quantizer=hadamard,artifact={aquakv_artifact},block=8 window=8 sinks=2"
    _check(eng, ids, ["text=kivi:bits=2 window=8 sinks=2", spec, "fp16"], max_new_tokens=16)


def test_batch_of_padded_prompts(smollm2_first_layers):
    smollm2 = smollm2_first_layers  # bit-equal paths, not answers (conftest)
    eng = Engine(smollm2)
    chats = [[{"role": "user", "content": "Hi."}],
             [{"role": "user", "content": "List four prime numbers larger than ten, separated by commas."}]]
    _check(eng, chats, ["fp16", "text=kivi:bits=2 window=8 sinks=2"], max_new_tokens=12)


def test_vlm_visual_specs(tiny_random_llava, cat_image_path):
    eng = Engine(tiny_random_llava)
    chat = [{"role": "user", "content": [{"type": "image", "image": str(cat_image_path)},
                                         {"type": "text", "text": "What is in the picture?"}]}]
    _check(eng, chat, ["fp16", "visual=calibquant:bits=1", "visual=calibquant:bits=2 text=kivi:bits=2 window=8"],
           max_new_tokens=6)


def test_one_spec_is_plain_generate(smollm2):
    eng = Engine(smollm2)
    ids = smollm2.prepare([{"role": "user", "content": "Say yes."}]).input_ids
    (one,) = eng.generate_many(ids, ["text=kivi:bits=2"], max_new_tokens=4)
    assert torch.equal(one.tokens, eng.generate(ids, "text=kivi:bits=2", max_new_tokens=4).tokens)
    assert "shared_prefill" not in one.stats


def test_bad_calls(smollm2):
    eng = Engine(smollm2)
    ids = smollm2.prepare([{"role": "user", "content": "Say yes."}]).input_ids
    with pytest.raises(ValueError, match="at least one spec"):
        eng.generate_many(ids, [])
    past = eng.generate(ids, "fp16", max_new_tokens=2)
    with pytest.raises(ValueError, match="later chat turn"):
        eng.generate_many(ids, ["fp16", "text=kivi:bits=2"], past=past)
    with pytest.raises(ValueError):
        eng.generate_many(ids, ["fp16", "text=nosuchmethod"])


def test_a_failed_forward_leaves_the_cache_class_update(smollm2, monkeypatch):
    """The tee is an instance attribute for the forward only: after an error the cache updates as its class says."""
    from mmkv import engine as engine_mod
    from mmkv.cache import MMKVCache

    eng = Engine(smollm2)
    ids = smollm2.prepare([{"role": "user", "content": "Say yes."}]).input_ids
    made = []
    real = MMKVCache.for_model.__func__

    def spy(cls, *a, **kw):
        made.append(real(cls, *a, **kw))
        return made[-1]

    monkeypatch.setattr(MMKVCache, "for_model", classmethod(spy))
    monkeypatch.setattr(engine_mod, "cache_kwargs", lambda model, cache: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        eng.generate_many(ids, ["fp16", "text=kivi:bits=2"], max_new_tokens=2)
    assert made and all("update" not in c.__dict__ for c in made)


def test_the_apps_compare_endpoint_prefills_once(smollm2):
    """``/compare`` on mmkv's engine: one prompt forward, and the same two answers as two ``generate`` calls."""
    from mmkv.ui.api import answer_both
    from mmkv.ui.chat import GenParams

    class Host:
        engine = Engine(smollm2)

    msgs = [{"role": "user", "content": "Name a colour of the sky."}]
    params = GenParams(8, 0.0, 1.0, -1, 8, 0.0)
    seen, handle = _prompt_forwards(smollm2.model)
    try:
        (base, base_out), (mine, mine_out) = answer_both(Host, msgs, "text=kivi:bits=2 window=4 sinks=2", params)
    finally:
        handle.remove()
    assert sum(n > 1 for n in seen) == 1
    alone = Host.engine.generate(msgs, "text=kivi:bits=2 window=4 sinks=2", **params.engine_kwargs())
    assert mine["text"] == alone.text[0] and torch.equal(mine_out.tokens, alone.tokens)
    assert base["text"] == Host.engine.generate(msgs, "fp16", **params.engine_kwargs()).text[0]
    assert mine["stats"]["shared_prefill"] is True and "shared_prefill" not in base["stats"]


def test_the_pages_compare_mode_streams_both_answers_from_one_prefill(smollm2):
    from mmkv.ui import chat
    from mmkv.ui.session import Session
    from mmkv.ui.uploads import Limits

    eng = Engine(smollm2)
    info = {"takes_images": False, "takes_video": False}
    params = chat.GenParams(8, 0.0, 1.0, -1, 8, 0.0)
    spec = "text=kivi:bits=2 window=4 sinks=2"
    s = Session()
    chat.add_turn(s, "Name a colour of the sky.", info, Limits())
    seen, handle = _prompt_forwards(smollm2.model)
    try:
        steps = list(chat.respond(s, eng, info, spec, params, compare=True))
    finally:
        handle.remove()
    assert sum(n > 1 for n in seen) == 1 and len(steps) > 2  # streamed piece by piece, one prompt forward
    msgs = s.last_messages
    assert s.fp16_output.text[0] == eng.generate(msgs, "fp16", **params.engine_kwargs()).text[0]
    assert torch.equal(s.last_output.tokens, eng.generate(msgs, spec, **params.engine_kwargs()).tokens)
    assert s.last_stats["shared_prefill"] is True and s.last_stats["prefill_ms"] == s.fp16_stats["prefill_ms"]


def test_the_shared_prefill_study_runs_and_checks_answers(smollm2, tmp_path):
    import json

    from eval.studies.shared_prefill import main

    out = tmp_path / "s.json"
    assert main(["--model", "smollm2-135m", "--repeats", "1", "--new-tokens", "3", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "smollm2-135m" and len(row["two_generate_s"]) == len(row["generate_many_s"]) == 1
    assert row["speedup"] > 0 and row["prefill_ms"] > 0 and all(1 <= n <= 3 for n in row["new_tokens"])
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
