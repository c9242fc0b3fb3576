"""One request in the continuous-batching scheduler (scheduler.py): its prepared prompt, sampling settings, the
tokens it has, its exact KV-byte projection, and the events its reader streams."""

from __future__ import annotations

import queue
import threading
import time

import torch

from ..spec import CacheSpec
from .kvbytes import KVBytes


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
        self._need: int | None = None
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.next_pos = 0
        self.positions = self.delta = None  # the prompt's position ids (and M-RoPE delta), set by its first prefill
        self.max_batch = 0  # the most requests of a decode step this one took part in
        self.t_submit, self.t_first, self.t_end = time.perf_counter(), None, None

    def cancel(self) -> None:
        self.cancel_event.set()

    def bytes_at(self, fed: int) -> int:
        """KV bytes once ``fed`` generated tokens have been fed back into the cache."""
        return self.kv.total(self.n_visual, self.n_text + fed)

    @property
    def need(self) -> int:
        """The most bytes it will hold, up to the end (every generated token but the last is fed back)."""
        if self._need is None:
            self._need = self.kv.peak(self.n_visual, self.n_text, self.n_text + self.max_tokens - 1)
        return self._need

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
