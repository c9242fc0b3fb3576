"""The RoPE position of every text token a cache holds, for text methods that store keys before RoPE (AQUA-KV).

transformers applies RoPE before ``Cache.update`` and passes the cache neither the positions nor cos/sin, so the
cache learns them from what the engine already gives it: the padding mask of each forward (``set_inputs``; none
means every new token is real). A token's position is the number of real tokens its row held before it, which is
exactly how the engine numbers them (``cumsum(mask) - 1`` for a prompt, ``next_position`` afterwards, a later
chat turn continues from there after a ``crop``). Visual tokens count, but only text tokens are recorded, so the
text tokens after an image span have the gap the model saw.

One ``int32`` per text token per row, in the order the row's text tokens arrived (the order every layer stores
them in: sinks, then the text segment, then the window), shared by all layers: the text segment of row ``r``
covers indices ``[sinks, sinks + text_len)``. Layer 0, which every forward visits first, records and crops; the
other layers only read. Counted in ``MMKVCache.nbytes``.
"""

from __future__ import annotations

import torch


class TextPositions:
    def __init__(self):
        self.pos: torch.Tensor | None = None  # [B, capacity] int32
        self.lens: list[int] = []
        self.next: list[int] = []  # per row: real tokens seen so far = position of the next token
        self.version = 0  # bumped on every change, so readers can reuse what they derived from one state

    def record(self, batch: int, t: int, valid: torch.Tensor | None, visual: torch.Tensor | None, device) -> None:
        """Positions of the ``t`` tokens a forward adds (``valid``/``visual``: ``[B, t]`` masks or None)."""
        self.version += 1
        if self.pos is None:
            self.pos = torch.zeros(batch, max(t, 64), dtype=torch.int32, device=device)
            self.lens, self.next = [0] * batch, [0] * batch
        if batch != self.pos.shape[0]:
            raise ValueError(f"positions recorded for {self.pos.shape[0]} rows, got a forward of {batch}")
        if t == 1 and valid is None and visual is None:  # a decode step: one real text token per row
            self._grow(max(self.lens) + 1)
            rows = torch.arange(batch, device=self.pos.device)
            at = torch.tensor(self.lens, device=self.pos.device)
            self.pos[rows, at] = torch.tensor(self.next, dtype=torch.int32, device=self.pos.device)
            self.lens = [n + 1 for n in self.lens]
            self.next = [n + 1 for n in self.next]
            return
        valid = torch.ones(batch, t, dtype=torch.bool, device=device) if valid is None else valid.to(device).bool()
        text = valid if visual is None else valid & ~visual.to(device).bool()
        rank = valid.long().cumsum(1) - 1  # position of each real token relative to the row's next position
        counts, n_text = valid.sum(1).tolist(), text.sum(1).tolist()
        self._grow(max(n + k for n, k in zip(self.lens, n_text)))
        for row in range(batch):
            if n_text[row]:
                p = rank[row][text[row]] + self.next[row]
                self.pos[row, self.lens[row] : self.lens[row] + n_text[row]] = p.to(torch.int32)
                self.lens[row] += n_text[row]
            self.next[row] += counts[row]

    def _grow(self, need: int) -> None:
        if need > self.pos.shape[1]:
            bigger = self.pos.new_zeros(self.pos.shape[0], max(need, self.pos.shape[1] * 3 // 2))
            bigger[:, : self.pos.shape[1]] = self.pos
            self.pos = bigger

    def crop(self, n: int) -> None:
        """Forget the last ``n`` tokens of every row (they were text tokens in the fp16 window)."""
        self.version += 1
        self.lens = [max(x - n, 0) for x in self.lens]
        self.next = [x - n for x in self.next]

    def take(self, row: int, start: int, n: int) -> torch.Tensor:
        """Positions ``[n]`` (int64) of row ``row``'s text tokens ``start .. start + n - 1``."""
        if start + n > self.lens[row]:
            raise RuntimeError(f"positions of text tokens {start}..{start + n - 1} of row {row} were never "
                               f"recorded ({self.lens[row]} known): the cache missed a forward's inputs")
        return self.pos[row, start : start + n].long()

    def rows(self, start: int, lens: list[int], width: int) -> torch.Tensor:
        """``[B, width]`` positions of text tokens ``start ..`` of each row (0 beyond ``lens[row]``)."""
        if any(start + n > have for n, have in zip(lens, self.lens)):
            raise RuntimeError(f"positions asked for {lens} tokens from {start}, only {self.lens} recorded")
        out = self.pos[:, start : start + width].long()
        if out.shape[1] < width:
            out = torch.cat([out, out.new_zeros(out.shape[0], width - out.shape[1])], 1)
        return out

    def nbytes(self, used: bool = False) -> int:
        if self.pos is None:
            return 0
        n = sum(self.lens) if used else self.pos.numel()
        return n * self.pos.element_size()

    def tile(self, batch: int) -> TextPositions:
        """Row 0 repeated ``batch`` times (the benchmarks' tiled caches)."""
        out = TextPositions()
        if self.pos is not None:
            out.pos = self.pos[:1].repeat(batch, 1)
            out.lens, out.next = self.lens[:1] * batch, self.next[:1] * batch
        return out
