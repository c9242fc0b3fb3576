"""The continuous-batching scheduler (mmkv/batching/scheduler.py) on SmolLM2: requests share one decode batch and
get exactly the tokens they get alone; a budget queues them, preempts and recomputes; cancelled rows leave."""

from __future__ import annotations

import pytest

from mmkv.batching import Scheduler
from mmkv.batching.kvbytes import text_len
from mmkv.batching.scheduler import bucket

SPEC = "text=kivi:bits=2,group=16 window=8 sinks=4"
XQUANT = "text=xquant:kq=15,km=10,vm=10,group=16 window=8 sinks=4"
PROMPTS = ["Name a primary colour.", "Write one line about the sea.", "What is two plus two?"]
N = 6


def _chat(p):
    return [{"role": "user", "content": p}]


@pytest.fixture(scope="module")
def eng(smollm2):
    import mmkv

    return mmkv.Engine(smollm2)


@pytest.fixture(scope="module")
def alone(eng):
    return {(p, spec): eng.generate(_chat(p), spec=spec, max_new_tokens=N).tokens[0].tolist()
            for p in PROMPTS for spec in (SPEC, "fp16")}


def test_bucket_rounds_up_to_a_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 128]
    with pytest.raises(ValueError):
        bucket(0)


@pytest.mark.slow
@pytest.mark.parametrize("buckets", [False, True])
def test_concurrent_requests_share_one_batch_and_get_their_alone_tokens(eng, alone, buckets):
    s = Scheduler(eng, buckets=buckets)
    jobs = [s.submit(_chat(p), spec=SPEC, max_new_tokens=N) for p in PROMPTS]
    sampled = s.submit(_chat(PROMPTS[0]), spec=SPEC, max_new_tokens=N, do_sample=True, temperature=0.8,
                       top_p=0.9, seed=7)
    s.drain(200)
    assert s.max_batch == 4
    for p, j in zip(PROMPTS, jobs):
        assert j.tokens == alone[(p, SPEC)] and j.finish_reason in ("length", "stop")
    want = eng.generate(_chat(PROMPTS[0]), spec=SPEC, max_new_tokens=N, do_sample=True, temperature=0.8,
                        top_p=0.9, seed=7)
    assert sampled.tokens == want.tokens[0].tolist()
    text = "".join(jobs[0].pieces(eng.tokenizer))
    assert text == eng.tokenizer.decode(jobs[0].tokens, skip_special_tokens=True)
    u = jobs[0].usage()
    assert u["new_tokens"] == len(jobs[0].tokens) and sum(u["cache_bytes_used"].values()) > 0


@pytest.mark.slow
def test_spare_rows_pad_a_batch_of_three_to_four(eng, alone):
    s = Scheduler(eng, buckets=True)
    jobs = [s.submit(_chat(p), spec=SPEC, max_new_tokens=N) for p in PROMPTS]
    s.drain(200)
    assert (s.max_batch, s.max_rows) == (3, 4)
    for p, j in zip(PROMPTS, jobs):
        assert j.tokens == alone[(p, SPEC)]


@pytest.mark.slow
def test_a_budget_for_one_request_queues_the_others_and_all_complete(eng, alone):
    probe = Scheduler(eng)
    needs = [probe.submit(_chat(p), spec="fp16", max_new_tokens=N).need for p in PROMPTS]
    s = Scheduler(eng, kv_budget_bytes=int(max(needs) * 1.2))
    jobs = [s.submit(_chat(p), spec="fp16", max_new_tokens=N) for p in PROMPTS]
    s.step()
    assert len(s.running()) == 1 and len(s.waiting) == 2
    s.drain(200)
    assert s.max_batch == 1
    for p, j in zip(PROMPTS, jobs):
        assert j.tokens == alone[(p, "fp16")] and j.preemptions == 0
    with pytest.raises(ValueError, match="budget"):
        Scheduler(eng, kv_budget_bytes=max(needs) // 2).submit(_chat(PROMPTS[0]), spec="fp16", max_new_tokens=N)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SPEC])
def test_long_generations_that_outgrow_the_budget_preempt_the_newest_and_recompute(eng, spec):
    # the ~33-token prompts leave a text segment of 4 blocks of 16 after their prefill; it grows by half once ~60
    # tokens have been generated, so the tensors outgrow what they held at the start
    n = 72
    prompts = ["The sea at night is", "Three facts about the moon are"]
    want = [eng.generate(p, spec=spec, max_new_tokens=n).tokens[0].tolist() for p in prompts]
    probe = Scheduler(eng)
    a, b = (probe.submit(p, spec=spec, max_new_tokens=n) for p in prompts)
    held = []  # what the caches' tensors hold after each step, unbounded (the budget counts these bytes)
    while probe.active() or probe.waiting:
        probe.step()
        held.append(probe.held_bytes())
    # both fit at the start (b's whole need beside a's prompt, and the tensors after the first step), not at the end
    budget = max(a.bytes_at(1) + b.need, held[0])
    assert budget < max(held)
    s = Scheduler(eng, kv_budget_bytes=budget)
    jobs = [s.submit(p, spec=spec, max_new_tokens=n) for p in prompts]
    before = None  # the preempted request's tokens when it was first preempted
    for _ in range(400):
        if not s.active() and not s.waiting:
            break
        s.step()
        assert s.held_bytes() <= budget
        if before is None and jobs[1].preemptions:
            before = list(jobs[1].tokens)
    assert s.max_batch == 2
    assert jobs[1].preemptions >= 1 and jobs[0].preemptions == 0
    assert jobs[0].tokens == want[0]
    # The recompute feeds the generated tokens in forwards of several tokens (chunks.py), whose roundings differ
    # from one-token steps: with one torch thread (the suite's workers) the greedy tokens after the preemption
    # point parted from the alone run's (and ended at an end-of-turn), with two they did not. What must hold
    # exactly: the tokens up to the preemption; after it, an answer that ends as answers end.
    assert before and before == want[1][:len(before)]
    assert jobs[1].tokens[:len(before)] == before and len(before) < len(jobs[1].tokens) <= n
    assert jobs[1].finish_reason in ("length", "stop")


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SPEC, XQUANT])
def test_a_request_preempted_after_its_decode_steps_flushed_gets_its_alone_tokens(eng, spec):
    """The recompute must leave the cache as the decode steps did: they quantized each flushed block before the
    token that flushed it attended (chunks.py feeds the tokens back that way; one forward of them all would not)."""
    n = 24
    want = [eng.generate(_chat(p), spec=spec, max_new_tokens=n).tokens[0].tolist() for p in PROMPTS[:2]]
    s = Scheduler(eng)
    jobs = [s.submit(_chat(p), spec=spec, max_new_tokens=n) for p in PROMPTS[:2]]
    while len(jobs[1].tokens) < 14:
        s.step()
    late = jobs[1]
    # its decode steps flushed a block (sinks 4, window 8, block 16) since its prompt
    assert text_len(late.n_text + len(late.tokens), 4, 8, 16) > text_len(late.n_text, 4, 8, 16)
    s.budget = s._next_bytes() - 1  # the next step must preempt the newest
    s.step()
    assert late.preemptions == 1 and late in s.waiting and s.running() == [jobs[0]]
    s.budget = None
    s.drain(400)
    assert [j.tokens for j in jobs] == want


@pytest.mark.slow
def test_a_cancelled_request_leaves_the_batch_at_the_next_step(eng):
    s = Scheduler(eng)
    jobs = [s.submit(_chat(p), spec=SPEC, max_new_tokens=50) for p in PROMPTS[:2]]
    s.step()
    s.step()
    assert len(s.running()) == 2
    cache = s.batches[str(jobs[0].spec)].cache
    jobs[0].cancel()
    had = len(jobs[0].tokens)
    s.step()
    assert s.running() == [jobs[1]] and len(cache.layers[0].dense_len) == 1
    assert jobs[0].finish_reason == "cancelled" and len(jobs[0].tokens) == had
    jobs[1].cancel()
    s.step()
    assert not s.running() and not s.batches


@pytest.mark.slow
def test_a_failing_prefill_fails_that_request_only(eng, alone):
    s = Scheduler(eng)
    bad = s.submit(_chat(PROMPTS[0]), spec=SPEC, max_new_tokens=N)
    feed = s._feed

    def fail_first(pf):
        if pf.job is bad:
            raise RuntimeError("out of memory (simulated)")
        return feed(pf)

    s._feed = fail_first
    good = s.submit(_chat(PROMPTS[1]), spec=SPEC, max_new_tokens=N)
    s.drain(200)
    with pytest.raises(RuntimeError, match="out of memory"):
        list(bad.pieces(eng.tokenizer))
    assert bad.finish_reason == "error" and good.tokens == alone[(PROMPTS[1], SPEC)]


@pytest.mark.slow
def test_drain_steps_until_idle_and_says_when_it_cannot(eng):
    s = Scheduler(eng)
    job = s.submit(_chat(PROMPTS[0]), spec="fp16", max_new_tokens=3)
    with pytest.raises(RuntimeError, match="after 1 steps"):
        s.drain(1)  # one step prefills (the first token) and decodes once (the second): the third is to come
    assert len(job.tokens) == 2
    s.drain(1)  # the step that makes the third token and lets the job leave is enough
    assert len(job.tokens) == 3 and not s.waiting and not s.active()


def test_greedy_rows_are_picked_together(eng, alone, monkeypatch):
    """A decode step picks its greedy rows with one argmax (one device sync, not one a row); only the sampled row
    goes through ``choose``, once a step. The greedy tokens are those of each request alone."""
    import mmkv.batching.scheduler as sched

    s = Scheduler(eng)
    jobs = [s.submit(_chat(p), spec=SPEC, max_new_tokens=N) for p in PROMPTS]
    s.submit(_chat(PROMPTS[0]), spec=SPEC, max_new_tokens=N, do_sample=True, temperature=0.8, top_p=0.9, seed=7)
    for _ in range(20):  # every prefill done (each picks its first token on its own), nothing decoded yet
        if len(s.prefilling) == 0 and s.batches:
            break
        s.step()
    calls = []
    real = sched.choose
    monkeypatch.setattr(sched, "choose", lambda logits, *a: calls.append(logits.shape[0]) or real(logits, *a))
    decodes = sum(1 for entry in s.log if entry[1] == "decode")
    s.drain(200)
    steps = sum(1 for entry in s.log if entry[1] == "decode") - decodes
    assert steps >= N - 2 and calls == [1] * len(calls) and len(calls) <= steps
    for p, j in zip(PROMPTS, jobs):
        assert j.tokens == alone[(p, SPEC)]


def test_overhead_bench_times_a_full_batch(eng):
    """``mmkv-bench overhead``'s measurement on the CPU: every request decodes in the one timed batch and both
    timings are taken step by step; its prompt has the tokens asked for."""
    from eval.bench.overhead import measure, prompt_of

    text = prompt_of(eng.tokenizer, 40)
    assert 40 <= len(eng.tokenizer(text, add_special_tokens=False).input_ids) < 60
    r = measure(eng, 3, text, 3, SPEC)
    assert r["batch"] == 3 and r["rows"] == 3 and not r["graphed"]
    assert len(r["step_ms_all"]) == len(r["bare_ms_all"]) == 3 and min(r["step_ms_all"] + r["bare_ms_all"]) > 0
    assert r["overhead"] == r["step_ms"] / r["bare_ms"] - 1
