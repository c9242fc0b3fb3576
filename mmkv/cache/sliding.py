"""A sliding-window layer (Gemma 3's local layers, Mistral v0.1): only the tokens its attention can still see.

transformers masks a sliding layer so that a query at position ``p`` sees keys ``p - W < k <= p``: ``W`` tokens,
itself included (``masking_utils.sliding_window_overlay``). So this layer keeps, per row, its last ``W`` tokens,
visual and text alike, in the model's dtype, and evicts the oldest as new ones arrive: memory stops at ``W``
tokens a row however long the conversation, and an evicted token can never be read because it is gone.

Why not quantize them: the text methods quantize whole blocks of tokens leaving a window, and the layer's tokens
leave one at a time from the front of it; what the layer holds is bounded by ``W`` whatever the context, so the
compression that grows with the context is the full-attention layers' (which keep the spec's segments).

The fp16 segment is used as a ring so a decode step costs one write: slots ``[0, lens)`` hold tokens and
``slot[row]`` is where the next one goes (``lens`` until the ring is full, then the oldest token's slot). A decode
step writes the new token there and attention reads all held tokens, exactly the ``W`` visible ones (decode
attention does not depend on the order of keys). A later turn's new tokens (extend) see a held token only while it
is inside their own window: ``window_attention`` masks by each slot's age.

A later chat turn may drop the newest tokens (``crop``: a re-tokenized answer that differs from the generated ids),
which uncovers tokens evicted before them. So the last ``min(spec.window, W)`` evicted tokens wait in a spare ring
that attention never reads (a decode step copies the token it overwrites there): a crop works as far back as it
does on the full-attention layers, whose fp16 window is ``spec.window``, and memory stops at ``W`` plus the spare.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.layouts import DenseSeg

from . import segments as S
from .layer import MMKVLayer, compact_indices, gather_tokens, set_lens
from .rows import cat_rows, take_rows

UNBOUNDED = 1 << 30  # decode steps a full ring can take without growing or flushing: any number


class SlidingLayer(MMKVLayer):
    is_sliding = True
    host_fields = (*MMKVLayer.host_fields, "spare_len", "lost")

    def __init__(self, spec, layer_idx: int, num_layers: int, sliding_window: int):
        if not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"layer {layer_idx}: sliding_window must be a positive int, got {sliding_window!r}")
        super().__init__(spec, layer_idx, num_layers)
        self.sliding_window = sliding_window
        self.slot: torch.Tensor | None = None  # [B] int64: where each row's next token goes
        # The last tokens evicted, never read by attention: a later chat turn may drop the newest tokens
        # (``crop``), uncovering them again. As many as the full layers' fp16 window, where crops must fall too.
        self.spare_size = min(max(spec.window, 1), sliding_window)
        self.spare: DenseSeg | None = None
        self.spare_len: list[int] = []
        self.spare_slot: torch.Tensor | None = None
        self.lost: list[bool] = []  # per row: some evicted token is gone for good

    def reset(self) -> None:
        partner = self.partner
        self.__init__(self.spec, self.layer_idx, self.num_layers, self.sliding_window)
        self.partner = partner

    def _steady_capacity(self) -> int:
        return self.sliding_window

    def parts(self) -> list[tuple[str, object, list[int]]]:
        return super().parts() + ([("fp16", self.spare, self.spare_len)] if self.spare is not None else [])

    # --- routing -------------------------------------------------------------------------------------------------
    def _held(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``row``'s spare then window tokens, oldest first: K and V ``[H, n, D]``."""
        def ring(seg, n, slot, size):
            order = (slot - n + torch.arange(n, device=seg.k.device)) % size
            return seg.k[row][:, order], seg.v[row][:, order]

        k, v = ring(self.dense, self.dense_len[row], int(self.slot[row]), self.sliding_window)
        if self.spare is not None:
            sk, sv = ring(self.spare, self.spare_len[row], int(self.spare_slot[row]), self.spare_size)
            k, v = torch.cat([sk, k], 1), torch.cat([sv, v], 1)
        return k, v

    def _store(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Lay out ``row``'s tokens ``k, v [H, n, D]`` (oldest first): the last ``W`` in the window, up to
        ``spare_size`` before them in the spare, both from slot 0; older ones are let go."""
        w, r = self.sliding_window, self.spare_size
        n = k.shape[1]
        m = min(n, w)
        if m > S.capacity(self.dense):
            self.dense = S.grow(self.dense, m)
        self.dense.k[row, :, :m], self.dense.v[row, :, :m] = k[:, n - m :], v[:, n - m :]
        self.dense_len[row] = m
        self.slot[row] = m % w
        if m == w:
            self._ensure_spare()
        if self.spare is not None:
            e = min(n - m, r)
            self.spare.k[row, :, :e], self.spare.v[row, :, :e] = k[:, n - m - e : n - m], v[:, n - m - e : n - m]
            self.spare_len[row] = e
            self.spare_slot[row] = e % r
        self.lost[row] = self.lost[row] or n - m > r

    def _ensure_spare(self) -> None:
        if self.spare is None:
            b, h, _, d = self.dense.k.shape
            k = self.dense.k
            self.spare = DenseSeg(k.new_zeros(b, h, self.spare_size, d), k.new_zeros(b, h, self.spare_size, d),
                                  torch.zeros(b, dtype=torch.int32, device=k.device))
            self.spare_len = [0] * b
            self.spare_slot = torch.zeros(b, dtype=torch.long, device=k.device)

    def finalize(self) -> None:
        """Append the pending tokens (every real one, visual or text) and keep each row's last ``W``."""
        if self.pending is None:
            return
        k, v, valid, _ = self.pending
        self.pending = None
        b, h, t, d = k.shape
        valid = torch.ones(b, t, dtype=torch.bool, device=k.device) if valid is None else valid.to(k.device).bool()
        idx, lens = compact_indices(valid)
        new_k, new_v = gather_tokens(k, idx), gather_tokens(v, idx)
        if self.dense is None:
            cap = min(max(max(lens), 1), self.sliding_window)
            self.dense = DenseSeg(k.new_zeros(b, h, cap, d), v.new_zeros(b, h, cap, d),
                                  torch.zeros(b, dtype=torch.int32, device=k.device))
            self.dense_len, self.lost = [0] * b, [False] * b
            self.slot = torch.zeros(b, dtype=torch.long, device=k.device)
        for row, m in enumerate(lens):
            if m:
                hk, hv = self._held(row)
                self._store(row, torch.cat([hk, new_k[row, :, :m]], 1), torch.cat([hv, new_v[row, :, :m]], 1))
        self._sync_lens()

    def _sync_lens(self) -> None:
        set_lens(self.dense, self.dense_len)
        if self.spare is not None:
            set_lens(self.spare, self.spare_len)

    def _append_decode(self, k, v) -> None:
        w, cap = self.sliding_window, S.capacity(self.dense)
        need = max(self.dense_len) + 1
        if need > cap and cap < w:  # still filling: grow by doubling up to the window
            self.dense = S.grow(self.dense, min(w, max(need, 2 * cap)))
            if S.capacity(self.dense) == w:
                self._ensure_spare()
        rows = torch.arange(k.shape[0], device=k.device)
        if self.spare is not None:  # a full row's oldest token moves to the spare before it is overwritten
            full = (self.dense.lens == w)[:, None, None]
            at = self.spare_slot
            self.spare.k[rows, :, at] = torch.where(full, self.dense.k[rows, :, self.slot], self.spare.k[rows, :, at])
            self.spare.v[rows, :, at] = torch.where(full, self.dense.v[rows, :, self.slot], self.spare.v[rows, :, at])
            moved = full[:, 0, 0]
            self.spare_slot.add_(moved.long()).remainder_(self.spare_size)
            self.spare.lens.add_(moved.int()).clamp_(max=self.spare_size)
        self.dense.k[rows, :, self.slot] = k[:, :, 0]
        self.dense.v[rows, :, self.slot] = v[:, :, 0]
        self.slot.add_(1).remainder_(w)
        self.dense.lens.add_(1).clamp_(max=w)
        self._advance_host()

    def _advance_host(self) -> None:
        w, r = self.sliding_window, self.spare_size
        if self.spare is not None:
            for row, n in enumerate(self.dense_len):
                if n == w:
                    self.lost[row] = self.lost[row] or self.spare_len[row] == r
                    self.spare_len[row] = min(self.spare_len[row] + 1, r)
        self.dense_len = [min(n + 1, w) for n in self.dense_len]

    @torch.inference_mode()  # the engine's cache tensors are inference tensors; a chat's next turn crops outside
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the most recent tokens, uncovering the ones evicted before them (kept in the spare): possible as
        long as every token the next query sees is still held."""
        self.finalize()
        n = tokens_to_remove
        if n <= 0:
            return
        w = self.sliding_window
        held = [d + (self.spare_len[r] if self.spare is not None else 0) for r, d in enumerate(self.dense_len)]
        if self.dense is None or any(h < n or (lost and h - n < w - 1) for h, lost in zip(held, self.lost)):
            raise ValueError(f"cannot drop the last {n} tokens of sliding-window layer {self.layer_idx} (window "
                             f"{w}): older tokens they would uncover were already evicted")
        for row in range(len(self.dense_len)):
            k, v = self._held(row)
            self._store(row, k[:, : k.shape[1] - n], v[:, : v.shape[1] - n])
        self._sync_lens()
        self.seen -= n

    def take_ring_rows(self, rows: torch.Tensor) -> None:
        """Keep the ring state of ``rows`` (indices into the current rows, in the order given, repeats allowed):
        requests leaving a batch (``rows.keep_rows``), or one request tiled over a batch (the budget bench's
        ``tile_cache``). Ring state: where each row writes next, its spare of evicted tokens, whether it lost any.
        The window segment (``dense``, ``dense_len``) is the caller's to move, as every layer's segments are;
        without this a decode step would index rows the spare lacks."""
        idx = [int(r) for r in rows]
        self.slot = self.slot[idx].clone()
        self.lost = [self.lost[r] for r in idx]
        if self.spare is not None:
            self.spare = take_rows(self.spare, torch.tensor(idx, dtype=torch.long))
            self.spare_len = [self.spare_len[r] for r in idx]
            self.spare_slot = self.spare_slot[idx].clone()

    def merge_ring_rows(self, other: SlidingLayer, na: int, nb: int) -> None:
        """Append the ring state of ``other`` (the same layer of a request joining the batch, ``nb`` rows) after this
        layer's ``na`` rows (``rows.merge_rows``, which moves the window segments). A side whose rings are still
        filling has no spare yet: its rows get empty ones."""
        self.slot = torch.cat([self.slot, other.slot.to(self.slot.device)])
        self.lost = self.lost + other.lost
        if self.spare is None and other.spare is None:
            return
        example = self.spare if self.spare is not None else other.spare
        self.spare = cat_rows([(self.spare, na), (other.spare, nb)], example)
        self.spare_len = (self.spare_len or [0] * na) + (other.spare_len or [0] * nb)
        dev = example.lens.device
        slots = [s.spare_slot.to(dev) if s.spare is not None else torch.zeros(n, dtype=torch.long, device=dev)
                 for s, n in ((self, na), (other, nb))]
        self.spare_slot = torch.cat(slots)

    # --- decode steps replayed from a CUDA graph (mmkv/graphs.py) ---------------------------------------------
    def decode_steps_free(self) -> int:
        if self.dense is None or self.pending is not None:
            return 0
        cap = S.capacity(self.dense)
        return UNBOUNDED if cap >= self.sliding_window else cap - max(self.dense_len)

    def advance_decode(self) -> None:
        self.seen += 1
        self._advance_host()


def window_attention(layer: SlidingLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """New tokens ``query [B, Hq, t, D]`` (keys/values ``[B, Hk, t, D]``, every one real, right after the held
    ones) over a sliding layer's held tokens and each other, each query seeing only its last ``W`` positions.
    Returns ``[B, t, Hq, D]``."""
    seg, w = layer.dense, layer.sliding_window
    b, hq, t, _ = query.shape
    dev = query.device
    j = torch.arange(seg.k.shape[2], device=dev)
    age = (layer.slot.to(dev)[:, None] - 1 - j[None]) % w + 1  # 1 = the newest held token
    held = j[None] < seg.lens.to(dev).long()[:, None]
    i = torch.arange(t, device=dev)
    see_held = held[:, None, :] & (age[:, None, :] + i[None, :, None] < w)  # [B, t, cap]
    see_new = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < w)  # [t, t]: causal, within the window
    mask = torch.cat([see_held, see_new.expand(b, t, t)], -1)[:, None]
    k = torch.cat([seg.k.to(key.dtype), key], 2)
    v = torch.cat([seg.v.to(value.dtype), value], 2)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
    return out.transpose(1, 2)
