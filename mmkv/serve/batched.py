"""The server's generation path over the continuous-batching scheduler (mmkv/batching/): each request becomes a
scheduler job; its text streams back through the same callbacks as the one-at-a-time ``Runner``."""

from __future__ import annotations

import threading
import time

from .metrics import Metrics
from .protocol import APIError
from .stops import StopScanner


class BatchRunner:
    def __init__(self, scheduler, engine, metrics: Metrics):
        self.scheduler, self.engine, self.metrics = scheduler, engine, metrics
        metrics.source = scheduler.gauges

    def run(self, req, on_piece, stop: threading.Event) -> dict:
        """Blocking: submit ``req``, call ``on_piece(text)`` as its tokens arrive; returns the result summary.
        ``stop`` (set when the client goes away) makes its rows leave the batch at the next step."""
        tok = self.engine.tokenizer
        inputs = req.inputs if req.chat else tok(req.inputs, return_tensors="pt").input_ids
        try:
            job = self.scheduler.submit(inputs, spec=req.spec, stop=stop, **req.sampling())
        except ValueError as e:  # bad spec, unreadable media, a prompt too long for the KV budget
            raise APIError(400, str(e)) from e
        finally:
            req.cleanup()  # the media are read and prepared by now
        scan = StopScanner(req.stop)
        for piece in job.pieces(tok):
            out = scan.feed(piece)
            if out:
                on_piece(out)
            if scan.hit:
                job.cancel()
        tail = scan.flush()
        if tail:
            on_piece(tail)
        u = job.usage()
        n_new, prompt, kv = u["new_tokens"], u["prompt_tokens"], sum(u["cache_bytes_used"].values())
        with self.metrics.lock:
            self.metrics.prompt_tokens += sum(prompt.values())
            self.metrics.generation_tokens += n_new
            if job.t_first is not None:
                self.metrics.ttft.observe(job.t_first - job.t_submit)
            if n_new > 1 and job.t_first is not None:
                self.metrics.tpot.observe(((job.t_end or time.perf_counter()) - job.t_first) / (n_new - 1))
        reason = "stop" if scan.hit or job.finish_reason == "stop" else "length"
        return {"text": scan.text, "finish_reason": reason,
                "usage": {"prompt_tokens": sum(prompt.values()), "completion_tokens": n_new,
                          "total_tokens": sum(prompt.values()) + n_new,
                          "mmkv": {"spec": req.spec, "kv_cache_bytes": kv, "effective_bits": u["effective_bits"],
                                   "prompt_tokens_by_modality": prompt, "preemptions": u["preemptions"]}}}
