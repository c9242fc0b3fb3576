"""The scheduler's budget (scheduler.py): the bytes every cache tensor holds, spare and pad rows included
(held.py), and the decisions made with them: admission, dropping spare rows, padding, preemption. docs/SERVE.md,
"What the budget counts"."""

from __future__ import annotations

from .batch import Batch
from .held import Held, after_merge
from .job import Job


class Budget:
    """The budget's part of ``Scheduler``: it reads the scheduler's ``budget``, ``batches``, ``prefilling``,
    ``waiting`` and ``slot_counts`` and uses its row operations (``_compact``, ``_new_stepper``, ``_vacate``)."""

    def held_bytes(self) -> int:
        """Bytes every cache tensor holds now: the batches' (every row at its capacities) and the prefills'."""
        return sum(b.held.total for b in self.batches.values()) + sum(p.held for p in self.prefilling)

    def _prefill_reserve(self) -> int:
        """Bytes the prefilling requests hold now or, more, once their prefills are done."""
        return sum(max(p.held, p.job.bytes_at(len(p.job.tokens))) for p in self.prefilling)

    def _projected(self) -> int:
        """Held bytes after this step: the batches after their decode steps grow what they will grow, the
        prefills at least done."""
        return sum(b.next_held().total for b in self.batches.values()) + self._prefill_reserve()

    def _fits(self, b: Batch, rows: int) -> bool:
        """Whether the budget holds ``b`` at ``rows`` rows (of its current per-row bytes) after this step."""
        if self.budget is None:
            return True
        nxt = b.next_held()
        return self._projected() - nxt.total + Held(nxt.fixed, nxt.per_row, rows).total <= self.budget

    def _merge_fits(self, b: Batch, cache) -> bool:
        """Whether the budget holds ``b`` with its spare rows dropped and the one-row ``cache`` merged in."""
        if self.budget is None:
            return True
        merged = after_merge(b.cache, cache, [i for i, j in enumerate(b.slots) if j is not None])
        return self.held_bytes() - b.held.total + merged.total <= self.budget

    def _drop_spares(self) -> bool:
        """Compact every batch that holds spare rows (their memory goes; each takes a new graph). True if any."""
        dropped = False
        for b in self.batches.values():
            if b.spare:
                self._compact(b)
                self._new_stepper(b)
                self.slot_counts["reshapes"] += 1
                dropped = True
        return dropped

    def _room_for(self, job: Job) -> bool:
        """Whether the budget holds the job's need beside the admitted requests' bytes after this step and beside
        every tensor held; spare rows go when dropping them is what makes room (a leaving request's row stays
        held in place, so waiting for one to leave would not)."""
        if self._next_bytes() + job.need > self.budget:
            return False
        held_now = sum(b.held.total for b in self.batches.values()) + self._prefill_reserve()
        if held_now + job.need <= self.budget:
            return True
        spare = sum(b.spare_bytes for b in self.batches.values())
        if spare and held_now - spare + job.need <= self.budget:
            self._drop_spares()
            return True
        return False

    def _preempt(self) -> None:
        """While the requests' bytes or the tensors' held bytes after this step would exceed the budget: drop
        spare rows first (no request loses work), then preempt the newest request, its rows compacted away."""
        if self.budget is None:
            return
        while True:
            over_held = self._projected() > self.budget
            if not over_held and self._next_bytes() <= self.budget:
                return
            if over_held and self._drop_spares():
                continue
            if len(self.active()) <= 1:
                return
            job = max(self.active(), key=lambda j: j.seq)
            pf = next((p for p in self.prefilling if p.job is job), None)
            if pf is not None:  # its partial cache goes; the recompute starts over
                self.prefilling.remove(pf)
            else:
                self._drop_row(job)
            self._requeue(job)

    def _requeue(self, job: Job) -> None:
        """The job waits again, first in line by its arrival; nothing is admitted until a request finishes."""
        job.preemptions += 1
        with self._cond:
            self.waiting.append(job)
            self._hold = True

    def _drop_row(self, job: Job) -> None:
        key = str(job.spec)
        b = self.batches[key]
        self._vacate(key, b, [b.slots.index(job)], compact=True)
