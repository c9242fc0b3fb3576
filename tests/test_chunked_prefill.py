"""Chunked prefill in the scheduler (mmkv/batching/chunks.py): the pieces of a prompt, greedy tokens against a
one-shot prefill where the two are the same attention (fp16, a window holding the whole prompt) and against the
engine's own prefill-then-extend of the same pieces where quantized segments cross piece boundaries, a visual
span kept whole on a tiny LLaVA, and a running request decoding at every step while another one's pieces prefill.

Why not one-shot for quantized text: a later piece attends to the earlier pieces as the cache stores them (text
past the sinks and window already quantized), where a one-shot prefill attends to every prompt token in fp16. So
the reference is the engine's multi-turn path (``Engine.generate(past=...)``), which extends a stored cache with
new tokens: its own code, not the scheduler's.
"""

from __future__ import annotations

import pytest
import torch

from mmkv.batching import Scheduler
from mmkv.batching.chunks import check_chunk, plan

KIVI = "text=kivi:bits=2,group=16 window=8 sinks=4"
XQUANT = "text=xquant:kq=15,km=10,vm=10,group=16 window=8 sinks=4"
KIVI_WIDE = "text=kivi:bits=2,group=16 window=256 sinks=4"  # the prompt and answer stay in the fp16 window
LONG = ("Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night, the "
        "ships that pass in the fog, the gulls on the rocks, the lamp that must be lit at dusk, and what the "
        "message says when the keeper finally opens it by the fire with a cup of tea")
N, CHUNK = 8, 16


def _mask(t: int, spans=()) -> torch.Tensor:
    m = torch.zeros(t, dtype=torch.bool)
    for a, b in spans:
        m[a:b] = True
    return m


@pytest.mark.parametrize("t, spans, chunk, want", [
    (10, (), None, [(0, 10)]),
    (10, (), 4, [(0, 4), (4, 8), (8, 10)]),
    (3, (), 8, [(0, 3)]),
    (3, (), 1, [(0, 1), (1, 2), (2, 3)]),
    (10, [(2, 7)], 4, [(0, 10)]),  # the span ends past the first chunk, less than a chunk of text follows: one piece
    (12, [(2, 7)], 4, [(0, 7), (7, 11), (11, 12)]),  # a chunk or more follows: the first piece ends with the span
    (6, [(0, 1)], 4, [(0, 6)]),  # the first chunk holds the span and less than a chunk of text remains
    (10, [(7, 10)], 4, [(0, 10)]),  # an image at the very end: one piece
    (12, [(1, 3), (6, 8)], 3, [(0, 8), (8, 11), (11, 12)]),  # every span in the first piece
    (9, [(0, 2)], 4, [(0, 4), (4, 8), (8, 9)]),
])
def test_plan_cuts_only_text_after_the_last_visual_token(t, spans, chunk, want):
    got = plan(_mask(t, spans), chunk)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == t and all(a == b for (_, a), (b, _) in zip(got, got[1:]))
    if spans:
        assert max(b for _, b in spans) <= got[0][1]
    assert all(b - a <= chunk for a, b in got[1:]) if chunk else len(got) == 1


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "512"])
def test_a_bad_chunk_size_is_refused(bad):
    with pytest.raises(ValueError, match="prefill_chunk"):
        check_chunk(bad)
    with pytest.raises(ValueError, match="empty prompt"):
        plan(_mask(0), 4)


@pytest.fixture(scope="module")
def eng(smollm2):
    import mmkv

    return mmkv.Engine(smollm2)


@pytest.fixture(scope="module")
def ids(eng):
    return eng.tokenizer(LONG, return_tensors="pt").input_ids


def _chunked(eng, x, spec, chunk=CHUNK, n=N):
    s = Scheduler(eng, prefill_chunk=chunk)
    job = s.submit(x, spec=spec, max_new_tokens=n)
    s.drain(400)
    return s, job


def _extend_reference(eng, x, spec, chunk, n):
    """The engine's multi-turn path over the same pieces: each turn feeds the next piece over the stored cache."""
    out = None
    for end in range(chunk, x.shape[1], chunk):
        out = eng.generate(x[:, :end], spec=spec, max_new_tokens=1, past=out)
    return eng.generate(x, spec=spec, max_new_tokens=n, past=out).tokens[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["fp16", KIVI_WIDE])
def test_chunked_equals_one_shot_where_no_prompt_token_is_quantized(eng, ids, spec):
    want = eng.generate(ids, spec=spec, max_new_tokens=N).tokens[0].tolist()
    s, job = _chunked(eng, ids, spec)
    t = ids.shape[1]
    assert t > 3 * CHUNK  # four pieces, the last one short
    assert job.tokens == want
    pieces = [e[3:] for e in s.log if e[1] == "prefill"]
    assert pieces == [(a, min(a + CHUNK, t)) for a in range(0, t, CHUNK)]
    assert (s.prefill_chunks, s.prefill_tokens) == (len(pieces), t)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [KIVI, XQUANT])
def test_chunked_quantized_equals_the_engines_prefill_then_extend(eng, ids, spec):
    want = _extend_reference(eng, ids, spec, CHUNK, N)
    s, job = _chunked(eng, ids, spec)
    assert job.tokens == want
    # the pieces really crossed quantized segments: the prompt alone already flushed text past the window
    assert job.kv.by_modality(0, ids.shape[1])["text"] > 0
    unchunked = _chunked(eng, ids, spec, chunk=None)[1]
    assert unchunked.tokens == eng.generate(ids, spec=spec, max_new_tokens=N).tokens[0].tolist()


@pytest.mark.slow
def test_a_running_request_decodes_at_every_step_while_another_prefills(eng, ids):
    s = Scheduler(eng, prefill_chunk=CHUNK)
    story = eng.tokenizer("The sea at night is", return_tensors="pt").input_ids
    assert story.shape[1] <= CHUNK
    short = s.submit(story, spec=KIVI, max_new_tokens=12)
    s.step()  # the short prompt is one piece (as alone): it decodes from the first step on
    long = s.submit(ids, spec=KIVI, max_new_tokens=N)
    s.drain(400)
    steps = {}
    for e in s.log:
        steps.setdefault(e[0], []).append(e[1:])
    long_steps = sorted(k for k, v in steps.items() if any(w[0] == "prefill" and w[1] == long.seq for w in v))
    assert len(long_steps) == -(-ids.shape[1] // CHUNK)  # one piece per step
    for k in long_steps:  # the running request went on decoding at each of them, after that step's piece
        kinds = [w[0] for w in steps[k]]
        assert kinds.index("prefill") < kinds.index("decode") and short.seq in steps[k][kinds.index("decode")][1]
    assert long.tokens == _extend_reference(eng, ids, KIVI, CHUNK, N)
    assert short.tokens == eng.generate(story, spec=KIVI, max_new_tokens=12).tokens[0].tolist()


@pytest.fixture(scope="module")
def llava(tiny_random_llava):
    import mmkv

    return mmkv.Engine(tiny_random_llava)


def _image_question(path):
    from tiny_vlms import image_chat

    return image_chat(str(path), text=LONG)


def _manual_pieces(eng, msgs, spec, pieces, n):
    """Prefill-then-extend by hand with the engine's functions, then greedy decode steps."""
    from mmkv.cache import MMKVCache
    from mmkv.engine import first_positions, prefill, without_media
    from mmkv.graphs import DecodeStepper
    from mmkv.models.inputs import prepare_inputs

    p = prepare_inputs(eng.adapter, msgs, eng.processor, device=eng.device)
    x, vis, kw = p.input_ids, p.visual_mask, dict(p.model_kwargs)
    pos, _ = first_positions(eng, x, torch.ones_like(x), kw)
    cache = MMKVCache.for_model(spec, eng.adapter)
    for a, b in pieces:
        logits = prefill(eng, cache, x[:, a:b], torch.ones_like(x[:, a:b]), torch.ones_like(x[:, :b]), vis[:, a:b],
                         pos[:, a:b], kw if a == 0 else without_media(kw))
    out = [int(logits.argmax(-1))]
    step = DecodeStepper(eng.model, cache, graphs=False)
    nxt = x.shape[1]
    while len(out) < n:
        with torch.inference_mode():
            logits = step(torch.tensor([[out[-1]]]), torch.tensor([[nxt]]))
        out.append(int(logits[0].argmax()))
        nxt += 1
    return out, vis[0]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["fp16", "visual=calibquant:bits=2 " + KIVI])
def test_a_visual_span_stays_in_the_first_piece_on_a_tiny_llava(llava, square_image_path, spec):
    msgs = _image_question(square_image_path)
    s, job = _chunked(llava, msgs, spec, chunk=64, n=6)
    pieces = [e[3:] for e in s.log if e[1] == "prefill"]
    vis = job.prep.visual_mask[0]
    last = int(vis.nonzero()[-1]) + 1
    assert job.n_visual == 576 and pieces[0] == (0, last) and len(pieces) > 1
    assert all(b - a <= 64 for a, b in pieces[1:]) and pieces[-1][1] == vis.numel()
    want, _ = _manual_pieces(llava, msgs, spec, pieces, 6)
    assert job.tokens[: len(want)] == want[: len(job.tokens)]
    if spec == "fp16":  # nothing quantized: the same as the one-shot prefill
        assert job.tokens == llava.generate(msgs, spec=spec, max_new_tokens=6).tokens[0].tolist()


@pytest.mark.slow
def test_m_rope_positions_carry_over_pieces_on_a_tiny_qwen2_vl(tmp_path, smollm2_load_info):
    """Qwen-VL rotates by 3-D positions from the whole prompt: text pieces after the images take their slice."""
    from PIL import Image
    from tiny_vlms import image_chat, qwen_vl

    import mmkv
    from mmkv.models.smollm2 import ensure_tokenizer

    eng = mmkv.Engine(mmkv.load_model(str(qwen_vl(tmp_path / "q", ensure_tokenizer(), "qwen2_vl")), device="cpu"))
    msgs = image_chat(Image.new("RGB", (64, 48), "teal"), text=LONG)
    want = eng.generate(msgs, spec="fp16", max_new_tokens=6).tokens[0].tolist()
    s, job = _chunked(eng, msgs, "fp16", chunk=16, n=6)
    pieces = [e[3:] for e in s.log if e[1] == "prefill"]
    assert job.delta is not None and job.n_visual > 0 and len(pieces) > 2
    assert job.tokens == want
