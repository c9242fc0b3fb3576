"""Kernel times inside decode steps (graph replays) of random:internvl2.5-8b, one model load for many configs
``SPEC|BATCH|TOKENS|ENV``: the step's median time and the attention kernels' time per call as torch's profiler sees
them inside the step, next to each other in one process. ENV: ``NAME=v;NAME=v`` switches for that config alone, or
(as the fifteenth session ran it) a bare value or nothing for ``MMKV_TEXT_WAVES`` (empty: the plan's rule)."""
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import mmkv
from eval.bench.common import DecodeStepper, one_request_cache, tile_cache

dev = "cuda" if torch.cuda.is_available() else "cpu"
model, _, adapter = mmkv.load_model(os.environ.get("MODEL", "random:internvl2.5-8b"), device=dev,
                                     dtype=torch.float16)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


for cfg in sys.argv[1:]:
    spec, batch, n, env = cfg.split("|")
    batch, n = int(batch), int(n)
    if adapter.synthetic:  # random weights: SKVQ specs get an artifact calibrated on synthetic K/V, as the bench does
        from mmkv.calibrate.skvq import attach_synthetic_artifacts

        spec = attach_synthetic_artifacts([spec], adapter, os.environ.get("SKVQ_DIR", "results/skvq-synthetic-artifacts"))[0]
    pairs = [kv.split("=", 1) for kv in env.split(";")] if "=" in env else [("MMKV_TEXT_WAVES", env)]
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
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
    text = [e for k, e in kern.items() if k.startswith("_") and k.endswith("_kernel") and k != "_segment_kernel"]
    desc = " ".join(f"{e.key} {(e.device_time_total or e.cpu_time_total) / max(1, e.count):.1f} us x{e.count // 4}"
                    for e in text)
    print(f"{cfg:45s} step {statistics.median(times[4:]) * 1e3:7.2f} ms | {desc}", flush=True)
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    del step, cache
    if dev == "cuda":
        torch.cuda.empty_cache()
