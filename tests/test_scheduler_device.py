"""The scheduler keeps the device to its loop thread (mmkv/batching/scheduler.py): on a GPU, a CUDA call from a
request's thread while the loop captures a decode graph invalidates the capture and fails the request (seen on an
H100 with mmkv-serve, 2026-11-26). Requests are prepared on the CPU; the loop steps holding ``_device``; a spec's
byte probe, the only device work a submit does, takes the same lock. On a GPU (``-m gpu``): decode graphs survive
requests joining and leaving (rows reused in place, mmkv/cache/slots.py) and every request keeps its alone tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from mmkv.batching import Scheduler


@pytest.fixture(scope="module")
def eng(smollm2):
    import mmkv

    return mmkv.Engine(smollm2)


@pytest.mark.slow
def test_submit_prepares_on_the_cpu_and_the_loop_steps_holding_the_device(eng, monkeypatch):
    import mmkv.batching.scheduler as sched

    asked = []
    prepare = sched.prepare_inputs

    def recorded(*a, **kw):  # on a CPU box the engine's device is the CPU too: what matters is what submit asks
        asked.append(kw.get("device"))
        return prepare(*a, **kw)

    monkeypatch.setattr(sched, "prepare_inputs", recorded)
    s = Scheduler(eng)
    held = []
    step = s.step

    def watched_step():
        held.append(s._device.locked())
        step()

    s.step = watched_step
    job = s.submit([{"role": "user", "content": "Say hi."}], spec="fp16", max_new_tokens=3)
    assert asked == [None] and job.prep.input_ids.device.type == "cpu"
    s.start()
    try:
        pieces = "".join(job.pieces(eng.tokenizer))  # returns when the job is done; raises what failed it
    finally:
        s.close()
    assert held and all(held)
    assert job.finish_reason in ("length", "stop") and len(job.tokens) >= 1 and isinstance(pieces, str)


@pytest.mark.slow
def test_a_new_specs_byte_probe_waits_for_the_step(eng):
    s = Scheduler(eng)
    s._device.acquire()  # the loop is stepping
    done = threading.Event()

    def probe():
        s.kv_bytes(s_spec)
        done.set()

    from mmkv.spec import CacheSpec

    s_spec = CacheSpec.parse("text=kivi:bits=2")
    t = threading.Thread(target=probe)
    t.start()
    assert not done.wait(0.5), "the probe ran on the device while the loop held it"
    s._device.release()
    assert done.wait(60)
    t.join()
    assert str(s_spec) in s._kv


CUDA = torch.cuda.is_available()
GPU_SPECS = ["fp16", "text=kivi:bits=2", "text=xquant:kq=20,vq=2,km=22,vm=10"]


@pytest.fixture(scope="module")
def gpu_eng():
    import mmkv

    return mmkv.Engine(mmkv.load_model("random:smollm2-135m", device="cuda", dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("spec", GPU_SPECS)
def test_decode_graphs_survive_joins_and_leaves_and_requests_keep_their_alone_tokens(gpu_eng, spec):
    """Graphs on: 16 requests of staggered prompt and output lengths arrive over the steps; each gets its alone
    greedy tokens, and the batch captures far fewer graphs than requests joined (rows reused in place)."""
    eng = gpu_eng
    s = Scheduler(eng, prefill_chunk=None)
    assert s.graphs
    subs = [(3 * i, "word " * (20 + 37 * (i % 5)) + f"number {i}", 24 + 13 * (i % 7)) for i in range(16)]
    jobs, i, step = [], 0, 0
    while i < len(subs) or s.waiting or s.active():
        while i < len(subs) and subs[i][0] <= step:
            jobs.append(s.submit(subs[i][1], spec=spec, max_new_tokens=subs[i][2]))
            i += 1
        s.step()
        step += 1
        assert step < 2000
    same = [j.tokens == eng.generate(p, spec=spec, max_new_tokens=n).tokens[0].tolist() for (_, p, n), j in
            zip(subs, jobs)]
    g = s.graph_stats()
    print(spec, g, f"{sum(same)}/{len(same)} equal to alone")
    assert all(same), f"{same.count(False)} requests differ from their alone run: {g}"
    # before slots every join and every leave made a new graph; now a capture follows a merge into a new bucket or a
    # flush that grew a segment (H100, 2026-11-26: 10 captures for 9 joins in place, 6 merged, 15 leaves)
    changes = g["joins_in_place"] + g["joins_merged"] + g["leaves_in_place"]
    assert g["joins_in_place"] >= len(subs) // 2 and 2 * g["graph_captures"] < changes, g
    assert g["graph_replays"] > 5 * g["graph_captures"], g
