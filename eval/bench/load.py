"""Load generator for ``mmkv-serve`` (``mmkv-bench load``): Poisson arrivals at given rates against a local server.

Per rate it sends at most ``--requests`` streamed chat requests (and stops sending after ``--duration`` seconds),
arrivals drawn from an exponential distribution (seeded), each a prompt of ``--prompt-words`` words (and an image
as a data URL with ``--image``) asking for ``--max-tokens`` tokens. It reports, per rate: requests completed and
failed, output tokens/s over the rate's wall time, time to first token and time per output token (p50, p99), and
the most requests in flight at once. Loopback servers only (this is a measurement tool, not a traffic generator).

    mmkv-bench load --url http://127.0.0.1:8000 --rates 0.5,1,2 --requests 20 --max-tokens 64 \
        --out results/load.json --plot results/load.svg
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import time
from urllib.parse import urlparse

from eval.jsonout import save_json

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WORDS = ("the cache holds every token the model has seen and a quantized cache holds it in fewer bits so that "
         "more requests fit into the same memory").split()


def percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def _one(client, url: str, body: dict, stats: dict) -> None:
    t0 = time.perf_counter()
    first = None
    n = 0
    stats["inflight"] += 1
    stats["max_inflight"] = max(stats["max_inflight"], stats["inflight"])
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                await r.aread()
                stats["errors"].append(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    stats["errors"].append(ev["error"]["message"][:200])
                    return
                if first is None and ev["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
                if ev.get("usage"):
                    n = ev["usage"]["completion_tokens"]
        end = time.perf_counter()
        stats["tokens"] += n
        stats["done"] += 1
        if first is not None:
            stats["ttft"].append(first - t0)
            if n > 1:
                stats["tpot"].append((end - first) / (n - 1))
    except Exception as e:  # noqa: BLE001 - a failed request is a measurement, not a crash
        stats["errors"].append(repr(e)[:200])
    finally:
        stats["inflight"] -= 1


async def run_rate(url: str, rate: float, requests: int, duration: float, body: dict, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    stats = {"inflight": 0, "max_inflight": 0, "done": 0, "tokens": 0, "ttft": [], "tpot": [], "errors": []}
    t0 = time.perf_counter()
    tasks = []
    # httpx pools 100 connections by default: more requests in flight would queue in the client, not the server
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        for _ in range(requests):
            if time.perf_counter() - t0 > duration:
                break
            tasks.append(asyncio.create_task(_one(client, url, body, stats)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    return {"rate": rate, "sent": len(tasks), "completed": stats["done"], "failed": len(stats["errors"]),
            "errors": stats["errors"][:10], "wall_s": wall, "output_tokens": stats["tokens"],
            "output_tokens_per_s": stats["tokens"] / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile(stats["ttft"], 50), "ttft_p99_s": percentile(stats["ttft"], 99),
            "tpot_p50_s": percentile(stats["tpot"], 50), "tpot_p99_s": percentile(stats["tpot"], 99),
            "max_concurrent": stats["max_inflight"]}


def svg_plot(rows: list[dict], path: str) -> None:
    """Output tokens/s and p99 time per output token against the request rate, as a small SVG (no plotting
    library needed)."""
    w, h, pad = 560, 260, 48
    xs = [r["rate"] for r in rows]
    series = [("output tokens/s", [r["output_tokens_per_s"] for r in rows], "#1f77b4"),
              ("p99 TPOT ms", [1e3 * (r["tpot_p99_s"] or 0.0) for r in rows], "#d62728")]
    xmax = max(xs) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="11"><rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">request rate (req/s)</text>']
    for k, (name, ys, col) in enumerate(series):
        ymax = max(ys) or 1.0
        pts = " ".join(f"{pad + (w - 2 * pad) * x / xmax:.1f},{h - pad - (h - 2 * pad) * y / ymax:.1f}"
                       for x, y in zip(xs, ys, strict=True))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{col}" stroke-width="2"/>')
        parts.append(f'<text x="{pad + 150 * k}" y="16" fill="{col}">{name} (max {ymax:.1f})</text>')
    parts.append("</svg>")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmkv-bench load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rates", default="0.5,1,2", help="request rates (req/s), comma-separated")
    ap.add_argument("--requests", type=int, default=20, help="most requests sent per rate")
    ap.add_argument("--duration", type=float, default=60.0, help="stop sending after this many seconds per rate")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--image", default=None, help="an image file sent with every request (as a data URL)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec", default=None, help="mmkv cache spec of every request (default: the server's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/load.json")
    ap.add_argument("--plot", default=None, help="also write an SVG plot here")
    args = ap.parse_args(argv)
    host = urlparse(args.url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"--url must point at this machine ({', '.join(sorted(LOOPBACK))}), got {host!r}")
    rates = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in rates) or args.requests < 1 or args.duration <= 0:
        raise SystemExit("rates, --requests and --duration must be positive")
    text = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_words))
    content: list | str = text
    if args.image:
        with open(args.image, "rb") as f:
            data = base64.b64encode(f.read()).decode()
        content = [{"type": "text", "text": text},
                   {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens, "temperature": 0,
            "stream": True, **({"mmkv": {"spec": args.spec}} if args.spec else {})}
    rows = []
    print("| rate req/s | sent | done | failed | out tok/s | TTFT p50/p99 s | TPOT p50/p99 ms | max in flight |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, rate in enumerate(rates):
        r = asyncio.run(run_rate(args.url, rate, args.requests, args.duration, body, args.seed + i))
        rows.append(r)

        def f(x, k=1.0):
            return "-" if x is None else f"{x * k:.2f}"

        print(f"| {rate} | {r['sent']} | {r['completed']} | {r['failed']} | {r['output_tokens_per_s']:.1f} | "
              f"{f(r['ttft_p50_s'])}/{f(r['ttft_p99_s'])} | {f(r['tpot_p50_s'], 1e3)}/{f(r['tpot_p99_s'], 1e3)} | "
              f"{r['max_concurrent']} |", flush=True)
    save_json(args.out, {"args": vars(args), "rows": rows})
    if args.plot:
        svg_plot(rows, args.plot)
    return 0
