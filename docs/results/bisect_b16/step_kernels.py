"""Kernel times inside decode steps (graph replays) of random:internvl2.5-8b, one model load for many configs
``SPEC|BATCH|TOKENS|WAVES`` (WAVES: ``MMKV_TEXT_WAVES``, empty for the plan's rule): the step's median time and the
text kernel's time per call as torch's profiler sees it inside the step, next to each other in one process."""
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from eval.bench.common import DecodeStepper, one_request_cache, tile_cache  # first: mmkv imports in its order

import mmkv  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
model, _, adapter = mmkv.load_model(os.environ.get("MODEL", "random:internvl2.5-8b"), device=dev,
                                     dtype=torch.float16)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


for cfg in sys.argv[1:]:
    spec, batch, n, waves = cfg.split("|")
    batch, n = int(batch), int(n)
    os.environ["MMKV_TEXT_WAVES"] = waves
    cache = tile_cache(one_request_cache(spec, adapter, 0, n, dev, torch.float16), batch)
    step = DecodeStepper(model, cache, graphs=True)
    ids = torch.randint(100, 1000, (batch, 1), device=dev)
    times = []
    for i in range(12):
        sync()
        t0 = time.perf_counter()
        step(ids, torch.full((batch, 1), n + i, device=dev))
        sync()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU]) as prof:
        for i in range(12, 16):
            step(ids, torch.full((batch, 1), n + i, device=dev))
        sync()
    kern = {e.key: e for e in prof.key_averages()}
    text = [e for k, e in kern.items() if k in ("_text_kernel", "_kivi_kernel") or "text" in k and "kernel" in k]
    desc = " ".join(f"{e.key} {(e.device_time_total or e.cpu_time_total) / max(1, e.count):.1f} us x{e.count // 4}"
                    for e in text)
    print(f"{cfg:45s} step {statistics.median(times[4:]) * 1e3:7.2f} ms | {desc}", flush=True)
    del step, cache
    if dev == "cuda":
        torch.cuda.empty_cache()
