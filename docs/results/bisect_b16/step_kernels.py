"""Kernel times inside decode steps (graph replays) of random:internvl2.5-8b, one model load for many configs
``SPEC|BATCH|TOKENS|ENV``: the step's median time and the attention kernels' time per call as torch's profiler sees
them inside the step (``eval.bench.common.kernel_times``; the fifteenth session's runs had the same profile inline), next
to each other in one process. ENV: ``NAME=v;NAME=v`` switches for that config alone, or (as the fifteenth session
ran it) a bare value or nothing for ``MMKV_TEXT_WAVES`` (empty: the plan's rule)."""
import os
import statistics
import sys
import time

import torch

import mmkv
from eval.bench.common import DecodeStepper, kernel_times, one_request_cache, sync, tile_cache

SKVQ_DIR = os.environ.get("SKVQ_DIR", "results/skvq-synthetic-artifacts")  # the decode bench's --skvq-dir default
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model, _, adapter = mmkv.load_model(os.environ.get("MODEL", "random:internvl2.5-8b"), device=dev,
                                     dtype=torch.float16)


def one(cfg: str) -> None:
    spec, batch, n, env = cfg.split("|")
    batch, n = int(batch), int(n)
    if adapter.synthetic:  # random weights: SKVQ specs get an artifact calibrated on synthetic K/V, as the bench does
        from mmkv.calibrate.skvq import attach_synthetic_artifacts

        spec = attach_synthetic_artifacts([spec], adapter, SKVQ_DIR)[0]
    pairs = [kv.split("=", 1) for kv in env.split(";")] if "=" in env else [("MMKV_TEXT_WAVES", env)]
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
    cache = tile_cache(one_request_cache(spec, adapter, 0, n, dev, torch.float16), batch)
    step = DecodeStepper(model, cache, graphs=True)
    ids = torch.randint(100, 1000, (batch, 1), device=dev)
    times = []
    for i in range(12):
        sync(dev)
        t0 = time.perf_counter()
        step(ids, torch.full((batch, 1), n + i, device=dev))
        sync(dev)
        times.append(time.perf_counter() - t0)
    kern = kernel_times(lambda i: step(ids, torch.full((batch, 1), n + 12 + i, device=dev)), 4, [dev], top=40)
    text = {k: v for k, v in kern.items() if k.startswith("_") and k.endswith("_kernel") and k != "_segment_kernel"}
    desc = " ".join(f"{k} {v['us_per_call']:.1f} us x{v['calls_per_step']:g}" for k, v in text.items())
    idx = sum(v["us_per_step"] for k, v in kern.items() if "index" in k or "arange" in k)  # torch's append
    busy = sum(v["us_per_step"] for v in kern.values())
    print(f"{cfg:45s} step {statistics.median(times[4:]) * 1e3:7.2f} ms | {desc} | index/arange {idx:.0f} us, "
          f"top-40 kernels {busy:.0f} us a step", flush=True)
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


for c in sys.argv[1:]:
    one(c)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
