"""Where a whole decode step's device time goes, per kernel (issue 26: the quantized text caches against mmkv fp16
at batch 1): graph-replayed steps of each spec, timed side by side in one process, then a few of those replays
recorded with the torch profiler and split into their kernels.

    python -m eval.studies.step_kernels --model random:internvl2.5-8b --context 32768 --batch 1 \
        --spec fp16 --spec "text=kivi:bits=2" --variants "now:,nopf:MMKV_TEXT_PREFETCH=0" --out results/step_kernels.json

Each spec gets one cache (``eval.bench.common``, as ``mmkv-bench decode`` builds it) and one ``DecodeStepper`` per
variant (a variant sets environment switches, read when its graph is captured); the steppers take turns on the same
cache, round after round, so drift hits every variant alike. Step time: median over the rounds of one synchronized
replay (as ``mmkv-bench decode`` times a step). Profile: per kernel name, launches and device microseconds per step;
the step's device span (first kernel start to last kernel end) against the sum of its kernels (the rest: gaps between
kernels); and the ordered kernels of one layer of the quantized path.

``--sequential``: one variant after the other, each with the only live graph. ``--microgap``: first, the idle time
between kernels of a synthetic graph with and without attention calls. ``--dump-graphs``: each spec's step graph as
Graphviz text beside ``--out`` (``CUDAGraph.debug_dump``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..bench.common import kernel_table
from ..bench.switch_env import parse_variants, switches
from ..jsonout import save_json

ATTN = re.compile(r"segment_kernel|merge_kernel|text_kernel|_channel|skvq|aligned|index_put|scatter")


class Env:
    """Sets one variant's switches, restoring the process's own on the next ``set``."""

    def __init__(self):
        self.cur = switches({})

    def set(self, env: dict) -> None:
        self.cur.__exit__()
        self.cur = switches(env).__enter__()


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
    """Per-name launches and us per step (mean over steps; ``common.kernel_table``, as ``mmkv-bench decode
    --profile`` reports them), the device span and kernel sum per step."""
    per: dict = {}
    for st in steps:
        for k in st:
            c, t = per.get(short(k["name"]), (0, 0.0))
            per[short(k["name"])] = (c + 1, t + k["dur"])
    n = len(steps)
    spans = [st[-1]["ts"] + st[-1]["dur"] - st[0]["ts"] for st in steps]
    busy = [sum(k["dur"] for k in st) for st in steps]
    attn = [sum(k["dur"] for k in st if ATTN.search(k["name"])) for st in steps]
    return {
        "kernels": kernel_table(per, n),
        "span_us": statistics.median(spans), "busy_us": statistics.median(busy), "attn_us": statistics.median(attn),
        "launches": statistics.median(len(st) for st in steps),
    }


def layer_sequence(step: list[dict], num_layers: int) -> list[dict]:
    """The kernels of the middle layer, in order, with the idle time before each. Layers are cut at the kernel
    launched exactly ``num_layers`` times whose first launch comes earliest (the first kernel of every layer)."""
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


def _check(stepper, cache) -> None:
    """A graph captured before another stepper's flush-time eager step may read memory that moved: drop it (the
    stepper recaptures). Host work kept out of the timed step (``mmkv-bench decode`` does not do it either)."""
    if stepper.graph is not None and cache.layout_signature() != stepper.signature:
        stepper.graph = stepper.logits = None


@torch.inference_mode()
def run(model, adapter, spec: str, variants, context: int, batch: int, rounds: int, prof_steps: int,
        sequential: bool = False) -> dict:
    """``sequential``: one variant after the other, each stepper (its captured graph) freed before the next
    starts; else every variant's stepper lives at once and they take turns."""
    from eval.bench.decode import build
    from mmkv.graphs import DecodeStepper

    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    torch.cuda.empty_cache()
    cache = build(spec, adapter, context, batch, device, dtype)
    env = Env()
    steppers = [None] * len(variants)
    ids = torch.randint(100, 1000, (batch, 1), device=device)
    pos_i = [context]

    def step(v: int) -> tuple[bool, float]:
        env.set(variants[v][1])
        if steppers[v] is None:
            steppers[v] = DecodeStepper(model, cache, graphs=True)
        st = steppers[v]
        _check(st, cache)
        pos = torch.full((batch, 1), pos_i[0], device=device)
        pos_i[0] += 1
        before = st.replays
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st(ids, pos)
        torch.cuda.synchronize()
        return st.replays == before + 1, (time.perf_counter() - t0) * 1e3

    def timed(vs: list[int]) -> None:
        for v in vs:  # eager (compiles), capture
            step(v)
            step(v)
        for _ in range(rounds):
            for v in vs:
                ok, ms = step(v)
                if ok:
                    times[v].append(ms)

    def profiled(v: int) -> None:
        name, venv = variants[v]
        for _ in range(80):  # a valid graph for this variant, and no flush (eager step, capture) while profiling
            if step(v)[0] and cache.decode_steps_free() > prof_steps + 1:
                break
        ks = _profile(lambda: step(v), prof_steps)
        graphed = bool(ks)
        if not ks:  # no kernel records of graph replays: profile an eager step (same kernels, host gaps between)
            eager = DecodeStepper(model, cache, graphs=False)
            env.set(venv)
            ks = _profile(lambda: eager(ids, torch.full((batch, 1), context, device=device)), 1)
        steps = [s for s in split_steps(ks, 40.0 if graphed else 1e9) if len(s) > 20]
        summ = summarize(steps) if steps else {"kernels": {}, "span_us": 0.0, "busy_us": 0.0, "attn_us": 0.0,
                                               "launches": 0}
        seq = layer_sequence(steps[len(steps) // 2], adapter.num_layers) if steps else []
        med = statistics.median(times[v]) if times[v] else None
        r = res["variants"][name] = {"env": venv, "step_ms": med, "step_ms_all": times[v],
                                     "profiled": "graph" if graphed else "eager", **summ, "layer": seq}
        if steps:  # one whole step, in order: (kernel, start us from the step's first kernel, us)
            mid = steps[len(steps) // 2]
            r["step"] = [(short(k["name"]), round(k["ts"] - mid[0]["ts"], 2), k["dur"]) for k in mid]

    times: list[list[float]] = [[] for _ in variants]
    res = {"spec": spec, "context": context, "batch": batch, "sequential": sequential, "variants": {}}
    if sequential:
        for v in range(len(variants)):
            timed([v])
            profiled(v)
            steppers[v] = None  # frees its graph and pool before the next variant captures
            torch.cuda.empty_cache()
    else:
        timed(list(range(len(variants))))
        for v in range(len(variants)):
            profiled(v)
    env.set({})
    return res


@torch.inference_mode()
def dump_graph(model, adapter, spec: str, context: int, batch: int, path: Path) -> None:
    """The CUDA graph of one decode step of ``spec`` as Graphviz text (``CUDAGraph.debug_dump``: every node, its
    type, kernel and launch parameters), to compare what two specs' graphs are made of."""
    from eval.bench.decode import build
    from mmkv import graphs

    base = torch.cuda.CUDAGraph

    class Debug(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.enable_debug_mode()

    device = model.get_input_embeddings().weight.device
    cache = build(spec, adapter, context, batch, device, model.get_input_embeddings().weight.dtype)
    ids = torch.randint(100, 1000, (batch, 1), device=device)
    graphs.torch.cuda.CUDAGraph = Debug
    try:
        st = graphs.DecodeStepper(model, cache, graphs=True)
        for i in range(3):
            st(ids, torch.full((batch, 1), context + i, device=device))
        if st.graph is not None:
            st.graph.debug_dump(str(path))
    finally:
        graphs.torch.cuda.CUDAGraph = base
    torch.cuda.synchronize()


@torch.inference_mode()
def microgap(layers: int = 64) -> dict:
    """Idle time between kernels of a CUDA graph of tiny elementwise kernels, with and without decode attention
    calls between them (InternVL heads, B1, 4096 tokens): does one kind of attention kernel in a graph change how
    fast the graph moves from any kernel to the next? Mean gap (us) before the elementwise kernels, per case."""
    from kernels import decode_attention, testing

    HQ, H, D = 32, 8, 128
    dev = "cuda"
    q = torch.randn(1, HQ, D, device=dev, dtype=torch.float16)
    win = testing.dense_seg(1, H, 160, D, device=dev)
    big = testing.dense_seg(1, H, 4096, D, device=dev)
    kv = testing.kivi_seg(1, H, 4096, D, 4096, 2, 2, 32, 32, device=dev)
    x = torch.zeros(4096, device=dev)
    cases = (("none", None, {}), ("dense", [win, big], {}), ("kivi-gluon", [win, kv], {}),
             ("kivi-only", [kv], {}))
    env = Env()
    out = {}
    for name, segs, e in cases:
        env.set(e)

        def body(segs=segs):
            for _ in range(layers):
                x.add_(1.0)
                x.mul_(1.0)
                x.add_(-1.0)
                if segs:
                    decode_attention(q, segs)
        body()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        g.replay()
        torch.cuda.synchronize()

        def rep(g=g):
            g.replay()
            torch.cuda.synchronize()
        ks = _profile(rep, 3)
        steps = [s for s in split_steps(ks) if len(s) > layers]
        gaps, other = [], []
        for st in steps:
            for a, b in zip(st, st[1:]):
                gap = b["ts"] - (a["ts"] + a["dur"])
                (gaps if "elementwise" in b["name"] else other).append(gap)
        t0 = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        out[name] = {"gap_elementwise_us": statistics.mean(gaps) if gaps else None,
                     "gap_other_us": statistics.mean(other) if other else None,
                     "replay_us": (time.perf_counter() - t0) / 20 * 1e6,
                     "span_us": statistics.median(s[-1]["ts"] + s[-1]["dur"] - s[0]["ts"] for s in steps)
                     if steps else None, "kernels": len(steps[0]) if steps else 0}
        print(f"microgap {name:12s} " + " ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in out[name].items()), flush=True)
        del g
    env.set({})
    return out


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
            lines.append(f"| {k} | {d['calls_per_step']:.0f} | {d['us_per_step']:.1f} | {d['us_per_call']:.2f} | "
                         f"{delta:+.1f} |")
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
    ap.add_argument("--dump-graphs", action="store_true", help="each spec's step graph as Graphviz text by --out")
    ap.add_argument("--sequential", action="store_true", help="one variant's graph alive at a time")
    ap.add_argument("--microgap", action="store_true", help="first: kernel-to-kernel gaps of a synthetic graph")
    ap.add_argument("--base-variants", action="store_true", help="run every variant on the first spec too")
    ap.add_argument("--skvq-dir", type=Path, default=Path("results/skvq-synthetic-artifacts"),
                    help="where skvq specs on random-weight models get their synthetic calibration artifact")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv
    from eval.bench import common

    common.synthetic_kv = _memo(common.synthetic_kv)

    model, _, adapter = mmkv.load_model(args.model, device="cuda", dtype=torch.float16)
    variants = parse_variants(args.variants)
    gaps = microgap() if args.microgap else None
    specs = args.spec or ["fp16", "text=kivi:bits=2"]
    if adapter.synthetic:  # random weights: SKVQ specs get an artifact calibrated on synthetic K/V, as the bench's
        from mmkv.calibrate.skvq import attach_synthetic_artifacts

        specs = attach_synthetic_artifacts(specs, adapter, args.skvq_dir)
    results, base = [], None
    for i, spec in enumerate(specs):
        # the baseline (first spec) runs as it is; the variants are the quantized path's switches
        vs = variants if i or args.base_variants else variants[:1]
        res = run(model, adapter, spec, vs, args.context, args.batch, args.rounds, args.profile_steps,
                  args.sequential)
        results.append(res)
        first = next(iter(res["variants"].values()))
        print(report(res, base), flush=True)
        base = base or first
    if args.dump_graphs and args.out:
        for spec in specs:
            tag = re.sub(r"[^A-Za-z0-9]", "_", spec)[:24]
            dump_graph(model, adapter, spec, args.context, args.batch, args.out.parent / f"graph_{tag}.dot")
    label = f"{args.model}, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    save_json(args.out, {"label": label, "results": results, "microgap": gaps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
