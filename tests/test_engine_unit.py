"""Engine on a tiny random-weight model (2 layers, hidden 256, the SmolLM2 tokenizer): fast enough for mutmut's
test selection, so every mutant of mmkv/engine.py is checked (docs/TESTING.md).

Expected values never come from the engine's own path: greedy tokens from the model's ``generate`` over its own
``DynamicCache``, NLL from one parallel forward, positions and byte counts from their definition, the stats
throttle and span counts by hand.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import mmkv
from mmkv import engine as E
from mmkv.engine import Engine, _count_spans, _eos_ids

SPEC = "fp16 window=8 sinks=2"
LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"


@pytest.fixture(scope="module")
def lm():
    lm = mmkv.load_model("random:smollm2-135m", device="cpu", dtype=torch.float32, tiny=True)
    # Random init makes attention almost uniform, so positions would barely matter: sharpen the query/key
    # projections (logits x 36) so that a RoPE position off by one changes the greedy tokens.
    _sharpen(lm.model)
    return lm


def _sharpen(model):
    for name, mod in model.named_modules():
        if "vision" not in name and name.endswith(("q_proj", "k_proj")):
            mod.weight.mul_(6)


@pytest.fixture(scope="module")
def llava():
    lm = mmkv.load_model("random:llava-1.5-7b", device="cpu", dtype=torch.float32, tiny=True)
    _sharpen(lm.model)
    return lm


@pytest.fixture(scope="module")
def eng(lm):
    return Engine(lm)


def hf_greedy(lm, prompts, n):
    prep = lm.prepare(prompts)
    with torch.inference_mode():
        out = lm.model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=0)
    return prep, out[:, prep.input_ids.shape[1]:]


def test_engine_reads_model_parts(lm, eng):
    assert eng.model is lm.model and eng.adapter is lm.adapter
    assert eng.tokenizer is lm.processor  # a tokenizer has no .tokenizer: it is its own
    assert eng.device == torch.device("cpu") and eng.devices == [torch.device("cpu")]
    assert eng.graphs is True and Engine(lm, graphs=False).graphs is False
    assert not lm.model.training


def test_processor_tokenizer_attribute_is_used():
    tok = object()
    model = torch.nn.Embedding(3, 2)
    model.get_input_embeddings = lambda: model
    e = Engine((model, SimpleNamespace(tokenizer=tok), None))
    assert e.tokenizer is tok


@pytest.mark.parametrize("prompts", [[LONG], ["Hi", LONG]], ids=["one", "padded-batch"])
def test_fp16_greedy_equals_model_generate_and_outputs_are_consistent(lm, eng, prompts):
    n = 5
    prep, ref = hf_greedy(lm, prompts, n)
    out = eng.generate(prompts, spec=SPEC, max_new_tokens=n)
    assert torch.equal(out.tokens, ref)
    assert out.text == lm.processor.batch_decode(ref, skip_special_tokens=True)
    # fed ids: the prompt then every generated token but the last
    assert torch.equal(out.fed_ids, torch.cat([prep.input_ids, ref[:, :-1]], 1))
    mask = prep.attention_mask
    assert torch.equal(out.attention_mask, torch.cat([mask, torch.ones(len(prompts), n - 1, dtype=mask.dtype)], 1))
    # the next token's position = number of real tokens fed so far in its row
    assert out.next_position.tolist() == out.attention_mask.sum(1).tolist()
    s = out.stats
    assert s["spec"] == str(mmkv.CacheSpec.parse(SPEC)) and out.spec == mmkv.CacheSpec.parse(SPEC)
    assert s["new_tokens"] == n * len(prompts)
    assert s["prompt_tokens"] == {"visual": 0, "text": int(mask.sum())}
    assert [t["step"] for t in s["timeline"]] == list(range(1, n + 1))
    assert s["prefill_ms"] > 0 and s["decode_tokens_per_s"] > 0
    assert s["peak_memory_bytes"] is None and "cache_bytes_by_device" not in s
    # fp32 model on CPU: 2 layers x K,V x 1 kv head x 64 dims x 4 bytes per stored token
    per_tok = 2 * 2 * 1 * 64
    stored = int(out.attention_mask.sum())  # every fed token (padding holds nothing)
    assert s["cache_tokens"]["visual"] == 0 and sum(s["cache_tokens"].values()) == stored
    assert s["fp16_equivalent_bytes"] == 4 * per_tok * stored
    assert sum(s["cache_bytes_used"].values()) == 4 * per_tok * stored
    assert s["effective_bits"]["total"] == pytest.approx(32.0)
    assert s["cache_dtype"] == "fp32"
    assert s["timeline"][-1]["tokens_per_s"] > 0 and s["timeline"][-1]["cache_bytes"] > 0


def test_quantized_text_stats(eng):
    out = eng.generate(LONG, spec="text=kivi:bits=2 window=8 sinks=2", max_new_tokens=3)
    s = out.stats
    # every token fed is stored once: sinks + window + a partial block in fp16, whole 32-token blocks quantized
    n = out.fed_ids.shape[1]
    assert sum(s["cache_tokens"].values()) == n and n > 2 + 8 + 32
    assert s["cache_tokens"]["text"] == 32 * ((n - 2 - 8) // 32) and s["cache_tokens"]["fp16"] == n - 32
    # KIVI-2, group 32: 2-bit codes + an fp16 scale and zero per 32 values = 3 bits per element
    assert s["effective_bits"]["text"] == pytest.approx(3.0)
    assert s["fp16_equivalent_bytes"] == 4 * 2 * 2 * 64 * out.fed_ids.shape[1]


def test_score_equals_one_parallel_pass(lm, eng):
    ids = lm.processor(LONG, return_tensors="pt").input_ids[:, :12]
    ids = torch.cat([ids, ids.flip(1)], 0)  # two windows of the same length, scored together
    with torch.inference_mode():
        logits = lm.model(input_ids=ids).logits[:, :-1].float()
    want = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
    t = ids.shape[1]
    for chunk in (1, 3, 5):
        got = eng.score(ids, spec=SPEC, chunk=chunk)
        assert got["tokens"] == 2 * (t - 1)
        assert got["nll"] == pytest.approx(want, rel=1e-4), chunk
        assert got["ppl"] == pytest.approx(float(torch.tensor(want / (2 * (t - 1))).exp()), rel=1e-4)
        assert got["stats"]["cache_tokens"]["visual"] == 0
        assert sum(got["stats"]["cache_tokens"].values()) == 2 * (t - 1)
        assert got["stats"]["effective_bits"]["total"] == pytest.approx(32.0)
        assert sum(got["stats"]["cache_bytes"].values()) > 0


def test_score_rejects_bad_shapes(eng):
    with pytest.raises(ValueError, match="shape"):
        eng.score(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="shape"):
        eng.score(torch.tensor([[1]]))
    assert eng.score(torch.tensor([[1, 2]]), spec=SPEC)["tokens"] == 1


def test_second_turn_equals_fresh_run_and_positions_continue(lm, eng):
    turn1 = [{"role": "user", "content": LONG}]
    a = eng.generate(turn1, spec=SPEC, max_new_tokens=4)
    n1 = a.fed_ids.shape[1]
    a_ids = a.fed_ids[0].tolist()
    assert a.next_position.tolist() == [n1]
    turn2 = turn1 + [{"role": "assistant", "content": a.text[0]}, {"role": "user", "content": "again please"}]
    fresh = eng.generate(turn2, spec=SPEC, max_new_tokens=4)
    b = eng.generate(turn2, spec=SPEC, max_new_tokens=4, past=a)
    assert torch.equal(b.tokens, fresh.tokens)
    assert torch.equal(b.fed_ids, fresh.fed_ids)
    assert b.next_position.tolist() == [b.fed_ids.shape[1]]
    assert b.attention_mask.shape == b.fed_ids.shape and bool(b.attention_mask.all())
    assert b.cache is a.cache and b.cache.get_seq_length() == b.fed_ids.shape[1]
    full = lm.prepare(turn2).input_ids[0].tolist()
    old = a_ids
    common = next(i for i in range(len(old) + 1) if i == len(old) or old[i] != full[i])
    assert 0 < common <= n1  # (the template may re-encode the answer: part of turn 1's tail is then dropped)
    assert b.stats["prompt_tokens"]["text"] == len(full) - common  # only the suffix the cache had not seen


def test_second_turn_that_rewrites_history_crops_and_equals_fresh_run(eng):
    a = eng.generate([{"role": "user", "content": LONG}], spec=SPEC, max_new_tokens=3)
    other = [{"role": "user", "content": LONG.replace("fifteen", "sixteen")},
             {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    fresh = eng.generate(other, spec=SPEC, max_new_tokens=4)
    b = eng.generate(other, spec=SPEC, max_new_tokens=4, past=a)
    assert torch.equal(b.tokens, fresh.tokens)
    assert torch.equal(b.fed_ids, fresh.fed_ids)
    assert b.next_position.tolist() == [fresh.fed_ids.shape[1]]
    assert b.cache.get_seq_length() == fresh.fed_ids.shape[1]


def test_identical_second_prompt_feeds_only_the_last_token(lm, eng):
    a = eng.generate(LONG, spec=SPEC, max_new_tokens=2)
    ids = a.fed_ids  # the whole history again: one token must still be fed to get logits
    fresh = eng.generate(ids, spec=SPEC, max_new_tokens=3)
    b = eng.generate(ids, spec=SPEC, max_new_tokens=3, past=a)
    assert torch.equal(b.tokens, fresh.tokens)
    assert b.stats["prompt_tokens"]["text"] == 1
    assert b.cache.get_seq_length() == ids.shape[1] + 2


def test_continue_rejects_other_spec_and_batches(eng):
    a = eng.generate(LONG, spec=SPEC, max_new_tokens=1)
    with pytest.raises(ValueError, match="spec of the conversation"):
        eng.generate(LONG, spec="fp16 window=16 sinks=2", max_new_tokens=1, past=a)
    with pytest.raises(ValueError, match="batch 1"):
        eng.generate(["a", "b"], spec=SPEC, max_new_tokens=1, past=a)
    two = eng.generate(["a", "b"], spec=SPEC, max_new_tokens=1)
    with pytest.raises(ValueError, match="batch 1"):
        eng.generate("a", spec=SPEC, max_new_tokens=1, past=two)


def test_continue_drops_image_kwargs_when_no_new_visual_tokens(eng):
    past = SimpleNamespace(spec="fp16", fed_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3),
                           next_position=torch.tensor([3]), cache=SimpleNamespace(layers=[]))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    vis = torch.zeros_like(ids, dtype=torch.bool)
    kw = {"pixel_values": torch.zeros(1), "image_sizes": 1, "other": 2}
    cache, suffix, mask, v, pos, kw2, delta = eng._continue(past, ids, vis, kw, "fp16")
    assert suffix.tolist() == [[8, 9]] and mask.tolist() == [[1, 1]] and v.tolist() == [[False, False]]
    assert pos.tolist() == [[3, 4]] and kw2 == {"other": 2} and delta is None


def test_continue_keeps_only_new_images_for_llava(eng):
    class Layer:
        def __init__(self):
            self.cropped = []

        def crop(self, n):
            self.cropped.append(n)

    layers = [Layer(), Layer()]
    past = SimpleNamespace(spec="fp16", fed_ids=torch.tensor([[1, 9, 9, 2, 9, 3, 4]]),
                           attention_mask=torch.ones(1, 7), next_position=torch.tensor([7]),
                           cache=SimpleNamespace(layers=layers))
    ids = torch.tensor([[1, 9, 9, 2, 9, 3, 5, 9, 6]])  # diverges at index 6: the stored 4 is dropped
    vis = ids == 9
    pix = torch.arange(3.0)  # one row per image span: two spans seen before, one new
    adapter = eng.adapter
    try:
        eng.adapter = SimpleNamespace(family="llava")
        cache, suffix, mask, v, pos, kw, delta = eng._continue(past, ids, vis, {"pixel_values": pix}, "fp16")
        assert [lay.cropped for lay in layers] == [[1], [1]]
        assert past.fed_ids.tolist() == [[1, 9, 9, 2, 9, 3]] and past.attention_mask.shape == (1, 6)
        assert past.next_position.tolist() == [6]
        assert suffix.tolist() == [[5, 9, 6]] and v.tolist() == [[False, True, False]]
        assert pos.tolist() == [[6, 7, 8]]
        assert kw["pixel_values"].tolist() == [2.0]
        eng.adapter = SimpleNamespace(family="internvl")
        past.fed_ids = torch.tensor([[1, 9, 9, 2, 9, 3]])
        with pytest.raises(ValueError, match="LLaVA"):
            eng._continue(past, ids, vis, {"pixel_values": pix}, "fp16")
        # visual history but no pixel values passed: nothing to cut, no error
        eng._continue(past, ids, vis, {}, "fp16")
    finally:
        eng.adapter = adapter


def test_count_spans_by_hand():
    assert _count_spans(torch.tensor([0, 0, 0])) == 0
    assert _count_spans(torch.tensor([1, 1, 0])) == 1
    assert _count_spans(torch.tensor([0, 1, 1, 0, 1, 0, 1, 1])) == 3
    assert _count_spans(torch.tensor([True, False, True])) == 2


def test_eos_ids_from_generation_config_or_tokenizer():
    tok = SimpleNamespace(eos_token_id=7)
    assert _eos_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[3, 4])), tok) == {3, 4}
    assert _eos_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=(3,))), tok) == {3}
    assert _eos_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=5)), tok) == {5}
    assert _eos_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)), tok) == {7}
    assert _eos_ids(SimpleNamespace(), tok) == {7}
    assert _eos_ids(SimpleNamespace(), SimpleNamespace(eos_token_id=None)) == set()


def test_image_prompt_routes_visual_tokens_and_a_later_turn_reuses_them(llava, square_image_path):
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(square_image_path)},
                                         {"type": "text", "text": "What is in the picture?"}]}]
    prep = llava.prepare(msgs)
    n_vis = int(prep.visual_mask.sum())
    assert n_vis == 576
    with torch.inference_mode():
        ref = llava.model.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, max_new_tokens=4,
                                   min_new_tokens=4, do_sample=False, **prep.model_kwargs)[:, prep.input_ids.shape[1]:]
    e = Engine(llava)
    spec = "visual=calibquant:bits=8 text=fp16 window=8 sinks=2"
    out = e.generate(msgs, spec="fp16 window=8 sinks=2", max_new_tokens=4)
    assert torch.equal(out.tokens, ref)
    q = e.generate(msgs, spec=spec, max_new_tokens=4)
    n_text = prep.input_ids.shape[1] - n_vis
    assert q.stats["prompt_tokens"] == {"visual": n_vis, "text": n_text}
    assert q.stats["cache_tokens"]["visual"] == n_vis  # the visual mask reached the cache
    assert q.stats["cache_tokens"]["text"] + q.stats["cache_tokens"]["fp16"] == n_text + 3
    turn2 = msgs + [{"role": "assistant", "content": q.text[0]}, {"role": "user", "content": "And the colour?"}]
    fresh = e.generate(turn2, spec=spec, max_new_tokens=4)
    b = e.generate(turn2, spec=spec, max_new_tokens=4, past=q)
    assert b.stats["prompt_tokens"]["visual"] == 0 and b.cache.tokens_by_modality()["visual"] == n_vis
    assert b.next_position.tolist() == [fresh.fed_ids.shape[1]] and torch.equal(b.fed_ids, fresh.fed_ids)
    # a new image in the later turn: only its pixels are fed
    turn3 = turn2 + [{"role": "assistant", "content": b.text[0]},
                     {"role": "user", "content": [{"type": "image", "image": str(square_image_path)},
                                                  {"type": "text", "text": "And this one?"}]}]
    c = e.generate(turn3, spec=spec, max_new_tokens=2, past=b)
    assert c.stats["prompt_tokens"]["visual"] == n_vis and c.cache.tokens_by_modality()["visual"] == 2 * n_vis


def test_eos_from_the_tokenizer_and_pad_from_eos(lm, eng):
    _, ref = hf_greedy(lm, ["Hi", LONG], 4)
    eos = int(ref[0, 0])
    gc, tok = lm.model.generation_config, lm.processor
    old, old_eos, old_pad = gc.eos_token_id, tok.eos_token, tok.pad_token
    try:
        gc.eos_token_id = None
        tok.eos_token = tok.convert_ids_to_tokens(eos)  # the tokenizer's eos is used when the model names none
        tok.pad_token = None  # no pad token: finished rows are filled with the eos
        assert tok.eos_token_id == eos and tok.pad_token_id is None
        out = eng.generate(["Hi", LONG], spec=SPEC, max_new_tokens=4)
        assert out.tokens[0, 0] == eos and all(t == eos for t in out.tokens[0].tolist())
        assert out.tokens[1, 0] == ref[1, 0]
        tok.eos_token = None  # no eos anywhere and no pad: nothing stops a row early
        assert tok.eos_token_id is None
        out = eng.generate(["Hi", LONG], spec=SPEC, max_new_tokens=3)
        assert out.tokens.shape == (2, 3) and out.tokens[0, 0] == eos
    finally:
        gc.eos_token_id, tok.eos_token, tok.pad_token = old, old_eos, old_pad
    assert tok.pad_token_id == 2


def test_stats_follow_the_clock(eng, monkeypatch):
    ticks = iter(range(100))
    monkeypatch.setattr(E, "time", SimpleNamespace(perf_counter=lambda: 1.0 + next(ticks) * 0.5))
    out = eng.generate(LONG, spec=SPEC, max_new_tokens=3)
    s = out.stats
    # clock reads: prefill start 1.0, end 1.5; after each of the 3 tokens 2.0, 2.5, 3.0; the final count 3.5
    assert s["prefill_ms"] == 500.0
    assert [e["t_s"] for e in s["timeline"]] == [0.5, 1.0, 1.5]
    assert [e["tokens_per_s"] for e in s["timeline"]] == [2.0, 2.0, 2.0]
    assert s["decode_tokens_per_s"] == 1.5


def test_stream_never_shows_half_a_character(lm, eng, monkeypatch):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = lm.processor
    b2u = bytes_to_unicode()
    emoji = [tok.convert_tokens_to_ids(b2u[b]) for b in "\U0001F642".encode()]  # one byte per token
    script = [tok.encode("ok")[0], *emoji]
    assert tok.decode(script[:2]).endswith("\ufffd") and tok.decode(script) == "ok\U0001F642"
    it = iter(script)
    monkeypatch.setattr(E, "choose", lambda logits, *a: torch.full(logits.shape[:1], next(it), dtype=torch.long))
    s = eng.stream(LONG, spec=SPEC, max_new_tokens=len(script))
    pieces = list(s)
    assert pieces == ["ok", "\U0001F642"] and s.output.text == ["ok\U0001F642"]
    assert s.output.tokens.tolist() == [script]
    assert s.output.fed_ids[0, -len(script) + 1:].tolist() == script[:-1]


def test_eos_stops_a_row_and_pads_it(lm, eng):
    _, ref = hf_greedy(lm, ["Hi", LONG], 4)
    eos = int(ref[0, 0])
    gc = lm.model.generation_config
    old = gc.eos_token_id
    try:
        gc.eos_token_id = eos  # row 0 ends at its first token
        out = eng.generate(["Hi", LONG], spec=SPEC, max_new_tokens=4)
        pad = lm.processor.pad_token_id
        want1 = ref[1].tolist()
        if eos in want1:  # row 1 may end too
            want1 = want1[: want1.index(eos) + 1]
        assert out.tokens.shape == (2, max(1, len(want1)))
        assert out.tokens[0].tolist() == [eos] + [pad] * (out.tokens.shape[1] - 1)
        assert out.tokens[1].tolist() == want1
        # the pad is a special token: neither the text nor the stream shows it
        assert pad in lm.processor.all_special_ids and out.text[0] == lm.processor.decode([eos])
        st = eng.stream(["Hi", LONG], spec=SPEC, max_new_tokens=4)
        assert list(st) == [lm.processor.decode([eos])]
        one = eng.generate("Hi", spec=SPEC, max_new_tokens=4)
        assert one.tokens.tolist() == [[eos]]  # stops at once, the eos is kept
    finally:
        gc.eos_token_id = old


def test_max_new_tokens_and_stop(eng):
    assert eng.generate(LONG, spec=SPEC, max_new_tokens=1).tokens.shape == (1, 1)
    stop = threading.Event()
    stop.set()
    s = eng.stream(LONG, spec=SPEC, max_new_tokens=5, stop=stop)
    list(s)
    assert s.output.tokens.shape == (1, 1)
    s2 = eng.stream(LONG, spec=SPEC, max_new_tokens=5)
    it = iter(s2)
    next(it, None)
    s2.stop()
    list(it)
    assert s2.output.tokens.shape[1] <= 2
    with pytest.raises(ValueError):
        eng.stream(LONG, spec=SPEC, max_new_tokens=0)


def test_stream_pieces_join_to_the_text(eng):
    s = eng.stream(["Hi", LONG], spec=SPEC, max_new_tokens=6)
    pieces = list(s)
    assert all(pieces) and "".join(pieces) == s.output.text[0]


def test_sampling_follows_seed_temperature_and_top_p(lm, eng):
    _, ref = hf_greedy(lm, [LONG], 4)
    kw = dict(spec=SPEC, max_new_tokens=4, do_sample=True)
    a = eng.generate(LONG, temperature=1.5, top_p=1.0, seed=3, **kw).tokens
    assert torch.equal(a, eng.generate(LONG, temperature=1.5, top_p=1.0, seed=3, **kw).tokens)
    others = [eng.generate(LONG, temperature=1.5, top_p=1.0, seed=s, **kw).tokens for s in (4, 5, 6)]
    assert any(not torch.equal(a, o) for o in others)  # the seed reaches the sampler
    # top_p so small that only the most likely token survives, and temperature 0: both are greedy
    assert torch.equal(eng.generate(LONG, temperature=1.5, top_p=1e-9, seed=3, **kw).tokens, ref)
    assert torch.equal(eng.generate(LONG, temperature=0.0, top_p=1.0, seed=3, **kw).tokens, ref)
    # do_sample=False ignores temperature/top_p
    g = eng.generate(LONG, spec=SPEC, max_new_tokens=4, temperature=1.5, top_p=0.5, seed=3).tokens
    assert torch.equal(g, ref)


class FakeCache:
    def __init__(self):
        self.counts = 0

    def nbytes_by_modality(self, used=False):
        self.counts += 1
        return {"visual": 1, "text": 2, "fp16": 30 if used else 40}

    def effective_bits(self):
        return {"total": 3.0}

    def fp16_equivalent_bytes(self):
        return 99

    def dense_dtype(self):
        return "fp16"

    def tokens_by_modality(self):
        return {"visual": 0, "text": 5, "fp16": 1}

    def nbytes_by_device(self):
        return {"cuda:0": 1, "cuda:1": 2}


def test_step_stats_recounts_the_cache_at_most_every_quarter_second(eng):
    s = E.Stream(eng, "x", "fp16")
    c = FakeCache()
    times = [0.125, 0.25, 0.375, 0.5, 0.625, 1.0]  # binary fractions: the differences are exact
    for i, t in enumerate(times, 1):
        s._step_stats(c, i * 2, t)
    # recounts (2 calls each: bytes held and bytes used) at 0.125, 0.375 (= 0.125 + 0.25), 0.625, 1.0
    assert c.counts == 2 * 4 and E.CACHE_STATS_EVERY_S == 0.25
    st = s.stats
    assert st["new_tokens"] == 12 and st["decode_tokens_per_s"] == pytest.approx(12 / 1.0)
    assert st["cache_bytes"] == {"visual": 1, "text": 2, "fp16": 40}
    assert st["cache_bytes_used"] == {"visual": 1, "text": 2, "fp16": 30}
    assert st["effective_bits"] == {"total": 3.0} and st["fp16_equivalent_bytes"] == 99
    assert st["cache_dtype"] == "fp16" and st["cache_tokens"] == {"visual": 0, "text": 5, "fp16": 1}
    tl = st["timeline"]
    assert [e["step"] for e in tl] == [1, 2, 3, 4, 5, 6]
    assert [e["t_s"] for e in tl] == times
    assert tl[1]["tokens_per_s"] == pytest.approx(4 / 0.25) and tl[0]["cache_bytes"] == 43
    s2 = E.Stream(eng, "x", "fp16")
    c2 = FakeCache()
    s2._step_stats(c2, 3, 0.0)
    assert s2.stats["decode_tokens_per_s"] == 0.0 and c2.counts == 2
    s2._step_stats(c2, 3, 0.25)  # exactly the period: recount
    assert c2.counts == 4


def test_final_stats_counts_exactly_and_per_device_when_sharded(eng):
    s = E.Stream(eng, "x", "fp16")
    c = FakeCache()
    cpu = torch.device("cpu")
    s._final_stats(c, 10, 2.0, cpu, [cpu])
    st = s.stats
    assert st["cache_bytes"]["fp16"] == 40 and st["cache_bytes_used"]["fp16"] == 30
    assert st["cache_tokens"]["text"] == 5 and st["effective_bits"] == {"total": 3.0}
    assert st["fp16_equivalent_bytes"] == 99 and st["cache_dtype"] == "fp16"
    assert st["decode_tokens_per_s"] == pytest.approx(5.0) and st["peak_memory_bytes"] is None
    assert "cache_bytes_by_device" not in st and "peak_memory_bytes_by_device" not in st
    s._final_stats(c, 10, 0.0, cpu, [cpu, cpu])
    assert st["decode_tokens_per_s"] == 0.0
    assert st["cache_bytes_by_device"] == {"cuda:0": 1, "cuda:1": 2}
    assert st["peak_memory_bytes_by_device"] == {}  # no CUDA device among them


def test_stream_keeps_its_arguments(eng):
    stop = threading.Event()
    s = E.Stream(eng, "x", "text=kivi:bits=2", max_new_tokens=7, do_sample=True, temperature=0.5, top_p=0.7,
                 seed=11, stop=stop, video_frames=3, video_fps=2.0)
    assert s.spec == mmkv.CacheSpec.parse("text=kivi:bits=2") and s.stats["spec"] == str(s.spec)
    assert (s.max_new_tokens, s.do_sample, s.temperature, s.top_p, s.seed) == (7, True, 0.5, 0.7, 11)
    assert s.stop_event is stop and s.video == (3, 2.0) and s.output is None and s.past is None
    assert s.stats["timeline"] == [] and s.stats["new_tokens"] == 0
    d = E.Stream(eng, "x", None)
    assert (d.max_new_tokens, d.do_sample, d.temperature, d.top_p, d.seed) == (128, False, 1.0, 1.0, None)
    assert not d.stop_event.is_set()
    d.stop()
    assert d.stop_event.is_set()
    for bad in [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)]:
        with pytest.raises(ValueError):
            E.Stream(eng, "x", None, **bad)
