"""Where a whole decode step's device time goes, per kernel (issue 26: the quantized text caches against mmkv fp16
at batch 1): graph-replayed steps of each spec, timed side by side in one process, then a few of those replays
recorded with the torch profiler and split into their kernels.

    python -m eval.studies.step_kernels --model random:internvl2.5-8b --context 32768 --batch 1 \
        --spec fp16 --spec "text=kivi:bits=2" --variants "base:,nowin:MMKV_X=0" --out results/step_kernels.json

Each spec gets one cache (``eval.bench.common``, as ``mmkv-bench decode`` builds it) and one ``DecodeStepper`` per
variant (a variant sets environment switches, read when its graph is captured); the steppers take turns on the same
cache, round after round, so drift hits every variant alike. Step time: median over the rounds of one synchronized
replay (as ``mmkv-bench decode`` times a step). Profile: per kernel name, launches and device microseconds per step;
the step's device span (first kernel start to last kernel end) against the sum of its kernels (the rest: gaps between
kernels); and the ordered kernels of one layer of the quantized path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..jsonout import save_json

ATTN = re.compile(r"segment_kernel|merge_kernel|text_kernel|_channel|skvq|aligned|index_put|scatter")


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``name:K=V;K=V,name2:`` -> [(name, env)]."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, rest = item.partition(":")
        env = dict(kv.split("=", 1) for kv in filter(None, rest.split(";")))
        out.append((name, env))
    return out


class Env:
    """Sets one variant's switches, restoring the process's own on the next ``set``."""

    def __init__(self):
        self.saved: dict = {}

    def set(self, env: dict) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)


def _step(stepper, cache, ids, pos) -> bool:
    """One step of ``stepper``; True where it was a plain replay. A graph captured by another stepper's flush-time
    eager step may read memory that moved: such a graph is dropped and recaptured."""
    if stepper.graph is not None and cache.layout_signature() != stepper.signature:
        stepper.graph = stepper.logits = None
    before = stepper.replays
    stepper(ids, pos)
    return stepper.replays == before + 1


def kernels_of(trace: Path) -> list[dict]:
    ev = json.loads(trace.read_text())["traceEvents"]
    ks = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])} for e in ks),
                  key=lambda e: e["ts"])


def split_steps(ks: list[dict], gap_us: float = 40.0) -> list[list[dict]]:
    """Kernels grouped into steps: a step ends where the device idles ``gap_us`` (the host syncs between steps)."""
    steps, cur, end = [], [], None
    for k in ks:
        if cur and k["ts"] - end > gap_us:
            steps.append(cur)
            cur = []
        cur.append(k)
        end = max(end or 0.0, k["ts"] + k["dur"]) if cur[1:] else k["ts"] + k["dur"]
    if cur:
        steps.append(cur)
    return steps


def short(name: str) -> str:
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"<.*", "", name)
    return name[:70]


def summarize(steps: list[list[dict]]) -> dict:
    """Per-name launches and us per step (mean over steps), the device span and kernel sum per step."""
    per: dict = {}
    for st in steps:
        for k in st:
            d = per.setdefault(short(k["name"]), [0, 0.0])
            d[0] += 1
            d[1] += k["dur"]
    n = len(steps)
    spans = [st[-1]["ts"] + st[-1]["dur"] - st[0]["ts"] for st in steps]
    busy = [sum(k["dur"] for k in st) for st in steps]
    attn = [sum(k["dur"] for k in st if ATTN.search(k["name"])) for st in steps]
    return {
        "kernels": {name: {"per_step": c / n, "us_per_step": t / n, "us_each": t / c}
                    for name, (c, t) in sorted(per.items(), key=lambda x: -x[1][1])},
        "span_us": statistics.median(spans), "busy_us": statistics.median(busy), "attn_us": statistics.median(attn),
        "launches": statistics.median(len(st) for st in steps),
    }


def layer_sequence(step: list[dict], num_layers: int) -> list[dict]:
    """The kernels of the middle layer, in order, with the gap before each (layers cut at each launch of the step's
    most frequent attention kernel that runs once per layer... found as the name launched exactly ``num_layers``
    times whose first launch comes earliest)."""
    counts: dict = {}
    for k in step:
        counts[short(k["name"])] = counts.get(short(k["name"]), 0) + 1
    once = [n for n, c in counts.items() if c == num_layers]
    if not once:
        return []
    first = min(once, key=lambda n: next(i for i, k in enumerate(step) if short(k["name"]) == n))
    idx = [i for i, k in enumerate(step) if short(k["name"]) == first]
    mid = num_layers // 2
    lo, hi = idx[mid], idx[mid + 1] if mid + 1 < len(idx) else len(step)
    out, prev_end = [], step[lo - 1]["ts"] + step[lo - 1]["dur"] if lo else step[lo]["ts"]
    for k in step[lo:hi]:
        out.append({"name": short(k["name"]), "dur": k["dur"], "gap": k["ts"] - prev_end})
        prev_end = k["ts"] + k["dur"]
    return out


def _memo(fn):
    """``synthetic_kv`` kept per layer on the device: every spec is built from the same K/V without drawing 2 x 32
    layers of random numbers on the host again (the values are the bench's own)."""
    memo: dict = {}

    def get(adapter, n, device, dtype, seed):
        key = (n, str(device), dtype, seed)
        if key not in memo:
            memo[key] = fn(adapter, n, device, dtype, seed)
        return memo[key]
    return get


def _profile(step_fn, n: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(n):
                step_fn()
        trace = Path(tmp) / "t.json"
        p.export_chrome_trace(str(trace))
        return kernels_of(trace)


@torch.inference_mode()
def run(model, adapter, spec: str, variants, context: int, batch: int, rounds: int, prof_steps: int,
        out_dir: Path | None) -> dict:
    from eval.bench.decode import build
    from mmkv.graphs import DecodeStepper

    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    torch.cuda.empty_cache()
    cache = build(spec, adapter, context, batch, device, dtype)
    env = Env()
    steppers = [DecodeStepper(model, cache, graphs=True) for _ in variants]
    ids = torch.randint(100, 1000, (batch, 1), device=device)
    pos_i = [context]

    def step(v: int) -> tuple[bool, float]:
        env.set(variants[v][1])
        pos = torch.full((batch, 1), pos_i[0], device=device)
        pos_i[0] += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ok = _step(steppers[v], cache, ids, pos)
        torch.cuda.synchronize()
        return ok, (time.perf_counter() - t0) * 1e3

    for v in range(len(variants)):  # eager (compiles), capture
        step(v)
        step(v)
    times = [[] for _ in variants]
    for _ in range(rounds):
        for v in range(len(variants)):
            ok, ms = step(v)
            if ok:
                times[v].append(ms)
    res = {"spec": spec, "context": context, "batch": batch, "variants": {}}
    for v, (name, venv) in enumerate(variants):
        for _ in range(40):  # a valid graph for this variant
            if step(v)[0]:
                break
        ks = _profile(lambda v=v: step(v), prof_steps)
        graphed = bool(ks)
        if not ks:  # no kernel records of graph replays: profile eager steps (same kernels, host gaps between)
            eager = DecodeStepper(model, cache, graphs=False)
            env.set(venv)
            ks = _profile(lambda e=eager: e(ids, torch.full((batch, 1), context, device=device)), 1)
        steps = [s for s in split_steps(ks, 40.0 if graphed else 1e9) if len(s) > 20]
        summ = summarize(steps) if steps else {"kernels": {}, "span_us": 0.0, "busy_us": 0.0, "attn_us": 0.0,
                                               "launches": 0}
        seq = layer_sequence(steps[len(steps) // 2], adapter.num_layers) if steps else []
        med = statistics.median(times[v]) if times[v] else None
        res["variants"][name] = {"env": venv, "step_ms": med, "step_ms_all": times[v], "profiled": "graph" if graphed
                                 else "eager", **summ, "layer": seq}
        if out_dir is not None and steps:
            tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{spec}_{name}")[:60]
            (out_dir / f"steps_{tag}.json").write_text(json.dumps(steps[len(steps) // 2]))
    env.set({})
    return res


def report(res: dict, base: dict | None) -> str:
    lines = []
    for name, r in res["variants"].items():
        lines.append(f"## {res['spec']} [{name}] B{res['batch']} n{res['context']}: step {r['step_ms'] or float('nan'):.3f} ms "
                     f"(graph replays, median of {len(r['step_ms_all'])}); device span {r['span_us']:.0f} us, "
                     f"({r['profiled']}) kernels {r['busy_us']:.0f} us, attention kernels {r['attn_us']:.0f} us, "
                     f"{r['launches']:.0f} launches")
        lines.append("| kernel | per step | us/step | us each | vs base us/step |")
        lines.append("|---|---:|---:|---:|---:|")
        bk = base["kernels"] if base else {}
        for k, d in r["kernels"].items():
            delta = d["us_per_step"] - bk.get(k, {}).get("us_per_step", 0.0) if base else float("nan")
            lines.append(f"| {k} | {d['per_step']:.0f} | {d['us_per_step']:.1f} | {d['us_each']:.2f} | {delta:+.1f} |")
        if base:
            for k, d in bk.items():
                if k not in r["kernels"]:
                    lines.append(f"| {k} | 0 | 0 | - | {-d['us_per_step']:+.1f} |")
        lines.append("middle layer, in order (us, gap before):")
        lines.append("; ".join(f"{e['name'][:40]} {e['dur']:.1f} (+{e['gap']:.1f})" for e in r["layer"]))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:internvl2.5-8b")
    ap.add_argument("--spec", action="append", help="repeatable; the first is the baseline of the diff column")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--variants", default="base:", help="name:K=V;K=V,... (environment switches per variant)")
    ap.add_argument("--base-variants", action="store_true", help="run every variant on the first spec too")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv
    from eval.bench import common

    common.synthetic_kv = _memo(common.synthetic_kv)

    model, _, adapter = mmkv.load_model(args.model, device="cuda", dtype=torch.float16)
    variants = parse_variants(args.variants)
    out_dir = args.out.parent if args.out else None
    results, base = [], None
    for i, spec in enumerate(args.spec or ["fp16", "text=kivi:bits=2"]):
        # the baseline (first spec) runs as it is; the variants are the quantized path's switches
        vs = variants if i or args.base_variants else variants[:1]
        res = run(model, adapter, spec, vs, args.context, args.batch, args.rounds, args.profile_steps, out_dir)
        results.append(res)
        first = next(iter(res["variants"].values()))
        print(report(res, base), flush=True)
        base = base or first
    label = f"{args.model}, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    save_json(args.out, {"label": label, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
