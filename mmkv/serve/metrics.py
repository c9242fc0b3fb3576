"""The server's counters and histograms, rendered in Prometheus' text exposition format (``/metrics``)."""

from __future__ import annotations

import bisect
import threading
from collections import Counter

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.total += x
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        return out + [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.n}"]


class Metrics:
    """Thread-safe: generation threads and request handlers update it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.requests = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.kv_bytes_used = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.source = None  # the scheduler's gauges (running, waiting, KV bytes used and budget), when batching

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def render(self, model: str) -> str:
        g = self.source() if self.source is not None else {}
        with self.lock:
            m = f'model="{model}"'
            running, waiting = g.get("running", self.running), g.get("waiting", self.waiting)
            out = ["# TYPE mmkv_requests_running gauge", f"mmkv_requests_running{{{m}}} {running}",
                   "# TYPE mmkv_requests_waiting gauge", f"mmkv_requests_waiting{{{m}}} {waiting}",
                   "# TYPE mmkv_requests_total counter"]
            out += [f'mmkv_requests_total{{{m},endpoint="{e}",status="{s}"}} {c}'
                    for (e, s), c in sorted(self.requests.items())]
            out += ["# TYPE mmkv_prompt_tokens_total counter", f"mmkv_prompt_tokens_total{{{m}}} {self.prompt_tokens}",
                    "# TYPE mmkv_generation_tokens_total counter",
                    f"mmkv_generation_tokens_total{{{m}}} {self.generation_tokens}",
                    "# HELP mmkv_kv_cache_bytes_used bytes the requests' tokens occupy in their KV caches",
                    "# TYPE mmkv_kv_cache_bytes_used gauge",
                    f"mmkv_kv_cache_bytes_used{{{m}}} {g.get('used', self.kv_bytes_used)}"]
            if g:
                out += ["# HELP mmkv_kv_cache_bytes_held bytes every KV cache tensor holds, spare and pad rows and "
                        "capacity included (what --kv-budget-gb bounds)",
                        "# TYPE mmkv_kv_cache_bytes_held gauge", f"mmkv_kv_cache_bytes_held{{{m}}} {g.get('held', 0)}",
                        "# HELP mmkv_kv_cache_bytes_spare bytes of mmkv_kv_cache_bytes_held in the spare and pad rows "
                        "of decode batches (no request's tokens)",
                        "# TYPE mmkv_kv_cache_bytes_spare gauge",
                        f"mmkv_kv_cache_bytes_spare{{{m}}} {g.get('spare', 0)}",
                        "# TYPE mmkv_kv_cache_bytes_budget gauge",
                        f"mmkv_kv_cache_bytes_budget{{{m}}} {g['budget'] if g['budget'] is not None else 'NaN'}",
                        "# TYPE mmkv_batch_size_max gauge", f"mmkv_batch_size_max{{{m}}} {g['max_batch']}",
                        "# TYPE mmkv_requests_prefilling gauge",
                        f"mmkv_requests_prefilling{{{m}}} {g.get('prefilling', 0)}",
                        "# TYPE mmkv_prefill_chunks_total counter",
                        f"mmkv_prefill_chunks_total{{{m}}} {g.get('prefill_chunks', 0)}",
                        "# TYPE mmkv_prefill_tokens_total counter",
                        f"mmkv_prefill_tokens_total{{{m}}} {g.get('prefill_tokens', 0)}"]
                out += _graph_lines(g.get("graphs", {}), m)
            out += ["# TYPE mmkv_time_to_first_token_seconds histogram"]
            out += self.ttft.lines("mmkv_time_to_first_token_seconds", m)
            out += ["# TYPE mmkv_time_per_output_token_seconds histogram"]
            out += self.tpot.lines("mmkv_time_per_output_token_seconds", m)
        return "\n".join(out) + "\n"


# the scheduler's decode-graph and slot counters (Scheduler.graph_stats): name, help
GRAPH_COUNTERS = (
    ("graph_captures", "decode steps captured into a CUDA graph"),
    ("graph_replays", "decode steps replayed from a captured graph"),
    ("eager_steps", "decode steps run without a graph (first steps, flushes, growth, CPU)"),
    ("joins_in_place", "requests written into a spare row of their batch (no new graph)"),
    ("joins_merged", "requests whose rows were merged into their batch (new tensors: a new graph)"),
    ("leaves_in_place", "requests whose row became a spare row in place (no new graph)"),
    ("reshapes", "batches padded or shrunk to a new bucket of rows (a new graph)"),
)


def _graph_lines(g: dict, m: str) -> list[str]:
    out = []
    for key, help_ in GRAPH_COUNTERS:
        name = f"mmkv_decode_{key}_total"
        out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name}{{{m}}} {g.get(key, 0)}"]
    return out
