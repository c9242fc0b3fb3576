"""Continuous batching: requests join and leave one running batch per cache spec (scheduler.py), admitted by the
exact bytes their quantized caches will hold (kvbytes.py)."""

from .kvbytes import KVBytes
from .scheduler import Job, Scheduler

__all__ = ["Job", "KVBytes", "Scheduler"]
