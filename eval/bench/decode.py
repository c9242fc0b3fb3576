"""Decode speed of text-cache methods vs FP16 and vs transformers' ``QuantizedCache`` (XQuant issue, SKVQ issue).

For each context length and batch, every spec gets a cache holding ``context`` text tokens per row (synthetic
prefill, as in ``bench_budget``: speed depends on shapes and bytes, not values), then ``--steps`` decode steps run
through the model; the median step gives tokens/s. Baselines measured in the same run:

* ``hf-fp16``: transformers' ``DynamicCache`` + SDPA (what users get without mmkv);
* ``hf-quanto-2``: transformers' ``QuantizedCache`` (quanto backend, 2 bits, group 64, residual 128), which
  dequantizes the whole cache every step — the peer the product brief is about;
* ``fp16``: mmkv's cache with every token fp16, read by the same decode kernel.

mmkv's caches decode as the Engine does: steps between flushes replay a CUDA graph (``mmkv/graphs.py``);
transformers' caches run eagerly, as users get them. ``--eager SPEC`` adds that spec timed eagerly too.

    mmkv-bench decode --model random:smollm2-135m --contexts 4096,16384,32768 --batches 1,16 \
        --spec "text=kivi:bits=2" --spec "text=xquant:kq=28,vq=2,km=30,vm=14" --out results/decode.json

``--profile`` adds each row's largest kernels inside the step (``common.kernel_times``): the attention call replayed
alone can rank kernel plans differently from the step.

On a random-weight model, ``skvq`` specs without ``artifact=`` are calibrated on the fly on synthetic K/V
(``--skvq-dir``); the artifact's values do not change decode speed, its shapes do.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from ..jsonout import save_json
from .common import (
    cache_bytes,
    decode_tokens_per_s,
    describe,
    gpu_state,
    hf_fp16_cache,
    one_request_cache,
    synthetic_kv,
    tile_cache,
)


def hf_quantized_cache(adapter, n: int, batch: int, device, dtype, nbits: int = 2):
    from transformers import QuantizedCache

    cache = QuantizedCache(backend="quanto", config=adapter.lm_config, nbits=nbits, q_group_size=64,
                           residual_length=128)
    for layer in range(adapter.num_layers):
        k, v = synthetic_kv(adapter, n, device, dtype, seed=layer)
        cache.update(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous(), layer)
    return cache


def build(spec: str, adapter, n: int, batch: int, device, dtype):
    if spec == "hf-fp16":
        return hf_fp16_cache(adapter, n, batch, device, dtype)
    if spec.startswith("hf-quanto-"):
        return hf_quantized_cache(adapter, n, batch, device, dtype, int(spec.rsplit("-", 1)[1]))
    return tile_cache(one_request_cache(spec, adapter, 0, n, device, dtype), batch)


def run(model, adapter, specs: list[str], contexts: list[int], batches: list[int], steps: int,
        eager_specs: tuple[str, ...] = (), rounds: int = 1, profile: bool = False) -> list[dict]:
    """One row per (context, batch, spec); mmkv specs listed in ``eager_specs`` get a second row timed without
    CUDA graphs (spec suffixed `` [eager]``), which shows what host overhead costs. ``rounds`` > 1 measures every
    spec that many times, in the listed order and then reversed, alternately, and keeps the median: a spec measured
    first in a process ran its graph steps faster than the same spec later (H100, docs/BENCHMARKS.md, "The gaps are
    the process's"), so one pass in a fixed order favours whatever comes first (fp16 here). ``profile``: each row
    also gets ``kernels``, the largest kernels of 4 more steps under torch's profiler (``common.kernel_times``; the last
    round's)."""
    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    runs = [(s, True) for s in specs] + [(s, False) for s in specs if s in eager_specs and not s.startswith("hf-")]
    rows = []
    for n in contexts:
        for batch in batches:
            found = [{"context": n, "batch": batch, "spec": spec if graphs else f"{spec} [eager]", "runs_ms": []}
                     for spec, graphs in runs]
            for r in range(rounds):
                order = list(zip(found, runs))
                for row, (spec, graphs) in order if r % 2 == 0 else order[::-1]:
                    if "note" not in row:
                        _measure(model, adapter, row, spec, graphs, n, batch, steps, device, dtype, profile)
            for row in found:
                ms = row.pop("runs_ms")
                if ms:
                    row["step_ms"] = statistics.median(ms)
                    row["tokens_per_s"] = batch * 1000.0 / row["step_ms"]
                    if rounds > 1:
                        row["rounds_ms"] = ms
                else:
                    row.update(tokens_per_s=None, step_ms=None)
                rows.append(row)
    for r in rows:
        for base in ("hf-fp16", "fp16", "hf-quanto-2"):
            b = next((x for x in rows if x["spec"] == base and x["context"] == r["context"]
                      and x["batch"] == r["batch"]), None)
            ok = b and b.get("step_ms") and r.get("step_ms")
            r[f"speedup_vs_{base.replace('-', '_')}"] = b["step_ms"] / r["step_ms"] if ok else None
    return rows


def _measure(model, adapter, row: dict, spec: str, graphs: bool, n: int, batch: int, steps: int, device, dtype,
             profile: bool = False):
    """One timing of ``spec`` into ``row["runs_ms"]`` (or ``row["note"]`` where it cannot run); with ``profile``,
    ``row["kernels"]`` too."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        cache = build(spec, adapter, n, batch, device, dtype)
        row["cache_bytes"] = cache_bytes(cache) if not spec.startswith("hf-quanto") else None
        kernels = {} if profile else None
        _, ms = decode_tokens_per_s(model, cache, batch, n, steps, device, graphs=graphs, kernels=kernels)
        row["runs_ms"].append(ms)
        print(f"n={n:6d} b={batch:3d} {row['spec']:45s} {ms:8.2f} ms/step", flush=True)
        if profile:
            row["kernels"] = kernels
            print(f"    kernels: {describe(kernels)}", flush=True)
        return
    except torch.OutOfMemoryError:
        row["note"] = "out of memory"
    except (ImportError, RuntimeError) as e:  # the peer baseline must not take the whole run down
        if not spec.startswith("hf-quanto"):
            raise
        row["note"] = f"quanto failed: {e!r}"[:300]
    print(f"n={n:6d} b={batch:3d} {row['spec']:45s} {row['note']}", flush=True)


def format_table(rows: list[dict], label: str) -> str:
    out = [f"Decode step time, {label}",
           "| context | batch | spec | ms/step | tok/s | x hf-fp16 | x fp16 | x hf-quanto-2 |",
           "|---:|---:|---|---:|---:|---:|---:|---:|"]

    def f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    for r in rows:
        out.append(f"| {r['context']} | {r['batch']} | {r['spec']} | {f(r.get('step_ms'), '.2f')} | "
                   f"{f(r.get('tokens_per_s'), '.0f')} | {f(r.get('speedup_vs_hf_fp16'), '.2f')} | "
                   f"{f(r.get('speedup_vs_fp16'), '.2f')} | {f(r.get('speedup_vs_hf_quanto_2'), '.2f')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmkv-bench decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--spec", action="append", help="repeatable; hf-fp16, fp16 and hf-quanto-2 are always measured")
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-quanto", action="store_true", help="skip transformers' QuantizedCache (quanto backend)")
    ap.add_argument("--eager", action="append", default=[],
                    help="repeatable: also time this mmkv spec without CUDA graphs (host overhead included)")
    ap.add_argument("--skvq-dir", type=Path, default=Path("results/skvq-synthetic-artifacts"),
                    help="where skvq specs on random-weight models get their synthetic calibration artifact")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every spec this many times, the list's order and its reverse alternately; medians")
    ap.add_argument("--profile", action="store_true",
                    help="per row, the largest kernels of 4 more steps under torch's profiler (JSON: kernels)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mmkv-bench decode measures GPU decode speed and needs a CUDA device")
    import mmkv

    model, _, adapter = mmkv.load_model(args.model, device="cuda", dtype=torch.float16)
    base = ["hf-fp16", "fp16"] + ([] if args.no_quanto else ["hf-quanto-2"])
    specs = base + [s for s in (args.spec or ["text=kivi:bits=2"]) if s not in base]
    if adapter.synthetic:  # random weights: SKVQ specs get an artifact calibrated on synthetic K/V (speed only)
        from mmkv.calibrate.skvq import attach_synthetic_artifacts

        specs = attach_synthetic_artifacts(specs, adapter, args.skvq_dir)
        args.eager = attach_synthetic_artifacts(args.eager, adapter, args.skvq_dir)
    before = gpu_state()
    rows = run(model, adapter, specs, [int(x) for x in args.contexts.split(",")],
               [int(x) for x in args.batches.split(",")], args.steps, tuple(args.eager), args.rounds, args.profile)
    after = gpu_state()
    label = f"{args.model}" + (f" ({adapter.synthetic})" if adapter.synthetic else "")
    label += f", {torch.cuda.get_device_name()}, torch {torch.__version__}"
    print(format_table(rows, label))
    print("GPU before / after:", before, after)
    save_json(args.out, {"label": label, "rows": rows, "gpu_before": before, "gpu_after": after})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
