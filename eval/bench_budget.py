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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from mmkv.cache import MMKVCache
from mmkv.cache import segments as S

GB = 1e9


def synthetic_kv(adapter, n: int, device, dtype, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (1, adapter.num_kv_heads, n, adapter.head_dim)
    offset = torch.randn(1, adapter.num_kv_heads, 1, adapter.head_dim, generator=g) * 2
    k = (torch.randn(shape, generator=g) + offset).to(device, dtype)
    v = torch.randn(shape, generator=g).to(device, dtype)
    return k, v


def one_request_cache(spec: str, adapter, n_visual: int, n_text: int, device, dtype) -> MMKVCache:
    cache = MMKVCache.for_model(spec, adapter)
    n = n_visual + n_text
    visual = torch.zeros(1, n, dtype=torch.bool, device=device)
    visual[:, n_text // 2 : n_text // 2 + n_visual] = True  # system prompt, image, question
    cache.set_inputs(torch.ones(1, n, dtype=torch.long, device=device), visual)
    for layer in range(adapter.num_layers):
        k, v = synthetic_kv(adapter, n, device, dtype, seed=layer)
        cache.update(k, v, layer)
    cache.finalize()
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


def hf_fp16_cache(adapter, n: int, batch: int, device, dtype) -> DynamicCache:
    cache = DynamicCache(config=adapter.lm_config)
    for layer in range(adapter.num_layers):
        k, v = synthetic_kv(adapter, n, device, dtype, seed=layer)
        cache.update(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous(), layer)
    return cache


def cache_bytes(cache) -> int:
    if isinstance(cache, MMKVCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_tokens_per_s(model, cache, batch: int, start_pos: int, steps: int, device) -> tuple[float, float]:
    ids = torch.randint(100, 1000, (batch, 1), device=device)
    times = []
    for i in range(steps + 2):
        pos = torch.full((batch, 1), start_pos + i, device=device)
        _sync(device)
        t0 = time.perf_counter()
        model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync(device)
        if i >= 2:  # the first steps compile kernels and warm the allocator
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return batch / step, step * 1e3


def run(model, adapter, specs: list[str], budgets_gb: list[float], n_visual: int, n_text: int, steps: int,
        max_batch: int) -> list[dict]:
    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    n = n_visual + n_text
    rows = []
    for spec in specs:
        if spec == "hf-fp16":
            per_req = 2 * n * adapter.num_layers * adapter.num_kv_heads * adapter.head_dim * dtype.itemsize
        else:
            per_req = one_request_cache(spec, adapter, n_visual, n_text, device, dtype).nbytes()
        for budget in budgets_gb:
            batch = min(int(budget * GB // per_req), max_batch)
            row = {"spec": spec, "budget_gb": budget, "bytes_per_request": per_req, "max_batch": batch}
            if batch < 1:
                rows.append({**row, "tokens_per_s": 0.0, "note": "one request does not fit"})
                continue
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            if spec == "hf-fp16":
                cache = hf_fp16_cache(adapter, n, batch, device, dtype)
            else:
                cache = tile_cache(one_request_cache(spec, adapter, n_visual, n_text, device, dtype), batch)
            row["cache_bytes"] = cache_bytes(cache)
            tps, ms = decode_tokens_per_s(model, cache, batch, n, steps, device)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            row.update(tokens_per_s=tps, step_ms=ms, peak_memory_bytes=peak)
            rows.append(row)
            print(f"{spec:40s} {budget:5.0f} GB  batch {batch:5d}  {tps:9.1f} tok/s  {ms:7.2f} ms/step", flush=True)
            del cache
    for name in ("hf-fp16", "fp16"):
        base = {r["budget_gb"]: r["tokens_per_s"] for r in rows if r["spec"] == name}
        for r in rows:
            b = base.get(r["budget_gb"])
            r[f"speedup_vs_{name.replace('-', '_')}"] = r["tokens_per_s"] / b if b else None
    return rows


def format_table(rows: list[dict], label: str) -> str:
    out = [f"Throughput under a KV budget, {label}",
           "| spec | budget GB | bytes/request | max batch | decode tok/s | ms/step | x hf-fp16 | x fp16 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(x):
        return f"{x:.2f}" if x else "-"

    for r in rows:
        out.append(f"| {r['spec']} | {r['budget_gb']:.0f} | {r['bytes_per_request']:,} | {r['max_batch']} | "
                   f"{r['tokens_per_s']:.1f} | {r.get('step_ms', 0):.2f} | {ratio(r.get('speedup_vs_hf_fp16'))} | "
                   f"{ratio(r.get('speedup_vs_fp16'))} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmkv-bench budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:internvl2.5-8b")
    ap.add_argument("--spec", action="append", help="repeatable; hf-fp16 and fp16 are always measured first")
    ap.add_argument("--budgets", default="5,10,20,30", help="KV-cache budgets in GB (1e9 bytes)")
    ap.add_argument("--visual", type=int, default=3328)
    ap.add_argument("--text", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mmkv-bench budget measures GPU decode throughput and needs a CUDA device")
    import mmkv

    model, _, adapter = mmkv.load_model(args.model, device="cuda", dtype=torch.float16)
    wanted = args.spec or ["visual=calibquant:bits=2", "visual=calibquant:bits=1"]
    specs = ["hf-fp16", "fp16"] + [s for s in wanted if s not in ("hf-fp16", "fp16")]
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = run(model, adapter, specs, budgets, args.visual, args.text, args.steps, args.max_batch)
    label = f"{args.model}" + (f" ({adapter.synthetic})" if adapter.synthetic else "")
    label += f", {args.visual} visual + {args.text} text tokens per request, {torch.cuda.get_device_name()}"
    print(format_table(rows, label))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"label": label, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
