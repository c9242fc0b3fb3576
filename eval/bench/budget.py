"""Throughput under a KV-memory budget (CalibQuant Fig. 3 / App. B.2): budget -> largest batch -> decode tokens/s.

For each spec, one request's cache (``--visual`` visual tokens + ``--text`` prompt text tokens) is built and
measured exactly (``cache.nbytes()``); the largest batch whose cache fits the budget is built by tiling that
request's segments over the batch; then ``--steps`` decode steps run through the real model and the median step
time gives tokens/s. The prefill is synthetic (random K/V of the right shapes, per-channel offsets like real keys):
decode cost depends on the cache's shapes and bytes, not on its values, and a real prefill of hundreds of
3328-token requests would take the whole lease. Two FP16 baselines: ``hf-fp16`` is transformers' ``DynamicCache`` +
SDPA, what a user gets without mmkv (it concatenates the whole cache every step); ``fp16`` is mmkv's own cache with
every token in fp16, read by the same decode kernel (the fair baseline for the kernel itself).

    mmkv-bench budget --model random:internvl2.5-8b --visual 3328 --budgets 5,10,20,30 \
        --spec fp16 --spec "visual=calibquant:bits=2" --spec "visual=calibquant:bits=1" --out results/budget.json

Several GPUs (docs/MULTIGPU.md): ``--device-map auto|layers [--max-memory 0=70GiB,1=70GiB]`` shards the model;
every layer's cache is built on that layer's GPU, budgets are totals over the GPUs, the budget ``fit`` means
"all memory the GPUs have free after loading, less ``--reserve-gb`` on each", and each row also reports cache bytes
and peak allocated memory per GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from mmkv.cache import MMKVCache, cache_kwargs
from mmkv.cache import segments as S
from mmkv.graphs import DecodeStepper

from ..jsonout import save_json

GB = 1e9


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
            n += 1
            if n > cap:
                cap = max(n, min(2 * cap, layer._steady_capacity()))
        layer.dense = S.grow(layer.dense, cap)
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
        layer.visual = [_tile(s, batch) for s in layer.visual]
        layer.visual_lens = [lens * batch for lens in layer.visual_lens]
        if layer.text is not None:
            layer.text = _tile(layer.text, batch)
            layer.text_len = layer.text_len * batch
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


def _sync(devices) -> None:
    for device in devices if isinstance(devices, (list, tuple)) else [devices]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_tokens_per_s(model, cache, batch: int, start_pos: int, steps: int, device,
                        devices: list | None = None, graphs: bool = True) -> tuple[float, float]:
    """Median decode step time over ``steps`` steps after 2 warm-up steps -> (tokens/s, ms/step).

    An ``MMKVCache`` decodes through ``DecodeStepper`` (CUDA-graph replays between flushes, as the Engine does;
    ``graphs=False`` times every step eagerly); transformers' caches run their own eager forward. ``devices``: every
    GPU of a sharded model (all are synchronized around a step).
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
        _sync(devices)
        t0 = time.perf_counter()
        step_fn(ids, pos)
        _sync(devices)
        if i >= 2:  # the first steps compile kernels, warm the allocator and capture the graph
            times.append(time.perf_counter() - t0)
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


def hf_bytes_by_device(adapter, n: int, dtype, layer_devices: list) -> dict[str, int]:
    per_layer = 2 * n * adapter.num_kv_heads * adapter.head_dim * dtype.itemsize
    out: dict[str, int] = {}
    for d in layer_devices:
        out[str(d)] = out.get(str(d), 0) + per_layer
    return out


def _measure(model, adapter, spec, batch, n_visual, n_text, steps, device, dtype, layer_devs, devices,
             room: int = 0, graphs: bool = True) -> dict:
    n = n_visual + n_text
    for d in devices:
        if d.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d)
    if spec == "hf-fp16":
        cache = hf_fp16_cache(adapter, n, batch, device, dtype, layer_devs)
    else:
        one = one_request_cache(spec, adapter, n_visual, n_text, device, dtype, layer_devs)
        cache = tile_cache(reserve_room(one, room), batch)
    out = {"cache_bytes": cache_bytes(cache)}
    if isinstance(cache, MMKVCache):
        out["cache_bytes_by_device"] = cache.nbytes_by_device()
    tps, ms = decode_tokens_per_s(model, cache, batch, n, steps, device, devices, graphs=graphs)
    peak = {str(d): torch.cuda.max_memory_allocated(d) for d in devices if d.type == "cuda"}
    out.update(tokens_per_s=tps, step_ms=ms, peak_memory_bytes=peak.get(str(device)),
               peak_memory_bytes_by_device=peak or None)
    del cache
    return out


def run(model, adapter, specs: list[str], budgets_gb: list, n_visual: int, n_text: int, steps: int,
        max_batch: int, reserve_gb: float = 8.0, deadline: float | None = None, graphs: bool = True) -> list[dict]:
    """Rows of (spec, budget) -> max batch, decode tokens/s, bytes (per device too). ``deadline``
    (``time.monotonic()`` value): rows not started by then are recorded as skipped."""
    from mmkv.models.sharding import layer_devices, model_devices

    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    layer_devs = layer_devices(model)
    devices = model_devices(model)
    n = n_visual + n_text
    rows = []
    for spec in specs:
        if spec == "hf-fp16":
            per_req = 2 * n * adapter.num_layers * adapter.num_kv_heads * adapter.head_dim * dtype.itemsize
            per_dev = hf_bytes_by_device(adapter, n, dtype, layer_devs)
        else:
            one = one_request_cache(spec, adapter, n_visual, n_text, device, dtype, layer_devs)
            per_req, per_dev = one.nbytes(), one.nbytes_by_device()
            del one
        for budget in budgets_gb:
            row = {"spec": spec, "budget_gb": budget, "bytes_per_request": per_req,
                   "bytes_per_request_by_device": per_dev}
            if deadline is not None and time.monotonic() > deadline:
                rows.append({**row, "max_batch": 0, "tokens_per_s": 0.0, "note": "skipped: time limit"})
                continue
            room = 0
            if budget == FIT:
                if device.type != "cuda":
                    raise ValueError("budget 'fit' measures free GPU memory and needs CUDA")
                room = steps + 2
                if spec != "hf-fp16":  # the fp16 window's growth during the timed steps is held too
                    roomy = reserve_room(one_request_cache(spec, adapter, n_visual, n_text, device, dtype,
                                                           layer_devs), room)
                    row["bytes_per_request_decoding"] = roomy.nbytes()
                    row["bytes_per_request_by_device"] = roomy.nbytes_by_device()
                    del roomy
                free = free_bytes(devices, reserve_gb)
                batch = fit_batch(row["bytes_per_request_by_device"], free, max_batch)
                row["free_bytes_by_device"] = free
            else:
                batch = min(int(budget * GB // per_req), max_batch)
            if batch < 1:
                rows.append({**row, "max_batch": batch, "tokens_per_s": 0.0, "note": "one request does not fit"})
                continue
            tries = 3 if budget == FIT else 1
            for attempt in range(tries):
                oom = False
                try:
                    row.update(_measure(model, adapter, spec, batch, n_visual, n_text, steps, device, dtype,
                                        layer_devs, devices, room, graphs))
                except torch.OutOfMemoryError:
                    if attempt == tries - 1:
                        raise
                    oom = True
                if not oom:
                    break
                gc.collect()  # outside the except block: its traceback no longer pins the half-built cache
                torch.cuda.empty_cache()
                row["note"] = f"batch {batch} ran out of memory (reserve too small); retried smaller"
                batch = int(batch * 0.9)
            row["max_batch"] = batch
            rows.append(row)
            shown = f"{budget:5.0f} GB" if budget != FIT else "  fit   "
            print(f"{spec:40s} {shown}  batch {batch:5d}  {row['tokens_per_s']:9.1f} tok/s  "
                  f"{row['step_ms']:7.2f} ms/step", flush=True)
    for name in ("hf-fp16", "fp16"):
        base = {r["budget_gb"]: r["tokens_per_s"] for r in rows if r["spec"] == name}
        for r in rows:
            b = base.get(r["budget_gb"])
            r[f"speedup_vs_{name.replace('-', '_')}"] = r["tokens_per_s"] / b if b else None
    return rows


def _budget(b) -> str:
    return FIT if b == FIT else f"{b:.0f}"


def format_table(rows: list[dict], label: str) -> str:
    out = [f"Throughput under a KV budget, {label}",
           "| spec | budget GB | bytes/request | max batch | decode tok/s | ms/step | x hf-fp16 | x fp16 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(x):
        return f"{x:.2f}" if x else "-"

    for r in rows:
        out.append(f"| {r['spec']} | {_budget(r['budget_gb'])} | {r['bytes_per_request']:,} | {r['max_batch']} | "
                   f"{r['tokens_per_s']:.1f} | {r.get('step_ms', 0):.2f} | {ratio(r.get('speedup_vs_hf_fp16'))} | "
                   f"{ratio(r.get('speedup_vs_fp16'))} |")
    per_device = format_device_table(rows)
    return "\n".join(out) + ("\n\n" + per_device if per_device else "")


def format_device_table(rows: list[dict]) -> str:
    """Per-GPU memory of a sharded model's rows (empty when every row ran on one device)."""
    devs = sorted({d for r in rows for d in (r.get("bytes_per_request_by_device") or {})})
    if len(devs) < 2:
        return ""
    out = ["Per GPU (cache bytes are exact; peak = torch.cuda.max_memory_allocated during the decode steps)",
           "| spec | budget GB | max batch | device | bytes/request | cache GB | peak allocated GB |",
           "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        for d in devs:
            cache = (r.get("cache_bytes_by_device") or {}).get(d)
            peak = (r.get("peak_memory_bytes_by_device") or {}).get(d)
            out.append(f"| {r['spec']} | {_budget(r['budget_gb'])} | {r['max_batch']} | {d} | "
                       f"{r['bytes_per_request_by_device'].get(d, 0):,} | "
                       f"{'-' if cache is None else f'{cache / GB:.2f}'} | "
                       f"{'-' if peak is None else f'{peak / GB:.2f}'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from mmkv.models.sharding import DEVICE_MAPS

    ap = argparse.ArgumentParser(prog="mmkv-bench budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:internvl2.5-8b")
    ap.add_argument("--spec", action="append", help="repeatable; hf-fp16 and fp16 are always measured first")
    ap.add_argument("--budgets", default="5,10,20,30", help="KV-cache budgets in GB (1e9 bytes) over all GPUs; "
                    "'fit' = all free GPU memory less --reserve-gb per GPU")
    ap.add_argument("--visual", type=int, default=3328)
    ap.add_argument("--text", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--no-graphs", action="store_true", help="time mmkv decode steps eagerly (no CUDA graphs)")
    ap.add_argument("--device-map", choices=DEVICE_MAPS, help="shard the model over the GPUs (docs/MULTIGPU.md)")
    ap.add_argument("--max-memory", help='per-GPU weight limit with --device-map, e.g. "0=70GiB,1=70GiB"')
    ap.add_argument("--reserve-gb", type=float, default=8.0, help="per GPU, kept free by the 'fit' budget")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mmkv-bench budget measures GPU decode throughput and needs a CUDA device")
    if args.max_memory and not args.device_map:
        raise SystemExit("--max-memory only applies with --device-map")
    import mmkv

    if args.device_map:
        model, _, adapter = mmkv.load_model(args.model, dtype=torch.float16, device_map=args.device_map,
                                            max_memory=args.max_memory)
    else:
        model, _, adapter = mmkv.load_model(args.model, device="cuda", dtype=torch.float16)
    wanted = args.spec or ["visual=calibquant:bits=2", "visual=calibquant:bits=1"]
    specs = ["hf-fp16", "fp16"] + [s for s in wanted if s not in ("hf-fp16", "fp16")]
    budgets = parse_budgets(args.budgets)
    rows = run(model, adapter, specs, budgets, args.visual, args.text, args.steps, args.max_batch, args.reserve_gb,
               graphs=not args.no_graphs)
    label = f"{args.model}" + (f" ({adapter.synthetic})" if adapter.synthetic else "")
    label += f", {args.visual} visual + {args.text} text tokens per request, {gpu_label(model)}"
    label += ", mmkv decode eager" if args.no_graphs else ", mmkv decode steps replayed from CUDA graphs"
    print(format_table(rows, label))
    save_json(args.out, {"label": label, "rows": rows})
    return 0


def gpu_label(model) -> str:
    """``NVIDIA H200`` or, for a sharded model, ``2 x NVIDIA H200 (device_map: 20 + 28 layers)``."""
    from mmkv.models.sharding import layer_devices, model_devices

    gpus = [d for d in model_devices(model) if d.type == "cuda"]
    if len(gpus) < 2:
        return torch.cuda.get_device_name(gpus[0] if gpus else None)
    per = [sum(1 for d in layer_devices(model) if d == g) for g in gpus]
    return (f"{len(gpus)} x {torch.cuda.get_device_name(gpus[0])} (decoder layers per GPU: "
            f"{' + '.join(map(str, per))})")


if __name__ == "__main__":
    raise SystemExit(main())
