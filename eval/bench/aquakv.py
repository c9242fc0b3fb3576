"""AQUA-KV decode speed and peak memory vs FP16 (issue 5): one command for a GPU box with no internet.

    python -m eval.bench.aquakv --model random:smollm2-135m --context 16384 --steps 30 --out results/aquakv_gpu

1. The model (``random:smollm2-135m``: SmolLM2-135M's shapes, random weights) is calibrated on the fly: Alg. 1 on
   a few windows of synthetic text (``mmkv.calibrate.aquakv.run``). The predictors are then meaningless for
   quality, which is fine here: decode speed and memory depend on shapes and bytes, not on predictor values.
2. Each spec gets a batch-1 cache of ``--context`` text tokens (synthetic prefill, as ``bench_decode``), then
   ``--steps`` decode steps through the model; the median step gives ms/step and tokens/s.
3. Memory: ``torch.cuda.max_memory_allocated`` over the decode steps minus what was allocated before them is the
   step's transient memory (activations, logits, and for AQUA-KV the reconstruction scratch); the table sets it
   beside the size of one layer's reconstruction (fp32 pre-RoPE K^ and V^ of all text tokens, what ``resolve``
   keeps for the next layer) and the dense K/V a layer's read returns.

Specs: ``fp16`` (mmkv's cache, every token fp16, same decode kernel), AQUA-KV with and without predictors, and
KIVI-2 for reference. ``--smoke`` runs the same code on CPU with the tiny random model (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmkv.cache import cache_kwargs

from .common import one_request_cache, sync


def synthetic_text(path: Path, words: int = 6000, seed: int = 0) -> Path:
    rnd = random.Random(seed)
    vocab = ["the", "of", "river", "city", "was", "in", "1887", "built", "a", "tower", "and", "music", "song",
             "album", "played", "by", "north", "station", "game", "team", "season", "first", "later", "film"]
    path.write_text(" ".join(rnd.choice(vocab) for _ in range(words)) + "\n")
    return path


@torch.inference_mode()
def measure(model, cache, start_pos: int, steps: int, device) -> dict:
    ids = torch.randint(100, 1000, (1, 1), device=device)
    sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, kw = [], cache_kwargs(model, cache)
    for i in range(steps + 2):
        pos = torch.full((1, 1), start_pos + i, device=device)
        sync(device)
        t0 = time.perf_counter()
        model(input_ids=ids, position_ids=pos, **kw, use_cache=True, logits_to_keep=1)
        sync(device)
        if i >= 2:  # the first steps compile kernels and warm the allocator
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    out = {"step_ms": step * 1e3, "tokens_per_s": 1 / step}
    if device.type == "cuda":
        out["allocated_before_bytes"] = base
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["step_extra_bytes"] = out["peak_bytes"] - base
    return out


def run(lm, context: int, steps: int, bits: int, quantizer: str, artifact: Path, window: int = 128,
        sinks: int = 4, log=print) -> list[dict]:
    model, _, ad = lm
    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    tail = f" window={window} sinks={sinks}"
    specs = ["fp16" + tail, f"text=aquakv:bits={bits},quantizer={quantizer},artifact={artifact}" + tail,
             f"text=aquakv:bits={bits},quantizer={quantizer},predictors=false" + tail, "text=kivi:bits=2" + tail]
    c = ad.num_kv_heads * ad.head_dim
    rows = []
    for spec in specs:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cache = one_request_cache(spec, ad, 0, context, device, dtype)
        n_text = cache.layers[0].text_len[0]
        row = {"spec": spec, "context": context, "text_tokens": n_text, "cache_bytes": cache.nbytes(),
               "cache_bytes_used": cache.nbytes(used=True), "effective_bits": cache.effective_bits(),
               "one_layer_recon_bytes": 2 * n_text * c * 4, "one_layer_dense_bytes": 2 * n_text * c * dtype.itemsize}
        text = cache.spec.text
        row["predictor_bytes"] = text.predictor_nbytes() if hasattr(text, "predictor_nbytes") else 0
        row.update(measure(model, cache, context, steps, device))
        rows.append(row)
        log(f"{spec[:70]:70s} {row['step_ms']:8.2f} ms/step  extra {row.get('step_extra_bytes', 0) / 2**20:8.1f} MiB")
        del cache
    base = rows[0]
    for r in rows:
        r["speed_vs_fp16"] = base["step_ms"] / r["step_ms"]
        if "step_extra_bytes" in r:
            r["extra_vs_fp16_bytes"] = r["step_extra_bytes"] - base["step_extra_bytes"]
    return rows


def format_table(rows: list[dict], label: str) -> str:
    out = [f"AQUA-KV decode vs FP16, batch 1, {label}",
           "| spec | context | ms/step | tok/s | x fp16 speed | cache MiB | text bits | step extra MiB | "
           "extra vs fp16 MiB | one layer recon MiB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def mib(x):
        return f"{x / 2**20:.1f}" if x is not None else "-"

    for r in rows:
        out.append(f"| {r['spec']} | {r['context']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | "
                   f"{r['speed_vs_fp16']:.2f} | {mib(r['cache_bytes'])} | {r['effective_bits']['text']:.3f} | "
                   f"{mib(r.get('step_extra_bytes'))} | {mib(r.get('extra_vs_fp16_bytes'))} | "
                   f"{mib(r['one_layer_recon_bytes'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--bits", type=int, default=2, choices=(2, 3, 4))
    ap.add_argument("--quantizer", default="higgs", choices=("uniform", "hadamard", "higgs"))
    ap.add_argument("--calib-windows", type=int, default=4, help="windows of 256 synthetic tokens to calibrate on")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, short context (tests)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv
    from mmkv.calibrate.aquakv import run as calibrate
    from mmkv.methods.aquakv import AquaKV

    if args.smoke:
        lm = mmkv.load_model("random:smollm2-135m", device="cpu", dtype=torch.float32, tiny=True)
        context, steps, window, seq = min(args.context, 300), min(args.steps, 3), 32, 64
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_aquakv measures GPU decode speed and memory and needs a CUDA device "
                             "(--smoke runs it on CPU with a tiny model)")
        lm = mmkv.load_model(args.model, device="cuda", dtype=torch.float16)
        context, steps, window, seq = args.context, args.steps, 128, 256
    with tempfile.TemporaryDirectory() as tmp:
        text = synthetic_text(Path(tmp) / "calib.txt")
        cfg = AquaKV(bits=args.bits, quantizer=args.quantizer)
        t0 = time.perf_counter()
        folder, rep = calibrate(lm, cfg, text, seq_len=seq, max_tokens=seq * args.calib_windows,
                                out=Path(tmp) / "artifact", log=lambda *a: None)
        print(f"calibrated on {rep['calibration']['tokens']} synthetic tokens in {time.perf_counter() - t0:.1f} s "
              f"(random weights: the predictors only have the right shapes)", flush=True)
        rows = run(lm, context, steps, args.bits, args.quantizer, folder, window=window)
    ad = lm.adapter
    dev = torch.cuda.get_device_name() if not args.smoke else "CPU smoke"
    label = f"{ad.name} ({ad.synthetic}), {dev}, {lm.model.dtype}"
    print(format_table(rows, label))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_aquakv.json").write_text(json.dumps({"label": label, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
