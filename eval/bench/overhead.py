"""Scheduler overhead per decode step: the continuous-batching loop's step at batch B against the bare decode step
of the same batch (issue 29: under 5% of the step at batch 64).

    mmkv-bench overhead --model random:internvl2.5-8b --batch 64 --prompt-tokens 3392 --steps 30 \\
        --out results/overhead.json

B requests with the same plain-text prompt (a sentence repeated to ``--prompt-tokens`` tokens; no data set needed) are submitted and stepped until every
one decodes in one batch; then ``--steps`` scheduler steps are timed (each: admission and budget checks, one decode
of the batch, the picks and token events, the gauges), then as many bare calls of the batch's ``DecodeStepper`` (the
model's decode step, replayed from a CUDA graph where the scheduler uses graphs) on the same cache. Medians;
overhead = step / bare - 1. No HTTP server runs here: this is the engine loop's share, and a server adds its event
loop and the clients' streams in other threads.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

from ..jsonout import save_json


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


SENTENCE = "The river runs past the old mill, under the bridge and out to the sea. "


def prompt_of(tokenizer, n: int) -> str:
    """A prompt of at least ``n`` tokens (the sentence repeated)."""
    per = len(tokenizer(SENTENCE, add_special_tokens=False).input_ids)
    return SENTENCE * max(1, -(-n // per))


def measure(eng, batch: int, prompt: str, steps: int, spec: str | None = None) -> dict:
    """Median ms of a scheduler step and of a bare decode step at ``batch`` rows (see the module doc)."""
    from mmkv.batching import Scheduler

    s = Scheduler(eng, prefill_chunk=None)
    jobs = [s.submit(prompt, spec=spec, max_new_tokens=2 * steps + 64) for _ in range(batch)]
    for _ in range(batch + 8):  # one step admits and prefills every request; a few more bring them into one batch
        s.step()
        if not s.waiting and not s.prefilling and sum(len(b.jobs) for b in s.batches.values()) == batch:
            break
    if len(s.batches) != 1 or any(j.finish_reason for j in jobs):
        raise RuntimeError("overhead: the requests did not end up decoding in one batch")
    for _ in range(3):  # graphs captured, first replays done
        s.step()
    dev = eng.device
    timed = []
    for _ in range(steps):
        _sync(dev)
        t = time.perf_counter()
        s.step()
        _sync(dev)
        timed.append((time.perf_counter() - t) * 1e3)
    b = next(iter(s.batches.values()))
    rows = len(b.jobs) + b.spare
    ids = torch.tensor([[j.tokens[-1]] for j in b.jobs] + [[s.pad]] * b.spare, device=dev)
    pos = torch.tensor([[j.next_pos] for j in b.jobs] + [[0]] * b.spare, device=dev)
    bare = []
    with torch.inference_mode():
        for _ in range(steps):
            _sync(dev)
            t = time.perf_counter()
            b.stepper(ids, pos)
            _sync(dev)
            bare.append((time.perf_counter() - t) * 1e3)
    for j in jobs:
        j.cancel()
    s.drain(8)
    step_ms, bare_ms = statistics.median(timed), statistics.median(bare)
    return {"batch": batch, "rows": rows, "step_ms": step_ms, "bare_ms": bare_ms, "overhead": step_ms / bare_ms - 1,
            "step_ms_all": timed, "bare_ms_all": bare, "graphed": bool(b.stepper.enabled),
            "replays": b.stepper.replays}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmkv-bench overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--spec", action="append", help="repeatable (default: fp16)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from mmkv.engine import Engine
    from mmkv.models import load_model

    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    eng = Engine(load_model(a.model, device=dev))
    prompt = prompt_of(eng.tokenizer, a.prompt_tokens)
    rows = []
    for spec in a.spec or ["fp16"]:
        r = measure(eng, a.batch, prompt, a.steps, spec)
        r["spec"] = spec
        rows.append(r)
        print(f"{spec:50s} batch {r['batch']:3d}  scheduler step {r['step_ms']:8.2f} ms  bare step "
              f"{r['bare_ms']:8.2f} ms  overhead {100 * r['overhead']:5.1f}%  (graphed: {r['graphed']})", flush=True)
    if a.out:
        info = {"model": a.model, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                "torch": torch.__version__, "prompt_tokens": a.prompt_tokens, "steps": a.steps,
                "date": datetime.date.today().isoformat()}
        save_json(a.out, {"info": info, "rows": rows})
    return 0
