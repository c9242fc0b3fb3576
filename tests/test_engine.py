"""Engine end to end on the real SmolLM2 and on demo-llava (real LM, random vision tower), CPU."""

import threading

import pytest
import torch

import mmkv
from mmkv.engine import Engine

PROMPT = "Explain in two sentences why the sky is blue."
LONG = "The history of the city goes back many centuries, with records of markets and fairs. " * 14


@pytest.fixture(scope="module")
def eng(smollm2):
    return Engine(smollm2)


def hf_greedy(lm, prep, n):
    with torch.inference_mode():
        out = lm.model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, max_new_tokens=n,
                                do_sample=False, **prep.model_kwargs)
    return out[:, prep.input_ids.shape[1]:]


@pytest.mark.parametrize("prompt", [PROMPT, LONG], ids=["short", "long-flushes-window"])
def test_fp16_spec_is_token_identical_to_model_generate(smollm2, eng, prompt):
    n = 24
    prep = smollm2.prepare(prompt)
    ref = hf_greedy(smollm2, prep, n)
    out = eng.generate(prompt, spec="fp16 window=32 sinks=4", max_new_tokens=n)
    assert out.tokens.shape[1] == ref.shape[1]
    assert torch.equal(out.tokens, ref)


def test_fp16_spec_matches_model_generate_on_demo_llava_with_a_real_image(demo_llava, cat_image_path):
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(cat_image_path)},
                                         {"type": "text", "text": "What is in the picture?"}]}]
    prep = demo_llava.prepare(msgs)
    assert int(prep.visual_mask.sum()) == 576
    ref = hf_greedy(demo_llava, prep, 12)
    out = Engine(demo_llava).generate(msgs, spec="fp16", max_new_tokens=12)
    assert torch.equal(out.tokens, ref)
    assert out.stats["prompt_tokens"]["visual"] == 576
    assert out.stats["cache_tokens"]["visual"] == 576 * 1  # batch 1: 576 tokens in the visual segment


def test_calibquant_on_demo_llava_shrinks_visual_bytes(demo_llava, cat_image_path):
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(cat_image_path)},
                                         {"type": "text", "text": "Describe it."}]}]
    e = Engine(demo_llava)
    fp = e.generate(msgs, spec="fp16", max_new_tokens=4)
    q1 = e.generate(msgs, spec="visual=calibquant:bits=1", max_new_tokens=4)
    q2 = e.generate(msgs, spec="visual=calibquant:bits=2", max_new_tokens=4)
    assert q1.stats["cache_bytes"]["visual"] < q2.stats["cache_bytes"]["visual"] < fp.stats["cache_bytes"]["visual"]
    assert q1.stats["effective_bits"]["visual"] == pytest.approx(1 + 32 / 576, rel=1e-6)
    assert q1.stats["cache_bytes"]["text"] == fp.stats["cache_bytes"]["text"]


def test_batch_of_three_equals_three_single_runs(eng):
    prompts = ["Hi!", PROMPT, "List three fruits that are red and say why each is red."]
    spec = "text=kivi:bits=4 window=16 sinks=4"
    batch = eng.generate(prompts, spec=spec, max_new_tokens=12)
    for i, p in enumerate(prompts):
        single = eng.generate(p, spec=spec, max_new_tokens=12)
        n = single.tokens.shape[1]
        assert torch.equal(batch.tokens[i, :n], single.tokens[0]), i


def test_two_turn_chat_over_a_quantized_history(eng):
    spec = "text=kivi:bits=2 window=16 sinks=4"
    turn1 = [{"role": "user", "content": LONG + " Summarize this in five words."}]
    a = eng.generate(turn1, spec=spec, max_new_tokens=16)
    assert a.cache.tokens_by_modality()["text"] > 0  # the history really is quantized
    seen = a.cache.get_seq_length()
    turn2 = turn1 + [{"role": "assistant", "content": a.text[0]}, {"role": "user", "content": "Now in three words."}]
    b = eng.generate(turn2, spec=spec, max_new_tokens=12, past=a)
    assert b.tokens.shape[1] >= 1 and b.text[0].strip()
    assert b.cache is a.cache and b.cache.get_seq_length() > seen
    # the same second turn from scratch sees the same history in fp16 before routing: answers may differ a little
    fresh = eng.generate(turn2, spec=spec, max_new_tokens=12)
    assert fresh.text[0].strip()


def test_stream_yields_pieces_and_stop_really_stops(eng):
    stop = threading.Event()
    s = eng.stream(PROMPT, spec="text=kivi:bits=2", max_new_tokens=200, stop=stop)
    pieces = []
    for piece in s:
        pieces.append(piece)
        assert s.stats["timeline"] and s.stats["cache_bytes"]["fp16"] > 0
        if len(pieces) == 3:
            stop.set()
    assert s.output.tokens.shape[1] <= 4
    assert "".join(pieces) == s.output.text[0]


def test_sampling_is_seeded(eng):
    a = eng.generate(PROMPT, spec="fp16", max_new_tokens=8, do_sample=True, temperature=0.9, top_p=0.9, seed=3)
    b = eng.generate(PROMPT, spec="fp16", max_new_tokens=8, do_sample=True, temperature=0.9, top_p=0.9, seed=3)
    assert torch.equal(a.tokens, b.tokens)


def test_score_with_fp16_cache_equals_one_parallel_pass(smollm2, eng):
    ids = smollm2.processor(LONG, return_tensors="pt").input_ids[:, :80]  # 60 past sinks + window: KIVI flushes
    with torch.inference_mode():
        logits = smollm2.model(input_ids=ids).logits[0, :-1].float()
    want = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
    got = eng.score(ids, spec="fp16 window=16 sinks=4", chunk=1)
    assert got["tokens"] == 79
    assert got["nll"] == pytest.approx(want, rel=1e-4)
    chunked = eng.score(ids, spec="fp16 window=16 sinks=4", chunk=16)
    assert chunked["nll"] == pytest.approx(want, rel=1e-4)
    q = eng.score(ids, spec="text=kivi:bits=2 window=16 sinks=4", chunk=1)
    assert q["ppl"] > got["ppl"] * 0.99 and q["stats"]["effective_bits"]["text"] == pytest.approx(3.0)


def test_bad_inputs_raise_documented_errors(eng, tmp_path):
    with pytest.raises(ValueError, match="unknown|built-in"):
        mmkv.load_model("no-such-model-anywhere")
    with pytest.raises(ValueError, match="allowed values"):
        eng.generate(PROMPT, spec="text=kivi:bits=3")
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate("   ", spec="fp16")
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(PROMPT, max_new_tokens=0)


def test_unreadable_image_raises(demo_llava, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG not really an image")
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(bad)}, {"type": "text", "text": "Hi"}]}]
    with pytest.raises(ValueError, match="broken.png"):
        Engine(demo_llava).generate(msgs, max_new_tokens=2)


def test_live_cache_figures_are_counted_at_most_every_interval(eng, monkeypatch):
    """The live stats recount the cache's bytes only when CACHE_STATS_EVERY_S has passed (step 1 always); the final
    stats count them exactly."""
    import mmkv.engine as engine_mod
    from mmkv.cache import MMKVCache

    calls = []
    real = MMKVCache.nbytes_by_modality

    def counted(self, used=False):
        calls.append(used)
        return real(self, used)

    monkeypatch.setattr(MMKVCache, "nbytes_by_modality", counted)
    monkeypatch.setattr(engine_mod, "CACHE_STATS_EVERY_S", 1e9)
    out = eng.generate("Name three colours.", "text=kivi:bits=2", max_new_tokens=6)
    n = out.tokens.shape[1]
    assert n > 2 and calls.count(False) == 2  # held bytes counted at step 1 and for the final stats only
    assert [p["cache_bytes"] for p in out.stats["timeline"]] == [out.stats["timeline"][0]["cache_bytes"]] * n
    calls.clear()
    monkeypatch.setattr(engine_mod, "CACHE_STATS_EVERY_S", 0.0)
    out = eng.generate("Name three colours.", "text=kivi:bits=2", max_new_tokens=6)
    assert calls.count(False) == out.tokens.shape[1] + 1  # every step, and the final stats
    assert out.stats["cache_bytes"] == out.cache.nbytes_by_modality()
