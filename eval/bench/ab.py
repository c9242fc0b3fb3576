"""Side-by-side timing of decode-attention variants in one process: the CalibQuant kernel at one shape, each variant
captured in its own CUDA graph, the graphs replayed in turn (interleaved repeats), so that differences of ~1 us
between variants are not drowned by run-to-run drift. A variant sets environment switches that the kernels read per
call or per compiled variant (``MMKV_FUSED=0``, ``MMKV_INT8_K=0``, ``MMKV_PDL=0``, ...) and/or ``pps=`` (programs
per SM, the ``programs_per_sm`` argument).

    python -m eval.bench.ab --variants "fused:,two-pass:MMKV_FUSED=0,pps6:pps=6" --batch 16 --n 8192

Prints per variant the median over repeats of (median over 7 timings of 20 replays) per call, in microseconds. Each
graph holds 4 calls on 4 input sets (134 MB at B=16, n=8192: more than L2), with calibration on (tau1=1, tau2=3).
These are not the numbers of ``eval/bench/attention.py``'s table (its graphs come from ``do_bench_cudagraph``, which
measured ~2-3 us more per call at B=16, n=8192 on the H100); compare variants within one run of this script.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kernels
from eval.bench.attention import HQ, D, dense_seg, rand_q, visual_seg
from eval.bench.switch_env import switches


def parse(spec: str) -> list[tuple[str, dict, dict]]:
    """``name:K=V;K=V,name2:...`` -> [(name, env, kwargs)]; ``pps=x`` becomes ``programs_per_sm``."""
    out = []
    for item in spec.split(","):
        name, _, rest = item.partition(":")
        env, kw = {}, {}
        for kv in filter(None, rest.split(";")):
            k, _, v = kv.partition("=")
            if k == "pps":
                kw["programs_per_sm"] = float(v)
            elif k == "warps":
                kw["warps"] = int(v)
            else:
                env[k] = v
        out.append((name, env, kw))
    return out


def capture(sets, env: dict, kw: dict) -> torch.cuda.CUDAGraph:
    with switches(env):
        outs = [torch.empty(q.shape, device=q.device, dtype=q.dtype) for q, _ in sets]
        for (q, segs), o in zip(sets, outs, strict=True):  # compile and plan outside the capture
            kernels.decode_attention(q, segs, out=o, **kw)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for (q, segs), o in zip(sets, outs, strict=True):
                kernels.decode_attention(q, segs, out=o, **kw)
        g.outs = outs  # keep the outputs alive with the graph
        return g


def per_call_us(g: torch.cuda.CUDAGraph, calls: int) -> float:
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / 20 / calls)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", required=True, help="name:ENV=V;pps=x,name2:... (an empty spec: library defaults)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--text", type=int, default=0, help="also an fp16 segment of this many tokens per row (a "
                    "request's text and decoded tokens, as in the budget study: 64 + decode steps)")
    ap.add_argument("--fp16", action="store_true", help="the n visual tokens in fp16 (the fp16 baseline's layout)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    make_visual = (lambda: dense_seg(args.batch, args.n)) if args.fp16 else (
        lambda: visual_seg(args.batch, args.n, args.bits, True))
    sets = [(rand_q(args.batch), [make_visual()]
             + ([dense_seg(args.batch, args.text)] if args.text else [])) for _ in range(4)]
    assert sets[0][0].shape == (args.batch, HQ, D)
    graphs = {name: capture(sets, env, kw) for name, env, kw in parse(args.variants)}
    res: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(args.repeats):
        for name, g in graphs.items():
            res[name].append(per_call_us(g, len(sets)))
    shape = f"B={args.batch} n={args.n} " + ("fp16" if args.fp16 else f"{args.bits}-bit")
    shape += f" +{args.text} fp16" if args.text else ""
    for name, ts in res.items():
        print(f"{shape} {name}: median {statistics.median(ts):.1f} us  runs {' '.join(f'{t:.1f}' for t in ts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
