"""Which kernels a decode step spends its time in, as torch's profiler sees them inside the step (CUDA-graph
replays included): ``mmkv-bench decode --profile`` records them per row.

Why: the attention call replayed alone can rank plans differently from the same call inside the step. The B16 32k
text kernel took 184 us at one wave of splits replayed alone and 259 us inside the step, where three waves took
192 (H100, docs/BENCHMARKS.md, "The batch-16 regression bisected and mended"); only the step's own profile shows it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

_RUNTIME = re.compile(r"cuda[A-Z]|cu[A-Z]|Activity Buffer")  # CUDA runtime and driver calls, the profiler's own
TOP = 12  # kernels kept per row: the attention, GEMM and merge kernels of a step are within the first dozen


def _sync(devices) -> None:
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def kernel_times(step: Callable[[int], object], steps: int, devices, top: int = TOP) -> dict[str, dict]:
    """Run ``step(i)`` for ``i`` in ``range(steps)`` under the profiler -> ``{name: {"us_per_step", "calls_per_step",
    "us_per_call"}}`` of the ``top`` kernels by time, largest first. On CUDA only device kernels count (the runtime's
    own calls, such as the host waiting in a synchronize, are left out); on CPU the operators' own time counts."""
    cuda = any(torch.device(d).type == "cuda" for d in devices)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i)
        _sync(devices)
    found = []
    for e in prof.key_averages():
        if cuda:
            if "CUDA" not in str(getattr(e, "device_type", "")) or _RUNTIME.match(e.key):
                continue
            t = e.device_time_total
        else:
            t = e.self_cpu_time_total
        if t > 0 and e.count:
            found.append((t, e))
    found.sort(key=lambda x: -x[0])
    return {e.key: {"us_per_step": t / steps, "calls_per_step": e.count / steps, "us_per_call": t / e.count}
            for t, e in found[:top]}


def describe(kernels: dict[str, dict], n: int = 3) -> str:
    """One line of the ``n`` largest: name, us a call and calls a step."""
    return ", ".join(f"{k[:40]} {v['us_per_call']:.1f} us x{v['calls_per_step']:g}"
                     for k, v in list(kernels.items())[:n])
