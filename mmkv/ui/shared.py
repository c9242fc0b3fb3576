"""``--shared``: the app's chat turns become requests of one continuous-batching ``Scheduler`` (mmkv/batching/),
so several browser users decode in one batch instead of queueing for the model.

``SharedEngine`` wraps an ``mmkv.Engine`` with the part of its interface the chat handlers use (``stream``,
``generate``); everything else (the model, the adapter, the tokenizer: what the attention lens reads) is the
engine's own. A ``SharedStream`` yields a request's text as the scheduler decodes it and keeps a live stats dict
with the keys of ``Stream.stats`` plus ``shared``: the requests in this one's decode batch now and at most, the
KV bytes all requests hold and the budget. Its bytes per modality are the exact projection (``KVBytes``) of this
request's rows, equal to what its cache would hold alone; rows of a batch share padded tensors, so "reserved"
is not known per request and equals "in use".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mmkv.batching import Scheduler
from mmkv.batching.chunks import DEFAULT_CHUNK


@dataclass
class SharedOutput:
    """What the chat handlers keep of a finished answer (the token diff reads ``tokens``)."""

    tokens: list[list[int]]
    text: list[str]
    stats: dict
    cache: object = None


class SharedStream:
    def __init__(self, shared: SharedEngine, job):
        self.shared, self.job = shared, job
        self.stats: dict = {"spec": str(job.spec), "timeline": [], "new_tokens": 0, "prefill_ms": None,
                            "decode_tokens_per_s": 0.0, "peak_memory_bytes": None}
        self.output: SharedOutput | None = None
        self._refresh()

    def stop(self) -> None:
        self.job.cancel()

    def __iter__(self):
        tok = self.shared.tokenizer
        text = ""
        for piece in self.job.pieces(tok):
            text += piece
            self._refresh()
            yield piece
        self._refresh()
        self.output = SharedOutput([list(self.job.tokens)], [text], dict(self.stats))

    def _refresh(self) -> None:
        """The live numbers: this request's tokens and speed, its cache's bytes, the shared batch and budget."""
        job, s = self.job, self.stats
        g = self.shared.scheduler.gauges()
        u = job.usage()
        n = u["new_tokens"]
        s["new_tokens"] = n
        s["prompt_tokens"] = u["prompt_tokens"]
        s["cache_bytes_used"] = dict(u["cache_bytes_used"])
        s["cache_bytes"] = dict(u["cache_bytes_used"])
        s["effective_bits"] = u["effective_bits"]
        s["cache_tokens"] = cache_tokens(job)
        s["cache_dtype"] = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(
            str(job.kv.dtype).split(".")[-1], str(job.kv.dtype))
        s["fp16_equivalent_bytes"] = job.kv.elements_per_token * sum(s["cache_tokens"].values()) * job.kv.dtype.itemsize
        if job.t_first is not None:
            # prefill time as the user waits for it: from submission (queueing included) to the first token
            s["prefill_ms"] = (job.t_first - job.t_submit) * 1e3
            dt = (job.t_end or time.perf_counter()) - job.t_first
            s["decode_tokens_per_s"] = (n - 1) / dt if n > 1 and dt > 0 else 0.0
        s["shared"] = {"batch": g["batches"].get(str(job.spec), 0), "batch_max": job.max_batch,
                       "running": g["running"], "waiting": g["waiting"], "kv_used": g["used"],
                       "kv_held": g.get("held", g["used"]), "kv_budget": g["budget"]}
        if n and (not s["timeline"] or s["timeline"][-1]["step"] < n):
            s["timeline"].append({"step": n, "t_s": time.perf_counter() - job.t_submit,
                                  "tokens_per_s": s["decode_tokens_per_s"],
                                  "cache_bytes": sum(s["cache_bytes_used"].values())})


def cache_tokens(job) -> dict[str, int]:
    """Tokens per segment of the request's cache, as ``MMKVCache.tokens_by_modality`` counts them."""
    from mmkv.batching.kvbytes import text_len

    fed = job.n_text + max(len(job.tokens) - 1, 0)
    kv = job.kv
    quantized = text_len(fed, kv.spec.sinks, kv.spec.window, kv.blocks[0])
    return {"visual": job.n_visual, "text": quantized, "fp16": fed - quantized}


class SharedEngine:
    """An ``mmkv.Engine`` whose generations share one scheduler (started here unless ``start=False``)."""

    def __init__(self, engine, kv_budget_bytes: int | None = None, prefill_chunk: int | None = DEFAULT_CHUNK,
                 scheduler: Scheduler | None = None, start: bool = True):
        self.engine = engine
        self.scheduler = scheduler or Scheduler(engine, kv_budget_bytes, prefill_chunk=prefill_chunk)
        if start:
            self.scheduler.start()

    def __getattr__(self, name):  # the model, adapter, processor, tokenizer, ... (the lens runs on them)
        if name in ("engine", "scheduler") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.engine, name)

    def stream(self, inputs, spec=None, stop=None, **kw) -> SharedStream:
        """As ``Engine.stream``: ``stop`` (an Event) makes the request leave the batch at the next step. Bad input
        and a request larger than the budget raise ValueError here."""
        return SharedStream(self, self.scheduler.submit(inputs, spec=spec, stop=stop, **kw))

    def generate(self, inputs, spec=None, **kw) -> SharedOutput:
        s = self.stream(inputs, spec, **kw)
        for _ in s:
            pass
        return s.output

    def close(self, reason: str = "the app's model was replaced") -> None:
        """Stop the scheduler; requests still in it end with an error that says why."""
        self.scheduler.close(error=RuntimeError(reason))


def shared_loader(base, kv_budget_bytes: int | None = None, prefill_chunk: int | None = DEFAULT_CHUNK):
    """A ``ModelHost`` loader: ``base``'s engine wrapped in a ``SharedEngine`` (an ``mmkv.Engine`` only: the app's
    stand-in engine stays one request at a time). The previous model's scheduler stops when a new model loads."""
    held: list[SharedEngine] = []

    def load(name: str, **kw):
        from mmkv.engine import Engine

        engine, info, lm = base(name, **kw)
        while held:
            held.pop().close()
        if isinstance(engine, Engine):
            engine = SharedEngine(engine, kv_budget_bytes, prefill_chunk)
            info = {**info, "shared": True}
            held.append(engine)
        return engine, info, lm

    return load
