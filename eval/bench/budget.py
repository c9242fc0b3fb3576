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
import gc
import statistics
import time
from pathlib import Path

import torch

from mmkv.cache import MMKVCache

from ..jsonout import save_json
from .common import (
    FIT,
    GB,
    cache_bytes,
    decode_tokens_per_s,
    fit_batch,
    free_bytes,
    hf_fp16_cache,
    one_request_cache,
    parse_budgets,
    reserve_room,
    tile_cache,
)


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
        max_batch: int, reserve_gb: float = 8.0, deadline: float | None = None, graphs: bool = True,
        rounds: int = 1) -> list[dict]:
    """Rows of (spec, budget) -> max batch, decode tokens/s, bytes (per device too). ``deadline``
    (``time.monotonic()`` value): rows not started by then are recorded as skipped. ``rounds`` > 1 times every row
    that many times, the rows' order and its reverse alternately, and keeps the medians (the spec measured first in
    a process runs its graph steps faster: docs/BENCHMARKS.md, "The gaps are the process's")."""
    from mmkv.models.sharding import layer_devices, model_devices

    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    layer_devs = layer_devices(model)
    devices = model_devices(model)
    plan = []
    for spec in specs:
        if spec == "hf-fp16":
            n = n_visual + n_text
            per_req = 2 * n * adapter.num_layers * adapter.num_kv_heads * adapter.head_dim * dtype.itemsize
            per_dev = hf_bytes_by_device(adapter, n, dtype, layer_devs)
        else:
            one = one_request_cache(spec, adapter, n_visual, n_text, device, dtype, layer_devs)
            per_req, per_dev = one.nbytes(), one.nbytes_by_device()
            del one
        plan += [{"spec": spec, "budget_gb": budget, "bytes_per_request": per_req,
                  "bytes_per_request_by_device": per_dev} for budget in budgets_gb]
    runs: dict[int, list] = {id(row): [] for row in plan}
    for r in range(rounds):
        for row in plan if r % 2 == 0 else plan[::-1]:
            if row.get("max_batch", 1) < 1:
                continue  # one request does not fit, or skipped for time
            if deadline is not None and time.monotonic() > deadline:
                if not runs[id(row)]:
                    row.update(max_batch=0, tokens_per_s=0.0, note="skipped: time limit")
                continue
            if "max_batch" in row or _size(row, adapter, n_visual, n_text, steps, device, dtype, layer_devs, devices,
                                           reserve_gb, max_batch):
                runs[id(row)].append(_timed(model, adapter, row, n_visual, n_text, steps, device, dtype, layer_devs,
                                            devices, graphs))
    rows = []
    for row in plan:
        row.pop("room", None)
        got = runs[id(row)]
        if got:
            tps = [t for t, _ in got]
            row["tokens_per_s"] = statistics.median(tps)
            row["step_ms"] = statistics.median(ms for _, ms in got)
            if rounds > 1:
                row["rounds_tokens_per_s"] = tps
        rows.append(row)
    for name in ("hf-fp16", "fp16"):
        base = {r["budget_gb"]: r["tokens_per_s"] for r in rows if r["spec"] == name}
        for r in rows:
            b = base.get(r["budget_gb"])
            r[f"speedup_vs_{name.replace('-', '_')}"] = r["tokens_per_s"] / b if b else None
    return rows


def _size(row: dict, adapter, n_visual, n_text, steps, device, dtype, layer_devs, devices, reserve_gb,
          max_batch) -> bool:
    """Set ``row["max_batch"]`` (and what the 'fit' budget measured); False where one request does not fit."""
    spec, budget = row["spec"], row["budget_gb"]
    row["room"] = 0
    if budget == FIT:
        if device.type != "cuda":
            raise ValueError("budget 'fit' measures free GPU memory and needs CUDA")
        row["room"] = steps + 2
        if spec != "hf-fp16":  # the fp16 window's growth during the timed steps is held too
            roomy = reserve_room(one_request_cache(spec, adapter, n_visual, n_text, device, dtype, layer_devs),
                                 row["room"])
            row["bytes_per_request_decoding"] = roomy.nbytes()
            row["bytes_per_request_by_device"] = roomy.nbytes_by_device()
            del roomy
        free = free_bytes(devices, reserve_gb)
        row["max_batch"] = fit_batch(row["bytes_per_request_by_device"], free, max_batch)
        row["free_bytes_by_device"] = free
    else:
        row["max_batch"] = min(int(budget * GB // row["bytes_per_request"]), max_batch)
    if row["max_batch"] < 1:
        row.update(tokens_per_s=0.0, note="one request does not fit")
        return False
    return True


def _timed(model, adapter, row, n_visual, n_text, steps, device, dtype, layer_devs, devices, graphs):
    """One timing of ``row`` at its batch: (tokens/s, ms/step). Under 'fit' an out-of-memory retries at 90% of the
    batch (up to three tries), and the smaller batch stays the row's."""
    tries = 3 if row["budget_gb"] == FIT else 1
    for attempt in range(tries):
        try:
            row.update(_measure(model, adapter, row["spec"], row["max_batch"], n_visual, n_text, steps, device,
                                dtype, layer_devs, devices, row["room"], graphs))
            break
        except torch.OutOfMemoryError:
            if attempt == tries - 1:
                raise
        gc.collect()  # outside the except block: its traceback no longer pins the half-built cache
        torch.cuda.empty_cache()
        row["note"] = f"batch {row['max_batch']} ran out of memory (reserve too small); retried smaller"
        row["max_batch"] = int(row["max_batch"] * 0.9)
    shown = f"{row['budget_gb']:5.0f} GB" if row["budget_gb"] != FIT else "  fit   "
    print(f"{row['spec']:40s} {shown}  batch {row['max_batch']:5d}  {row['tokens_per_s']:9.1f} tok/s  "
          f"{row['step_ms']:7.2f} ms/step", flush=True)
    return row["tokens_per_s"], row["step_ms"]


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
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every row R times, the list's order and its reverse alternately; medians")
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
               graphs=not args.no_graphs, rounds=args.rounds)
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
