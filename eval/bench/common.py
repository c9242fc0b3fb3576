"""Helpers the benches and studies share: a synthetic one-request cache, tiling it over a batch, room to decode
into, transformers' fp16 cache of the same shapes, byte counts, decode tokens/s and the kernels inside a step, and
fitting a batch into a budget (out of eval/bench/budget.py, which uses them all; eval/bench/decode.py, eval/bench/aquakv.py and
eval/studies/multigpu.py use some), and the GPU's clocks at the time of a run."""

from __future__ import annotations

import dataclasses
import re
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from mmkv.cache import MMKVCache, cache_kwargs
from mmkv.cache import segments as S
from mmkv.graphs import DecodeStepper

GB = 1e9
GPU_STATE = ("clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu",
             "clocks_throttle_reasons.active")


def gpu_state() -> list[dict[str, str]]:
    """Per GPU, what ``nvidia-smi`` says of ``GPU_STATE`` now ([] where it cannot be asked). Why: two starts of the
    same GPU kind gave one decode step 11% apart while the bandwidth-bound fp16 step moved 2%; the kernels that are
    bound by their instruction issue follow the SM clock, so a result without its clocks cannot be compared."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_STATE)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [dict(zip(GPU_STATE, (v.strip() for v in line.split(",")), strict=True))
            for line in out.splitlines() if line.count(",") == len(GPU_STATE) - 1]


def synthetic_kv(adapter, n: int, device, dtype, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (1, adapter.num_kv_heads, n, adapter.head_dim)
    offset = torch.randn(1, adapter.num_kv_heads, 1, adapter.head_dim, generator=g) * 2
    k = (torch.randn(shape, generator=g) + offset).to(device, dtype)
    v = torch.randn(shape, generator=g).to(device, dtype)
    return k, v


def one_request_cache(spec: str, adapter, n_visual: int, n_text: int, device, dtype,
                      layer_devices: list | None = None) -> MMKVCache:
    """One request's cache; with ``layer_devices`` (a sharded model) layer l is built on its own GPU."""
    cache = MMKVCache.for_model(spec, adapter)
    n = n_visual + n_text
    visual = torch.zeros(1, n, dtype=torch.bool, device=device)
    visual[:, n_text // 2 : n_text // 2 + n_visual] = True  # system prompt, image, question
    cache.set_inputs(torch.ones(1, n, dtype=torch.long, device=device), visual)
    for layer in range(adapter.num_layers):
        k, v = synthetic_kv(adapter, n, layer_devices[layer] if layer_devices else device, dtype, seed=layer)
        cache.update(k, v, layer)
    cache.finalize()
    return cache


def reserve_room(cache: MMKVCache, tokens: int) -> MMKVCache:
    """Grow each fp16 segment now to the capacity ``tokens`` decode steps would grow it to (the layer's own
    doubling rule), so the bytes counted before decoding are the bytes held while decoding: what a batch sized to
    fill the GPUs (budget ``fit``) must reserve."""
    for layer in cache.layers:
        if layer.dense is None:
            continue
        cap, n = S.capacity(layer.dense), max(layer.dense_len)
        for _ in range(tokens):
            n = min(n + 1, layer.sliding_window) if layer.is_sliding else n + 1  # a ring never outgrows its window
            if n > cap:
                cap = max(n, min(2 * cap, layer._steady_capacity()))
        layer.dense = S.grow(layer.dense, cap)
        if layer.is_sliding and cap == layer.sliding_window:  # a full ring keeps a spare of what it evicts
            layer._ensure_spare()
    return cache


def _tile(seg, batch: int):
    fields = {name: getattr(seg, name).expand(batch, *getattr(seg, name).shape[1:]).contiguous()
              for name, _ in S.token_fields(seg)}
    return dataclasses.replace(seg, lens=seg.lens.repeat(batch), **fields)


def tile_cache(cache: MMKVCache, batch: int) -> MMKVCache:
    """The same request repeated ``batch`` times (separate memory per row, as real requests would have)."""
    for layer in cache.layers:
        layer.dense = _tile(layer.dense, batch)
        layer.dense_len = layer.dense_len * batch
        if layer.is_sliding:  # a ring's next slot and spare of evicted tokens are per row too (cache/sliding.py)
            layer.take_ring_rows(torch.zeros(batch, dtype=torch.long))
        layer.visual = [_tile(s, batch) for s in layer.visual]
        layer.visual_lens = [lens * batch for lens in layer.visual_lens]
        if layer.text is not None:
            layer.text = _tile(layer.text, batch)
            layer.text_len = layer.text_len * batch
            if hasattr(layer.text_method, "tile"):  # what a method keeps per row beside its segment
                layer.text_method.tile(batch)
    if getattr(cache, "positions", None) is not None:  # text methods that keep token positions (AQUA-KV)
        cache.positions = cache.positions.tile(batch)
        for layer in cache.layers:
            layer.positions = cache.positions
    return cache


def hf_fp16_cache(adapter, n: int, batch: int, device, dtype, layer_devices: list | None = None) -> DynamicCache:
    cache = DynamicCache(config=adapter.lm_config)
    for layer in range(adapter.num_layers):
        k, v = synthetic_kv(adapter, n, layer_devices[layer] if layer_devices else device, dtype, seed=layer)
        cache.update(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous(), layer)
    return cache


def cache_bytes(cache) -> int:
    if isinstance(cache, MMKVCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def sync(devices) -> None:
    for device in devices if isinstance(devices, (list, tuple)) else [devices]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


_RUNTIME = re.compile(r"cuda[A-Z]|cu[A-Z]|Activity Buffer")  # CUDA runtime and driver calls, the profiler's own
TOP = 12  # kernels kept per row: the attention, GEMM and merge kernels of a step are within the first dozen


def kernel_times(step: Callable[[int], object], steps: int, devices, top: int = TOP) -> dict[str, dict]:
    """Run ``step(i)`` for ``i`` in ``range(steps)`` under the profiler -> ``{name: {"us_per_step", "calls_per_step",
    "us_per_call"}}`` of the ``top`` kernels by time, largest first. On CUDA only device kernels count (the runtime's
    own calls, such as the host waiting in a synchronize, are left out); on CPU the operators' own time counts.
    Why inside the step: the attention call replayed alone can rank plans differently. The B16 32k text kernel took
    184 us at one wave of splits replayed alone and 259 us inside the step, where three waves took 192 (H100,
    docs/BENCHMARKS.md, "The batch-16 regression bisected and mended")."""
    cuda = any(torch.device(d).type == "cuda" for d in devices)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i)
        sync([torch.device(d) for d in devices])
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
    return kernel_table({e.key: (e.count, t) for t, e in found}, steps, top)


def kernel_table(totals: dict[str, tuple[int, float]], steps: int, top: int | None = None) -> dict[str, dict]:
    """``{name: (launches, device us)}`` over ``steps`` steps -> ``{name: {"us_per_step", "calls_per_step",
    "us_per_call"}}``, largest first (the ``top`` largest): the one per-kernel summary of ``kernel_times`` (the
    profiler's averages) and of ``eval.studies.step_kernels`` (its trace's kernels, step by step)."""
    ranked = sorted(totals.items(), key=lambda x: -x[1][1])[:top]
    return {name: {"us_per_step": t / steps, "calls_per_step": c / steps, "us_per_call": t / c}
            for name, (c, t) in ranked}


def describe(kernels: dict[str, dict], n: int = 3) -> str:
    """One line of the ``n`` largest: name, us a call and calls a step."""
    return ", ".join(f"{k[:40]} {v['us_per_call']:.1f} us x{v['calls_per_step']:g}"
                     for k, v in list(kernels.items())[:n])


@torch.inference_mode()
def decode_tokens_per_s(model, cache, batch: int, start_pos: int, steps: int, device,
                        devices: list | None = None, graphs: bool = True,
                        kernels: dict | None = None, profile_steps: int = 4) -> tuple[float, float]:
    """Median decode step time over ``steps`` steps after 2 warm-up steps -> (tokens/s, ms/step).

    An ``MMKVCache`` decodes through ``DecodeStepper`` (CUDA-graph replays between flushes, as the Engine does;
    ``graphs=False`` times every step eagerly); transformers' caches run their own eager forward. ``devices``: every
    GPU of a sharded model (all are synchronized around a step). ``kernels``: a dict filled, after the timed steps,
    with the kernel times of ``profile_steps`` more steps (``kernel_times``; not in the median).
    """
    ids = torch.randint(100, 1000, (batch, 1), device=device)
    devices = devices or [device]
    if isinstance(cache, MMKVCache):
        step_fn = DecodeStepper(model, cache, graphs=graphs)
    else:
        kw = cache_kwargs(model, cache)

        def step_fn(i, p):
            return model(input_ids=i, position_ids=p, **kw, use_cache=True, logits_to_keep=1)
    times = []
    for i in range(steps + 2):
        pos = torch.full((batch, 1), start_pos + i, device=device)
        sync(devices)
        t0 = time.perf_counter()
        step_fn(ids, pos)
        sync(devices)
        if i >= 2:  # the first steps compile kernels, warm the allocator and capture the graph
            times.append(time.perf_counter() - t0)
    if kernels is not None:
        end = start_pos + steps + 2
        kernels.update(kernel_times(lambda i: step_fn(ids, torch.full((batch, 1), end + i, device=device)),
                                    profile_steps, devices))
    step = statistics.median(times)
    return batch / step, step * 1e3


FIT = "fit"


def parse_budgets(text: str) -> list:
    """``"5,10,fit"`` -> ``[5.0, 10.0, "fit"]`` (GB totals over the GPUs; ``fit``: all free GPU memory)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == FIT:
            out.append(FIT)
            continue
        try:
            out.append(float(part))
        except ValueError:
            raise ValueError(f"budget {part!r}: use GB numbers or 'fit', e.g. '5,10,20,30,fit'") from None
    return out


def free_bytes(devices, reserve_gb: float) -> dict[str, int]:
    """Per GPU: free memory now (after releasing cached blocks) less ``reserve_gb`` for activations and scratch."""
    torch.cuda.empty_cache()
    return {str(d): max(0, torch.cuda.mem_get_info(d)[0] - int(reserve_gb * GB)) for d in devices if d.type == "cuda"}


def fit_batch(per_request: dict[str, int], free: dict[str, int], max_batch: int) -> int:
    """Largest batch whose cache fits on every device: each GPU holds the layers it runs, so the batch is bounded by
    the GPU with the least free memory per byte of one request's share on it."""
    batch = max_batch
    for dev, need in per_request.items():
        if need > 0:
            batch = min(batch, free.get(dev, 0) // need)
    return max(batch, 0)
