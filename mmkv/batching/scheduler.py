"""A continuous-batching scheduler over one ``Engine``: requests join and leave a running batch at any step.

Each step (``Scheduler.step``, run by a background thread or driven directly):

1. admit waiting requests in arrival order while the most bytes their caches will hold on the way to prompt +
   ``max_tokens`` (``KVBytes.peak``, exact) fit beside what the admitted ones will hold after this step and beside
   every byte the tensors hold (budget.py); the first that does not fit stops admission (fair first-come order);
2. finished and cancelled requests leave at once (``keep_rows``; a request still prefilling drops its cache);
3. if the admitted requests, or the tensors with the growth of this step's decode steps, would outgrow the budget,
   spare rows are dropped, then the newest request is preempted: its rows (or its partial prefill) are dropped and
   it waits again, first in line, to be recomputed from its prompt and the tokens it already has; nothing is
   admitted until some request finishes (no thrashing). Checked again after the prefills and joins;
4. prefill: pieces of the prefilling requests' prompts, oldest first, about ``prefill_chunk`` tokens in all per
   step (chunks.py: a piece is never cut inside a visual span); a request whose prefill is done picks its first
   token and its rows join the running batch of its spec (``cache.rows.merge_rows``);
5. one decode step per spec batch over all its rows; each row picks its token with its own sampling settings and
   seeded generator, so a request gets the tokens it would get alone (with its prompt prefilled in the same pieces).

So a long prompt delays the running batch by one chunk per step, not by its whole prefill. ``log`` keeps the last
steps' work in order (``("prefill", seq, start, end)`` and ``("decode", seqs)`` per step) and ``prefill_chunks``
and ``prefill_tokens`` count the pieces.

CUDA-graph decode steps (``DecodeStepper``) are captured per batch size, rounded up to a power of two
(``bucket``): a batch of 5 requests decodes as 8 rows, the spare rows decoding a pad token whose outputs are dropped.
Rows are slots (``Batch.slots``, ``cache/slots.py``): a request that leaves turns its row into a spare in place, and
a request that joins is written into a spare row in place when its segments fit the batch's capacities; neither
moves a tensor, so the batch's graph keeps replaying. Only a join with no spare row (or one that does not fit: a
longer row, a new visual segment) merges rows as before (``merge_rows``: new tensors, a new graph at the next bucket),
and a batch shrinks to a smaller bucket only once fewer than half its rows hold requests, so a load that hovers
around a bucket's edge does not capture again and again. Spare and pad rows hold memory the budget counts: a batch is
padded only when its bucket fits, and a join merges only when its rows fit. Graphs need CUDA; on CPU steps run
eagerly and no spare rows are kept unless ``buckets=True`` (the tests exercise the slots that way). Caches with per-row state beside their
segments (sliding-window layers, AQUA-KV) keep merging and compacting, with spare rows copies of the first row.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from ..cache.rows import keep_rows, merge_rows
from ..cache.slots import clear_rows, misfit, spare_rows_used, write_row
from ..engine import _eos_ids
from ..graphs import DecodeStepper
from ..models.inputs import prepare_inputs
from ..models.mrope import step_positions
from ..sampling import choose, validate
from ..spec import CacheSpec
from .batch import Batch, bucket
from .budget import Budget
from .chunks import DEFAULT_CHUNK, Prefill, check_chunk
from .held import held
from .job import Job
from .kvbytes import KVBytes


class Scheduler(Budget):
    def __init__(self, engine, kv_budget_bytes: int | None = None, graphs: bool | None = None,
                 buckets: bool | None = None, prefill_chunk: int | None = DEFAULT_CHUNK):
        """``buckets``: pad decode batches to a power of two (default: exactly when steps replay CUDA graphs).
        ``prefill_chunk``: prompt tokens prefilled per step (None: each prompt in one step)."""
        self.engine = engine
        self.chunk = check_chunk(prefill_chunk)
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
        self.batches: dict[str, Batch] = {}
        self.prefilling: list[Prefill] = []
        self._kv: dict[str, KVBytes] = {}
        self._hold = False  # after a preemption nothing is admitted until a request finishes
        self.max_batch = 0  # the most requests one decode step has carried
        self.max_rows = 0  # ... and the most rows, spare rows included
        self.steps = 0
        self.prefill_chunks = self.prefill_tokens = 0
        # how decode batches changed shape: joins into a spare row / by a merge, leaves that freed a row in place,
        # new shapes (a new bucket, a merge or a compaction: each needs a new graph); steppers' counts are added
        # here when a batch drops its stepper
        self.slot_counts = dict.fromkeys(("joins_in_place", "joins_merged", "leaves_in_place", "reshapes"), 0)
        self._retired = dict.fromkeys(("graph_captures", "graph_replays", "eager_steps"), 0)
        self.log: deque = deque(maxlen=4096)  # (step, kind, ...) of the latest work, in order
        self._thread: threading.Thread | None = None
        self._closed = False
        self._gauges = {"running": 0, "prefilling": 0, "used": 0, "held": 0, "spare": 0, "batches": {}}

    # --- submitting -------------------------------------------------------------------------------------------
    def kv_bytes(self, spec: CacheSpec) -> KVBytes:
        key = str(spec)
        if key not in self._kv:
            with self._device:  # its probe flushes a block in every layer on the device
                if key not in self._kv:
                    self._kv[key] = KVBytes(self.engine, spec)
        return self._kv[key]

    def submit(self, inputs, spec=None, max_new_tokens: int = 128, do_sample: bool = False, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None, stop: threading.Event | None = None,
               video_frames: int | None = None, video_fps: float | None = None) -> Job:
        """Queue a request (one prompt or chat); ValueError for bad input or a request the budget can never hold."""
        validate(max_new_tokens, temperature, top_p)
        spec = CacheSpec.parse(spec)
        eng = self.engine
        # on the CPU: the loop moves it to the device (chunks.Prefill), see _device
        prep = prepare_inputs(eng.adapter, inputs, eng.processor, video_frames=video_frames, video_fps=video_fps)
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

    def close(self, timeout: float | None = 30.0, error: Exception | None = None) -> None:
        """Stop the loop after the step in progress. Requests still queued or running are left as they are, or,
        with ``error``, end with it (their readers get it; a replaced model's app does this)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if error is not None:
            with self._cond:
                left, self.waiting = self.waiting + self.active(), []
            for job in left:
                if job.finish_reason is None:
                    self._finish(job, None, error)
            self.batches.clear()
            self.prefilling.clear()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self.waiting and not self.active():
                    self._cond.wait()
                if self._closed:
                    return
            with self._device:
                self.step()

    def drain(self, max_steps: int) -> None:
        """Step in this thread until nothing waits or runs (without the loop: tests, tools); RuntimeError after
        ``max_steps``."""
        for _ in range(max_steps):
            if not self.waiting and not self.active():
                return
            self.step()
        if self.waiting or self.active():
            raise RuntimeError(f"the scheduler still had requests after {max_steps} steps")

    def running(self) -> list[Job]:
        """The requests in a decode batch."""
        return [j for b in self.batches.values() for j in b.jobs]

    def active(self) -> list[Job]:
        """Admitted requests: decoding, or still prefilling."""
        return self.running() + [p.job for p in self.prefilling]

    def gauges(self) -> dict:
        """Requests running (decoding or prefilling, ``prefilling`` of them still prefilling) and waiting, the
        requests of each spec's decode batch, KV bytes: ``used`` by the requests' tokens, ``held`` by every cache
        tensor (what the budget counts), ``spare`` of those by spare and pad rows; the budget, prefill pieces so
        far (safe from any thread: the loop publishes a snapshot after each step)."""
        with self._cond:
            return {**self._gauges, "waiting": len(self.waiting), "budget": self.budget, "max_batch": self.max_batch}

    def graph_stats(self) -> dict:
        """Decode graphs captured and replayed and eager decode steps, over every batch so far, with the slot
        counts (joins in place and by merge, leaves in place, reshapes)."""
        out = dict(self._retired)
        for b in self.batches.values():
            for k, v in b.stepper.stats().items():
                out[k] += v
        return {**out, **self.slot_counts}

    def _publish(self) -> None:
        run = self.running()
        used = sum(j.bytes_at(max(len(j.tokens) - 1, 0)) for j in run)
        used += sum(p.job.kv.total(*p.fed()) for p in self.prefilling)
        graphs = self.graph_stats()
        spare = sum(b.spare_bytes for b in self.batches.values())
        with self._cond:
            self._gauges = {"running": len(run) + len(self.prefilling), "prefilling": len(self.prefilling),
                            "used": used, "held": self.held_bytes(), "spare": spare,
                            "batches": {k: len(b.jobs) for k, b in self.batches.items()},
                            "prefill_chunks": self.prefill_chunks, "prefill_tokens": self.prefill_tokens,
                            "graphs": graphs}

    def step(self) -> None:
        """One scheduling step: admit, drop leavers, preempt if needed, prefill a chunk, decode every batch once."""
        try:
            self._admit()
            self._leave()
            self._preempt()
            self._prefill()
            for b in list(self.batches.values()):
                self._ready(b)
            self._preempt()  # with the joins of this step and the growth its decode steps will make
            for key in list(self.batches):
                self._decode(self.batches[key])
            self._leave()
        except Exception as e:  # noqa: BLE001 - every request in flight gets the error; the loop goes on
            for job in self.active():
                self._finish(job, None, e)
            self.batches.clear()
            self.prefilling.clear()
        self.steps += 1
        self._publish()

    def _next_bytes(self) -> int:
        """Bytes the admitted requests hold after this step (a prefilling one: once its prefill is done)."""
        return sum(j.bytes_at(len(j.tokens)) for j in self.active())

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
                if self.budget is not None and self.active() and not self._room_for(job):
                    return
                self.waiting.remove(job)
            try:
                self.prefilling.append(Prefill(self.engine, job, self.chunk))
            except Exception as e:  # noqa: BLE001 - bad input found late (its positions): it alone fails
                self._finish(job, None, e)

    def _prefill(self) -> None:
        """Pieces of the prefilling requests, oldest first, while the step's prefill tokens stay within the chunk
        (the first piece always runs); finished prefills join their batches."""
        spent = 0
        for pf in sorted(self.prefilling, key=lambda p: p.job.seq):
            while not pf.finished and (self.chunk is None or spent == 0 or spent + pf.next_size() <= self.chunk):
                try:
                    a, b = self._feed(pf)
                except Exception as e:  # noqa: BLE001 - its prefill failed (out of memory, bad media): it alone fails
                    self.prefilling.remove(pf)
                    self._finish(pf.job, None, e)
                    break
                spent += b - a
            if pf.finished:
                self.prefilling.remove(pf)
                try:
                    self._join(pf)
                except Exception as e:  # noqa: BLE001 - its rows could not join (out of memory): it alone fails
                    self._finish(pf.job, None, e)
            if self.chunk is not None and spent >= self.chunk:
                return

    def _feed(self, pf: Prefill) -> tuple[int, int]:
        a, b = pf.feed()
        pf.held = held(pf.cache).total
        self.prefill_chunks += 1
        self.prefill_tokens += b - a
        self.log.append((self.steps, "prefill", pf.job.seq, a, b))
        return a, b

    def _join(self, pf: Prefill) -> None:
        """The request picks its next token from its prefill's logits and its row joins its spec's batch."""
        job = pf.job
        job.next_pos = pf.next_position()
        if self._pick(job, pf.logits):
            return
        key = str(job.spec)
        b = self.batches.get(key)
        if b is None:
            stepper = DecodeStepper(self.engine.model, pf.cache, graphs=self.graphs)
            self.batches[key] = Batch(pf.cache, job, stepper, stepper.enabled if self.buckets is None else self.buckets)
            return
        free = next((i for i, j in enumerate(b.slots) if j is None), None)
        if free is not None and b.in_place and misfit(b.cache, pf.cache) is None:
            write_row(b.cache, free, pf.cache)  # the graph stays: no tensor of the batch moves
            b.slots[free] = job
            b.refresh(tensors=False)
            self.slot_counts["joins_in_place"] += 1
            return
        if not self._merge_fits(b, pf.cache):
            self._requeue(job)  # its rows at the batch's capacities do not fit: it waits, recomputed later
            return
        self._compact(b)
        merge_rows(b.cache, pf.cache)
        b.slots.append(job)
        self.slot_counts["joins_merged"] += 1
        b.refresh()
        # spare rows at once: requests that join later in this step take them in place instead of merging again
        if not self._shape(b):
            self._new_stepper(b)

    def _new_stepper(self, b: Batch) -> None:
        """The batch's tensors moved: its graph (if any) reads freed memory, so a new stepper captures again."""
        for k, v in b.stepper.stats().items():
            self._retired[k] += v
        b.stepper = DecodeStepper(self.engine.model, b.cache, graphs=self.graphs)
        b.refresh()

    def _compact(self, b: Batch) -> None:
        """Drop the spare rows (new tensors: the caller makes a new stepper)."""
        if b.spare:
            keep_rows(b.cache, [i for i, j in enumerate(b.slots) if j is not None])
            b.slots = b.jobs

    def _pick(self, job: Job, logits: torch.Tensor, tok: int | None = None) -> bool:
        """Choose the job's next token from its logits ``[1, V]`` (or take ``tok``, chosen already); True when the
        job is finished."""
        if tok is None:
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
        for pf in list(self.prefilling):
            if pf.job.cancel_event.is_set():
                self.prefilling.remove(pf)
                self._finish(pf.job, "cancelled")
        for key, b in list(self.batches.items()):
            for job in b.jobs:
                if job.finish_reason is None and job.cancel_event.is_set():
                    self._finish(job, "cancelled")
            gone = [i for i, j in enumerate(b.slots) if j is not None and j.finish_reason is not None]
            if gone:
                self._vacate(key, b, gone)

    def _vacate(self, key: str, b: Batch, rows: list[int], compact: bool = False) -> None:
        """Rows ``rows`` of the batch lose their requests: spare rows in place, or (``compact``: their memory must
        go) compacted away."""
        for i in rows:
            b.slots[i] = None
        if not b.jobs:
            for k, v in b.stepper.stats().items():
                self._retired[k] += v
            del self.batches[key]
        elif b.in_place and not compact:
            clear_rows(b.cache, rows)
            b.refresh(tensors=False)
            self.slot_counts["leaves_in_place"] += len(rows)
        else:
            self._compact(b)
            self._new_stepper(b)

    def _shape(self, b: Batch) -> bool:
        """Bring a bucketed batch to ``bucket(requests)`` rows where it is not: after a merge (more requests than
        rows of the old bucket), or once fewer than half its rows hold requests (hysteresis: a batch between 5 and
        8 requests keeps 8 rows, one that drops to 4 of 16 goes to 4). Pad rows hold memory: where the budget
        cannot hold the bucket's, the batch runs at exactly its requests' rows (a graph of that size) and is padded
        once the bucket fits. True when it gave the batch a new shape."""
        n, rows = len(b.jobs), len(b.slots)
        want = bucket(n)
        if not b.bucketed or rows == want or (rows > want and 2 * n >= rows):
            return False
        if want > n and not self._fits(b, want):
            want = n
            if rows == n:
                return False
        self._compact(b)
        if want > n:  # spare rows: copies of the first, emptied where rows are reused in place
            keep_rows(b.cache, list(range(n)) + [0] * (want - n), repeat=True)
            b.slots += [None] * (want - n)
            if b.in_place:
                clear_rows(b.cache, list(range(n, want)))
        self._new_stepper(b)
        self.slot_counts["reshapes"] += 1
        return True

    def _ready(self, b: Batch) -> None:
        """Before this step's decode (and the budget's look at it): the batch at its shape, and spare rows that
        decoded pad tokens emptied before a step that may flush (a spare must not flush pad tokens into the text
        segment: its growth would move tensors; emptied, it holds one token after the step)."""
        self._shape(b)
        if b.in_place and b.spare and b.free < 1:
            spares = [i for i, j in enumerate(b.slots) if j is None]
            if spare_rows_used(b.cache, spares):
                clear_rows(b.cache, spares)
                b.refresh(tensors=False)

    def _decode(self, b: Batch) -> None:
        eng = self.engine
        self._ready(b)
        slots = b.slots
        live = [i for i, j in enumerate(slots) if j is not None]
        n = len(live)
        dev = eng.device
        ids = torch.tensor([[j.tokens[-1] if j is not None else self.pad] for j in slots], device=dev)
        pos = torch.tensor([[j.next_pos if j is not None else 0] for j in slots], device=dev)
        first = slots[live[0]]
        if first.delta is not None:
            zero = first.delta.reshape(1) * 0
            delta = torch.cat([j.delta.reshape(1) if j is not None else zero for j in slots])
            pos = step_positions(pos, delta.to(dev))
        with torch.inference_mode():
            logits = b.stepper(ids, pos)
        if b.free >= 1:  # a step that grows or flushes nothing: no tensor changed
            b.free -= 1
        else:
            b.refresh()
        self.max_batch = max(self.max_batch, n)
        self.max_rows = max(self.max_rows, len(slots))
        self.log.append((self.steps, "decode", tuple(slots[i].seq for i in live)))
        # greedy rows: one argmax, one copy to the host (a pick per row was a launch and a sync each, 64 a step)
        greedy = [i for i in live if not slots[i].do_sample or slots[i].temperature <= 0]
        picked = {}
        if greedy:
            rows = logits if len(greedy) == len(slots) else logits[torch.tensor(greedy, device=logits.device)]
            picked = dict(zip(greedy, rows.argmax(-1).tolist()))
        for i in live:
            job = slots[i]
            job.max_batch = max(job.max_batch, n)
            job.next_pos += 1
            self._pick(job, logits[i : i + 1], picked.get(i))
