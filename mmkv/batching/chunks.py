"""Chunked prefill: a request's cache is filled a piece per scheduler step, between decode steps of the batch.

Pieces of a prompt (``plan``): the first runs from the prompt's start through its last visual token (and at least
``chunk`` tokens, and through the end of the prompt when less than a chunk of text follows the last visual token),
the others are ``chunk`` text tokens each. The short tail joins the visual piece because a separate forward of a
few text tokens costs a whole scheduler step (one more pass over the weights, one more decode step of the batch
before the request can join it): on an H100 with InternVL2.5-8B shapes, image prompts of 3328 visual + 85 text
tokens split into two pieces served 28-50% fewer output tokens/s than unchunked ones (docs/BENCHMARKS.md). Visual spans are never split: CalibQuant calibrates
each span it receives as a whole (a split span would be quantized differently), and the vision tower's features
enter the model in the forward that holds their placeholder tokens. The second and later pieces are forwards over
the stored cache (the ``extend`` path of ``mmkv/attention.py``): they read the earlier pieces as stored, i.e. text
that has left the fp16 window and visual spans quantized, as decode steps read them. With an fp16 cache, or while
the prompt fits in the sinks and window, chunked and one-shot prefill are the same attention; otherwise the later
pieces see quantized keys where a one-shot prefill sees fp16 ones (``tests/test_chunked_prefill.py`` compares such
runs to the engine's own prefill-then-extend of the same pieces).

A preempted request is recomputed from its prompt (the same pieces, so the same cache) and then its generated
tokens, fed so that the cache ends exactly as its decode steps left it (``tail_piece``): a decode step that
makes a layer flush a block quantizes the block *before* the token attends, whereas a forward of several tokens
routes them after its attention. So tokens are fed in forwards that stop one token short of a flush, and the token
that flushes goes alone, through the decode path.
"""

from __future__ import annotations

import torch

from ..cache import MMKVCache
from ..engine import first_positions, prefill, without_media
from ..models.mrope import step_positions

DEFAULT_CHUNK = 512


def check_chunk(chunk: int | None) -> int | None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"prefill_chunk is a positive number of tokens (or None: the whole prompt at once), "
                         f"got {chunk!r}")
    return chunk


def plan(visual: torch.Tensor, chunk: int | None) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` pieces of a prompt whose visual-token mask is ``visual [T]``."""
    t = int(visual.shape[-1])
    if t == 0:
        raise ValueError("an empty prompt has nothing to prefill")
    if check_chunk(chunk) is None:
        return [(0, t)]
    first = chunk
    hits = visual.nonzero()
    if len(hits):
        first = max(first, int(hits[-1]) + 1)
        if t - first < chunk:  # a short text tail joins the (already unbounded) visual piece: see the module doc
            first = t
    bounds = [0, *range(min(first, t), t, chunk), t]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def tail_piece(cache: MMKVCache, left: int, chunk: int | None) -> int:
    """How many of ``left`` generated tokens the next forward feeds (1: alone, through the decode path)."""
    # feeding `room` more tokens one by one, the last of them would flush (a sliding layer never flushes)
    room = min((layer.spec.sinks + layer.spec.window + layer.text_method.flush_block - layer.dense_len[0]
                for layer in cache.layers if not layer.is_sliding and layer.dense is not None), default=None)
    n = left if room is None else 1 if room == 1 else min(left, room - 1)
    return n if chunk is None else min(n, chunk)


class Prefill:
    """The cache of one request being filled: its prompt's pieces, then (after a preemption) its tokens so far.
    ``feed()`` runs one forward; once ``finished``, ``logits`` pick the request's next token."""

    def __init__(self, engine, job, chunk: int | None):
        self.engine, self.job, self.chunk = engine, job, chunk
        p = job.prep.to(engine.device)  # submitted on the CPU (scheduler.Scheduler._device)
        self.ids, self.visual, self.kwargs = p.input_ids, p.visual_mask, dict(p.model_kwargs)
        if job.positions is None:  # the prompt's positions, once: a recompute numbers its tokens the same way
            job.positions, job.delta = first_positions(engine, self.ids, torch.ones_like(self.ids), self.kwargs)
        self.pieces = plan(self.visual[0], chunk)
        self.cache = MMKVCache.for_model(job.spec, engine.adapter)
        self.prompt_len = self.ids.shape[1]
        self.tokens = list(job.tokens)  # a recompute feeds them after the prompt (none on a first prefill)
        self.done = 0
        self.held = 0  # bytes its cache's tensors hold, as of its last piece (the scheduler's budget counts them)
        self.logits: torch.Tensor | None = None

    @property
    def total(self) -> int:
        return self.prompt_len + len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.done == self.total

    def next_size(self) -> int:
        if self.done < self.prompt_len:
            return next(b - a for a, b in self.pieces if a == self.done)
        return tail_piece(self.cache, self.total - self.done, self.chunk)

    def fed(self) -> tuple[int, int]:
        """(visual, text) tokens the cache holds now."""
        n_vis = int(self.visual[0, : min(self.done, self.prompt_len)].sum())
        return n_vis, self.done - n_vis

    def text_positions(self) -> torch.Tensor:
        pos = self.job.positions
        return pos if self.job.delta is None else pos[0]

    def next_position(self) -> int:
        """The 1-D position of the token after everything fed."""
        return int(self.text_positions()[0, -1]) + 1 + (self.done - self.prompt_len)

    def feed(self) -> tuple[int, int]:
        """One forward of the next piece; returns its ``(start, end)`` in the request's tokens."""
        a = self.done
        b = a + self.next_size()
        if a < self.prompt_len:
            ids, visual = self.ids[:, a:b], self.visual[:, a:b]
            pos = self.job.positions[..., a:b]
            kwargs = self.kwargs if a == 0 else without_media(self.kwargs)
            kwargs = {k: v[:, a:b] if k.endswith("token_type_ids") else v for k, v in kwargs.items()}
        else:
            ids = torch.tensor([self.tokens[a - self.prompt_len : b - self.prompt_len]], dtype=self.ids.dtype,
                               device=self.ids.device)
            visual = torch.zeros_like(ids, dtype=torch.bool)
            text = self.next_position() + torch.arange(b - a, device=ids.device)[None]
            pos = text if self.job.delta is None else step_positions(text, self.job.delta)
            kwargs = {k: torch.zeros_like(ids) if k.endswith("token_type_ids") else v
                      for k, v in without_media(self.kwargs).items()}
        mask = torch.ones_like(ids)
        full = torch.ones(1, b, dtype=mask.dtype, device=mask.device)  # the cache's tokens and the new ones
        self.logits = prefill(self.engine, self.cache, ids, mask, full, visual, pos, kwargs)
        self.done = b
        return a, b
