"""A continuous-batching scheduler over one ``Engine``: requests join and leave a running batch at any step.

Each step (``Scheduler.step``, run by a background thread or driven directly):

1. admit waiting requests in arrival order while the exact bytes their caches will hold at the end (prompt +
   ``max_tokens``, ``KVBytes``) fit beside what the running ones will hold after this step; the first that does
   not fit stops admission (no overtaking: fair first-come order). Each admitted request is prefilled alone,
   picks its first token, and its rows join the running batch of its spec (``cache.rows.merge_rows``);
2. finished and cancelled requests leave at once (``keep_rows``);
3. if the running requests would outgrow the budget with this step, the newest is preempted: its rows are
   dropped and it waits again, first in line by its arrival, to be recomputed from its prompt and the tokens it
   already has; nothing is admitted until some request finishes (no thrashing);
4. one decode step per spec batch over all its rows; each row picks its token with its own sampling settings and
   seeded generator, so a request gets the tokens it would get alone.

CUDA-graph decode steps (``DecodeStepper``) are captured per batch size, rounded up to a power of two
(``bucket``): a batch of 5 rows decodes as 8, the spare rows copies of the first row that decode a pad token and are dropped, so a
batch that changes between 5 and 8 rows replays one graph shape. Graphs need CUDA; on CPU steps run eagerly and
no spare rows are added.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from ..cache import MMKVCache
from ..cache.rows import keep_rows, merge_rows
from ..engine import _eos_ids, first_positions, prefill
from ..graphs import DecodeStepper
from ..models.inputs import prepare_inputs
from ..models.mrope import step_positions
from ..sampling import choose, validate
from ..spec import CacheSpec
from .kvbytes import KVBytes


def bucket(n: int) -> int:
    """The batch size a graphed decode step runs at: ``n`` rounded up to a power of two."""
    if n < 1:
        raise ValueError(f"a batch has at least one row, got {n}")
    return 1 << (n - 1).bit_length()


class Job:
    """One request in the scheduler. ``pieces(tokenizer)`` streams its text; ``cancel()`` makes it leave."""

    def __init__(self, seq: int, prep, spec: CacheSpec, kv: KVBytes, max_tokens: int, do_sample: bool,
                 temperature: float, top_p: float, seed: int | None, cancel: threading.Event | None):
        self.seq, self.prep, self.spec, self.kv = seq, prep, spec, kv
        self.max_tokens, self.do_sample, self.temperature, self.top_p = max_tokens, do_sample, temperature, top_p
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.cancel_event = cancel or threading.Event()
        mask = prep.attention_mask.bool()
        self.n_visual = int((prep.visual_mask & mask).sum())
        self.n_text = int((~prep.visual_mask & mask).sum())
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.next_pos = 0
        self.delta = None
        self.t_submit, self.t_first, self.t_end = time.perf_counter(), None, None

    def cancel(self) -> None:
        self.cancel_event.set()

    def bytes_at(self, fed: int) -> int:
        """KV bytes once ``fed`` generated tokens have been fed back into the cache."""
        return self.kv.total(self.n_visual, self.n_text + fed)

    @property
    def need(self) -> int:
        """Bytes at the end: every generated token but the last is fed back."""
        return self.bytes_at(self.max_tokens - 1)

    def pieces(self, tokenizer):
        """Text pieces as tokens arrive (as ``Stream`` yields them); raises what failed the request."""
        shown = ""
        while True:
            kind, x = self.events.get()
            if kind == "error":
                raise x
            if kind == "done":
                return
            text = tokenizer.decode(self.tokens[: x], skip_special_tokens=True)
            if len(text) > len(shown) and not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text

    def usage(self) -> dict:
        fed = max(len(self.tokens) - 1, 0)
        return {"prompt_tokens": {"visual": self.n_visual, "text": self.n_text},
                "new_tokens": len(self.tokens), "finish_reason": self.finish_reason,
                "cache_bytes_used": self.kv.by_modality(self.n_visual, self.n_text + fed),
                "effective_bits": self.kv.effective_bits(self.n_visual, self.n_text + fed),
                "preemptions": self.preemptions}


class _Batch:
    """The running rows of one spec: one cache, its requests in row order, and a decode stepper per shape."""

    def __init__(self):
        self.cache: MMKVCache | None = None
        self.jobs: list[Job] = []
        self.stepper: DecodeStepper | None = None
        self.spare = 0  # empty rows after the requests' rows (graph buckets)


class Scheduler:
    def __init__(self, engine, kv_budget_bytes: int | None = None, graphs: bool | None = None,
                 buckets: bool | None = None):
        """``buckets``: pad decode batches to a power of two (default: exactly when steps replay CUDA graphs)."""
        self.engine = engine
        self.buckets = buckets
        self.budget = kv_budget_bytes
        self.graphs = engine.graphs if graphs is None else graphs
        self.tokenizer = engine.tokenizer
        self.eos = _eos_ids(engine.model, engine.tokenizer)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(iter(self.eos), 0)
        self._cond = threading.Condition()
        # The device belongs to the loop's thread while it steps: a CUDA call from a request's thread during a
        # graph capture invalidates the capture (and fails that request), so such calls take this lock.
        self._device = threading.Lock()
        self._seq = 0
        self.waiting: list[Job] = []
        self.batches: dict[str, _Batch] = {}
        self._kv: dict[str, KVBytes] = {}
        self._hold = False  # after a preemption nothing is admitted until a request finishes
        self.max_batch = 0  # the most requests one decode step has carried
        self.max_rows = 0  # ... and the most rows, spare rows included
        self.steps = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._gauges = {"running": 0, "used": 0}

    # --- submitting -------------------------------------------------------------------------------------------
    def kv_bytes(self, spec: CacheSpec) -> KVBytes:
        key = str(spec)
        if key not in self._kv:
            with self._device:  # its probe flushes a block in every layer on the device
                if key not in self._kv:
                    self._kv[key] = KVBytes(self.engine, spec)
        return self._kv[key]

    def submit(self, inputs, spec=None, max_new_tokens: int = 128, do_sample: bool = False, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None, stop: threading.Event | None = None) -> Job:
        """Queue a request (one prompt or chat); ValueError for bad input or a request the budget can never hold."""
        validate(max_new_tokens, temperature, top_p)
        spec = CacheSpec.parse(spec)
        eng = self.engine
        prep = prepare_inputs(eng.adapter, inputs, eng.processor)  # on the CPU: moved by the loop in _start
        if prep.input_ids.shape[0] != 1:
            raise ValueError(f"a request is one prompt; got a batch of {prep.input_ids.shape[0]}")
        kv = self.kv_bytes(spec)  # not under _cond: the loop holds _device while it publishes under _cond
        with self._cond:
            job = Job(self._seq, prep, spec, kv, max_new_tokens, do_sample, temperature, top_p, seed, stop)
            if self.budget is not None and job.need > self.budget:
                raise ValueError(f"the request's KV cache would hold {job.need} bytes at {job.n_visual} visual + "
                                 f"{job.n_text} text prompt tokens and max_tokens={max_new_tokens}; the server's "
                                 f"budget is {self.budget} bytes: shorten the prompt or lower max_tokens")
            self._seq += 1
            self.waiting.append(job)
            self._cond.notify_all()
        return job

    # --- the loop ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mmkv-scheduler", daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after the step in progress (requests still queued are left as they are)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self.waiting and not self.running():
                    self._cond.wait()
                if self._closed:
                    return
            with self._device:
                self.step()

    def running(self) -> list[Job]:
        return [j for b in self.batches.values() for j in b.jobs]

    def gauges(self) -> dict:
        """Running and waiting requests, exact KV bytes in use and the budget (safe from any thread: the loop
        publishes a snapshot after each step)."""
        with self._cond:
            return {**self._gauges, "waiting": len(self.waiting), "budget": self.budget, "max_batch": self.max_batch}

    def _publish(self) -> None:
        run = self.running()
        used = sum(j.bytes_at(max(len(j.tokens) - 1, 0)) for j in run)
        with self._cond:
            self._gauges = {"running": len(run), "used": used}

    def step(self) -> None:
        """One scheduling step: admit, drop leavers, preempt if needed, decode every running batch once."""
        try:
            self._admit()
            self._leave()
            self._preempt()
            for key in list(self.batches):
                self._decode(self.batches[key])
            self._leave()
        except Exception as e:  # noqa: BLE001 - every request in flight gets the error; the loop goes on
            for job in self.running():
                self._finish(job, None, e)
            self.batches.clear()
        self.steps += 1
        self._publish()

    def _next_bytes(self) -> int:
        return sum(j.bytes_at(len(j.tokens)) for j in self.running())

    def _admit(self) -> None:
        while not self._hold:
            with self._cond:
                if not self.waiting:
                    return
                job = min(self.waiting, key=lambda j: j.seq)
                if job.cancel_event.is_set():
                    self.waiting.remove(job)
                    self._finish(job, "cancelled")
                    continue
                if self.budget is not None and self.running() and self._next_bytes() + job.need > self.budget:
                    return
                self.waiting.remove(job)
            try:
                self._start(job)
            except Exception as e:  # noqa: BLE001 - its prefill failed (out of memory, bad media): it alone fails
                self._finish(job, None, e)

    def _start(self, job: Job) -> None:
        """Prefill the request alone (its prompt, plus its tokens so far after a preemption) and let its row join."""
        eng = self.engine
        p = job.prep.to(eng.device)
        ids, visual, kwargs = p.input_ids, p.visual_mask, dict(p.model_kwargs)
        if job.tokens:  # recompute: everything it had fed, plus its last token, whose logits give the next one
            extra = torch.tensor([job.tokens], dtype=ids.dtype, device=ids.device)
            ids = torch.cat([ids, extra], 1)
            visual = torch.cat([visual, torch.zeros_like(extra, dtype=torch.bool)], 1)
        mask = torch.ones_like(ids)
        positions, delta = first_positions(eng, ids, mask, kwargs)
        cache = MMKVCache.for_model(job.spec, eng.adapter)
        logits = prefill(eng, cache, ids, mask, mask, visual, positions, kwargs)
        job.next_pos = int((positions if delta is None else positions[0])[0, -1]) + 1
        job.delta = delta
        if self._pick(job, logits):
            return
        b = self.batches.setdefault(str(job.spec), _Batch())
        if b.cache is None:
            b.cache = cache
        else:
            self._trim_spare(b)
            merge_rows(b.cache, cache)
        b.jobs.append(job)
        b.stepper = None

    def _pick(self, job: Job, logits: torch.Tensor) -> bool:
        """Choose the job's next token from its logits ``[1, V]``; True when the job is finished."""
        tok = int(choose(logits, job.do_sample, job.temperature, job.top_p, job.generator)[0])
        job.tokens.append(tok)
        if job.t_first is None:
            job.t_first = time.perf_counter()
        job.events.put(("token", len(job.tokens)))
        if tok in self.eos:
            self._finish(job, "stop")
        elif len(job.tokens) >= job.max_tokens:
            self._finish(job, "length")
        elif job.cancel_event.is_set():
            self._finish(job, "cancelled")
        return job.finish_reason is not None

    def _finish(self, job: Job, reason: str | None, error: Exception | None = None) -> None:
        job.finish_reason = reason or "error"
        job.t_end = time.perf_counter()
        job.events.put(("error", error) if error is not None else ("done", None))
        with self._cond:
            self._hold = False
            self._cond.notify_all()

    def _leave(self) -> None:
        for key, b in list(self.batches.items()):
            for job in b.jobs:
                if job.finish_reason is None and job.cancel_event.is_set():
                    self._finish(job, "cancelled")
            keep = [i for i, j in enumerate(b.jobs) if j.finish_reason is None]
            if len(keep) == len(b.jobs):
                continue
            if not keep:
                del self.batches[key]
                continue
            keep_rows(b.cache, keep)
            b.jobs = [b.jobs[i] for i in keep]
            b.spare, b.stepper = 0, None

    def _preempt(self) -> None:
        if self.budget is None:
            return
        while len(self.running()) > 1 and self._next_bytes() > self.budget:
            job = max(self.running(), key=lambda j: j.seq)
            key = str(job.spec)
            b = self.batches[key]
            i = b.jobs.index(job)
            rest = [r for r in range(len(b.jobs)) if r != i]
            if rest:
                keep_rows(b.cache, rest)
                b.jobs.pop(i)
                b.spare, b.stepper = 0, None
            else:
                del self.batches[key]
            job.preemptions += 1
            with self._cond:
                self.waiting.append(job)
                self._hold = True

    def _trim_spare(self, b: _Batch) -> None:
        if b.spare:
            keep_rows(b.cache, list(range(len(b.jobs))))
            b.spare = 0

    def _decode(self, b: _Batch) -> None:
        eng = self.engine
        if b.stepper is None:
            b.stepper = DecodeStepper(eng.model, b.cache, graphs=self.graphs)
            if b.stepper.enabled if self.buckets is None else self.buckets:
                self._pad_to_bucket(b)
        n = len(b.jobs)
        dev = eng.device
        ids = torch.tensor([[j.tokens[-1]] for j in b.jobs] + [[self.pad]] * b.spare, device=dev)
        pos = torch.tensor([[j.next_pos] for j in b.jobs] + [[0]] * b.spare, device=dev)
        if b.jobs[0].delta is not None:
            delta = torch.cat([j.delta.reshape(1) for j in b.jobs] + [b.jobs[0].delta.reshape(1) * 0] * b.spare)
            pos = step_positions(pos, delta.to(dev))
        with torch.inference_mode():
            logits = b.stepper(ids, pos)
        self.max_batch = max(self.max_batch, n)
        self.max_rows = max(self.max_rows, n + b.spare)
        for i, job in enumerate(b.jobs):
            job.next_pos += 1
            self._pick(job, logits[i : i + 1])

    def _pad_to_bucket(self, b: _Batch) -> None:
        """Spare rows up to the bucket: copies of the first row, whose tokens are decoded and dropped."""
        want = bucket(len(b.jobs)) - len(b.jobs)
        if want:
            keep_rows(b.cache, list(range(len(b.jobs))) + [0] * want, repeat=True)
            b.spare = want
