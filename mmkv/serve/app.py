"""The OpenAI-compatible HTTP API over one ``mmkv.Engine`` (FastAPI; ``mmkv-serve`` runs it under uvicorn).

Endpoints: ``/v1/chat/completions`` and ``/v1/completions`` (``stream`` as server-sent events), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus text). The response's ``usage`` adds an ``mmkv`` object: the spec, the bytes
the request's KV cache held and its effective bits.

An ``mmkv.Engine`` is served by continuous batching (``BatchRunner`` over ``mmkv.batching.Scheduler``: requests
join and leave one running batch per spec, admitted by their exact KV bytes against ``kv_budget_bytes``, in fair
first-come order). Any other engine (the app's stand-in) is served one request at a time in arrival order
(``Runner``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..batching.chunks import DEFAULT_CHUNK
from .metrics import Metrics
from .protocol import APIError, Limits, parse_chat, parse_completion
from .stops import StopScanner


class Runner:
    """One generation at a time, in arrival order; each runs in its own thread and reports through callbacks."""

    def __init__(self, engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._order = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def run(self, req, on_piece, stop: threading.Event) -> dict:
        """Blocking: generate ``req``, calling ``on_piece(text)`` as text arrives; returns the result summary."""
        with self._order:
            ticket = self._next_ticket
            self._next_ticket += 1
            with self.metrics.lock:
                self.metrics.waiting += 1
            while ticket != self._serving:
                self._order.wait()
        with self.metrics.lock:
            self.metrics.waiting -= 1
            self.metrics.running += 1
        try:
            return self._generate(req, on_piece, stop)
        finally:
            with self.metrics.lock:
                self.metrics.running -= 1
            with self._order:
                self._serving += 1
                self._order.notify_all()
            req.cleanup()

    def _generate(self, req, on_piece, stop: threading.Event) -> dict:
        t0 = time.perf_counter()
        inputs = req.inputs
        tok = getattr(self.engine, "tokenizer", None)
        if not req.chat and tok is not None:  # a completion continues the raw prompt: no chat template
            inputs = tok(inputs, return_tensors="pt").input_ids
        try:
            s = self.engine.stream(inputs, spec=req.spec, stop=stop, **req.sampling())
        except ValueError as e:
            raise APIError(400, str(e)) from e
        scan = StopScanner(req.stop)
        first = None
        try:
            for piece in s:
                if first is None:
                    first = time.perf_counter()
                out = scan.feed(piece)
                if out:
                    on_piece(out)
                if scan.hit:
                    s.stop()
        except ValueError as e:  # bad input found while preparing it (unreadable media, too long, ...)
            raise APIError(400, str(e)) from e
        tail = scan.flush()
        if tail:
            on_piece(tail)
        stats = dict(s.stats)
        n_new = int(stats.get("new_tokens", 0))
        prompt = stats.get("prompt_tokens", {})
        kv = stats.get("cache_bytes_used") or {}
        end = time.perf_counter()
        with self.metrics.lock:
            self.metrics.prompt_tokens += sum(prompt.values())
            self.metrics.generation_tokens += n_new
            self.metrics.kv_bytes_used = sum(kv.values())
            if first is not None:
                self.metrics.ttft.observe(first - t0)
            if n_new > 1 and first is not None:
                self.metrics.tpot.observe((end - first) / (n_new - 1))
        reason = "stop" if scan.hit or n_new < req.max_tokens else "length"
        return {"text": scan.text, "finish_reason": reason,
                "usage": {"prompt_tokens": sum(prompt.values()), "completion_tokens": n_new,
                          "total_tokens": sum(prompt.values()) + n_new,
                          "mmkv": {"spec": req.spec, "kv_cache_bytes": sum(kv.values()),
                                   "effective_bits": stats.get("effective_bits", {}),
                                   "prompt_tokens_by_modality": prompt}}}


def _runner(engine, metrics: Metrics, kv_budget_bytes, scheduler, prefill_chunk):
    from ..engine import Engine

    if scheduler is None and isinstance(engine, Engine):
        from ..batching import Scheduler

        scheduler = Scheduler(engine, kv_budget_bytes, prefill_chunk=prefill_chunk)
        scheduler.start()
    if scheduler is None:
        return None, Runner(engine, metrics)
    from .batched import BatchRunner

    return scheduler, BatchRunner(scheduler, engine, metrics)


def create_app(engine, model_name: str, default_spec: str = "fp16", limits: Limits | None = None,
               kv_budget_bytes: int | None = None, scheduler=None, prefill_chunk=DEFAULT_CHUNK) -> FastAPI:
    """``scheduler``: one the caller made and starts (tests), else one made here (``prefill_chunk``: its pieces)."""
    limits, metrics = limits or Limits(), Metrics()
    scheduler, runner = _runner(engine, metrics, kv_budget_bytes, scheduler, prefill_chunk)
    app = FastAPI(title="mmkv", description="OpenAI-compatible API over mmkv's quantized KV cache")
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        metrics.request(request.url.path, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    async def _body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from e
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if body.get("model") not in (None, model_name):
            raise APIError(404, f"model {body.get('model')!r} is not served here; this server runs {model_name!r}",
                           "model", "model_not_found")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(model_name), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "mmkv"}]}

    async def _serve(req, endpoint: str):
        rid = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if req.chat else "text_completion"
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        if not req.stream:
            try:
                res = await asyncio.to_thread(runner.run, req, lambda _: None, stop)
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 - an OpenAI-style 500, and the server keeps serving
                raise APIError(500, f"generation failed: {e!r}", kind="server_error") from e
            metrics.request(endpoint, 200)
            choice = ({"index": 0, "message": {"role": "assistant", "content": res["text"]},
                       "finish_reason": res["finish_reason"]} if req.chat else
                      {"index": 0, "text": res["text"], "finish_reason": res["finish_reason"], "logprobs": None})
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice],
                    "usage": res["usage"]}

        queue: asyncio.Queue = asyncio.Queue()

        def piece(text):
            loop.call_soon_threadsafe(queue.put_nowait, ("piece", text))

        def work():
            try:
                res = runner.run(req, piece, stop)
                loop.call_soon_threadsafe(queue.put_nowait, ("done", res))
            except APIError as e:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))
            except Exception as e:  # noqa: BLE001 - reported to the client as a server error
                loop.call_soon_threadsafe(queue.put_nowait, ("error", APIError(500, f"generation failed: {e!r}",
                                                                               kind="server_error")))

        threading.Thread(target=work, daemon=True).start()
        obj_chunk = "chat.completion.chunk" if req.chat else "text_completion"

        def chunk(text, reason=None, usage=None, role=False):
            if req.chat:
                d = {"role": "assistant"} if role else {"content": text} if text else {}
                delta = {"index": 0, "delta": d, "finish_reason": reason}
            else:
                delta = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            body = {"id": rid, "object": obj_chunk, "created": int(time.time()), "model": model_name,
                    "choices": [delta]}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            status = 200
            try:
                if req.chat:
                    yield chunk("", role=True)
                while True:
                    kind, x = await queue.get()
                    if kind == "piece":
                        yield chunk(x)
                    elif kind == "done":
                        yield chunk("", x["finish_reason"], x["usage"])
                        break
                    else:
                        status = x.status
                        yield f"data: {json.dumps(x.body())}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:
                stop.set()  # a client that went away stops its generation at the next token
                metrics.request(endpoint, status)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _serve(parse_chat(await _body(request), default_spec, limits), request.url.path)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(parse_completion(await _body(request), default_spec, limits), request.url.path)

    app.state.metrics, app.state.scheduler = metrics, scheduler
    return app
