"""A running decode batch of the scheduler (scheduler.py): one cache whose rows are slots, and its bucket size."""

from __future__ import annotations

from ..cache import MMKVCache
from ..cache.slots import unsupported
from ..graphs import DecodeStepper
from .held import Held, after_decode, held, steps_free
from .job import Job


def bucket(n: int) -> int:
    """The batch size a graphed decode step runs at: ``n`` rounded up to a power of two."""
    if n < 1:
        raise ValueError(f"a batch has at least one row, got {n}")
    return 1 << (n - 1).bit_length()


class Batch:
    """The running rows of one spec: one cache, the request of each of its rows (None: a spare row), and the decode
    stepper of its current shape. ``bucketed``: rows are kept at ``bucket(requests)``; ``in_place``: requests take
    and free rows without moving the cache's tensors (cache/slots.py).

    ``held``: what the cache's tensors hold (held.py), and ``free``: decode steps before one changes them. Both are
    refreshed on the events that change them (``refresh``), never walked per step: a step with ``free`` left only
    counts it down."""

    def __init__(self, cache: MMKVCache, job: Job, stepper: DecodeStepper, bucketed: bool):
        self.cache, self.slots, self.stepper = cache, [job], stepper
        self.bucketed = bucketed
        self.in_place = bucketed and unsupported(cache) is None
        self.templates = [layer.text for layer in job.kv.layers]  # each layer's text layout, for after_decode
        self.held: Held = held(cache)
        self.free = steps_free(cache)

    def refresh(self, tensors: bool = True) -> None:
        """After an event: the tensors changed (``held`` and ``free``) or only the rows' lengths (``free``)."""
        if tensors:
            self.held = held(self.cache)
        self.free = steps_free(self.cache)

    def next_held(self) -> Held:
        """What the cache will hold after its next decode step."""
        return self.held if self.free >= 1 else after_decode(self.cache, self.templates)

    @property
    def jobs(self) -> list[Job]:
        return [j for j in self.slots if j is not None]

    @property
    def spare(self) -> int:
        return sum(j is None for j in self.slots)

    @property
    def spare_bytes(self) -> int:
        return self.spare * self.held.per_row
