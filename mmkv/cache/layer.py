"""One layer of the MMKV cache: an fp16 segment (sinks + recent window), visual segments, one growing text segment.

Life of a token (docs/ARCHITECTURE.md, data flow):

* prefill: ``update`` keeps the layer's fp16 K/V as *pending* and the attention runs exactly on it; the pending
  tokens are routed when the next layer (or the next step) touches the cache, i.e. after this layer's attention
  is done, so at most one layer's prompt is held in fp16 at a time.
* routing: each row's visual tokens become one segment of the visual method; its text tokens are appended to the
  fp16 segment, whose first ``sinks`` tokens stay put and whose tokens beyond ``window`` leave, in whole blocks of
  the text method, into the text segment.
* decode: the new token is appended to the fp16 segment in place (one indexed write for the whole batch); a block
  is flushed to the text method whenever a row's window reaches ``window + block``.

Rows are compacted: padding never enters any segment and each segment keeps per-row ``lens``. Keys are cached
after RoPE, so the order of tokens inside a segment does not change attention.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kernels import reference, use_triton
from kernels.layouts import DenseSeg
from kernels.ops.append import append_token
from kernels.ops.append import supports as supports_append
from kernels.switches import switch

from . import segments as S
from .placement import to_device


def compact_indices(mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Positions of the True entries of each row of ``mask [B, T]``, in order, padded: ``([B, max_n], lens)``."""
    lens = mask.sum(1).tolist()
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    return order[:, : max(max(lens), 0)], lens


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    b, h, _, d = x.shape
    return x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], d).to(x.device))


def set_lens(seg, lens: list[int]) -> None:
    """Write per-row lengths into the segment's existing ``lens`` tensor: a captured decode graph keeps reading
    the same device memory, so flushes must not replace the tensor."""
    if seg.lens.numel() == len(lens):
        seg.lens.copy_(torch.tensor(lens, dtype=torch.int32, device="cpu"))
    else:
        seg.lens = torch.tensor(lens, dtype=torch.int32, device=seg.lens.device)


def tag(k: torch.Tensor, v: torch.Tensor, layer: MMKVLayer, mode: str):
    """Mark the tensors handed to attention with the layer and the mode ("prefill", "decode", "extend"): the
    ``mmkv`` attention function reads the segments from there (transformers passes it no cache)."""
    k._mmkv = (layer, mode)
    return k, v


class MMKVLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    is_croppable = False
    host_fields = ("seen", "dense_len", "text_len", "visual_lens")  # what a decode step changes on the host

    def __init__(self, spec, layer_idx: int, num_layers: int = 1):
        super().__init__()
        self.spec = spec
        self.layer_idx, self.num_layers = layer_idx, num_layers
        self.visual_method = spec.visual.for_layer(layer_idx, num_layers)
        self.text_method = spec.text.for_layer(layer_idx, num_layers)
        self.partner: MMKVLayer | None = None
        self.positions = None  # the cache's TextPositions when the text method stores keys before RoPE
        self.seen = 0
        self.pending: tuple | None = None
        self.dense: DenseSeg | None = None
        self.dense_len: list[int] = []
        self.visual: list = []
        self.visual_lens: list[list[int]] = []
        self.text = None
        self.text_len: list[int] = []

    # --- transformers' CacheLayerMixin -------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, valid=None, visual=None, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.finalize()
        t = key_states.shape[2]
        self.seen += t
        if self.dense is None:
            self.pending = (key_states, value_states, valid, visual)
            return tag(key_states, value_states, self, "prefill")
        plain = (valid is None or bool(valid.all())) and (visual is None or not bool(visual.any()))
        if t == 1 and plain:
            self._append_decode(key_states, value_states)
            return tag(key_states, value_states, self, "decode")
        self.pending = (key_states, value_states, valid, visual)
        return tag(key_states, value_states, self, "extend")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        partner, positions = self.partner, self.positions
        self.__init__(self.spec, self.layer_idx, self.num_layers)
        self.partner, self.positions = partner, positions
        if positions is not None and self.layer_idx == 0:
            positions.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the most recent ``tokens_to_remove`` tokens; they must still be in the fp16 window (multi-turn
        chat uses this when a re-tokenized answer diverges from the generated ids in its last tokens)."""
        self.finalize()
        n = tokens_to_remove
        if n <= 0:
            return
        sinks = self.spec.sinks
        if self.dense is None or any(d - min(sinks, d) < n for d in self.dense_len):
            raise ValueError(f"cannot drop the last {n} tokens: they are no longer in the fp16 window")
        self.dense_len = [d - n for d in self.dense_len]
        self.dense.lens = torch.tensor(self.dense_len, dtype=torch.int32, device=self.dense.k.device)
        self.seen -= n
        if self.positions is not None and self.layer_idx == 0:  # layer 0 owns the shared positions
            self.positions.crop(n)

    # --- decode steps replayed from a CUDA graph (mmkv/graphs.py) ---------------------------------------------
    def decode_steps_free(self) -> int:
        """How many more single-token decode appends neither grow the fp16 segment nor flush to the text method:
        those steps run the exact same kernels on the exact same memory, so a captured graph can replay them."""
        if self.dense is None or self.pending is not None:
            return 0
        n = max(self.dense_len)
        grow_free = S.capacity(self.dense) - n
        # _append_decode flushes after the append that makes n + k - min(sinks, n + k) >= window + block
        first_flush = max(1, self.spec.window + self.text_method.flush_block + self.spec.sinks - n)
        return max(0, min(grow_free, first_flush - 1))

    def advance_decode(self) -> None:
        """The host-side part of one graph-replayed decode append (its device part is in the graph)."""
        self.seen += 1
        self.dense_len = [n + 1 for n in self.dense_len]

    # --- segments ------------------------------------------------------------------------------------------------
    def segments(self) -> list:
        """Every segment attention must read, in the order kernels expect nothing of (order is irrelevant)."""
        segs = [self.dense] if self.dense is not None else []
        segs += self.visual
        if self.text is not None:
            seg = self.text_method.resolve(self.text, self)
            if self.partner is not None and self.partner.text is not None and self.partner.device != self.device:
                seg = to_device(seg, self.device)  # codes read from a layer on another GPU (placement.py)
            segs.append(seg)
        return segs

    def finalize(self) -> None:
        """Route the pending prefill tokens into segments (no-op when nothing is pending)."""
        if self.pending is None:
            return
        k, v, valid, visual = self.pending
        self.pending = None
        b, _, t, _ = k.shape
        dev = k.device
        valid = torch.ones(b, t, dtype=torch.bool, device=dev) if valid is None else valid.to(dev).bool()
        visual = torch.zeros(b, t, dtype=torch.bool, device=dev) if visual is None else visual.to(dev).bool()
        if not bool(visual.any()) and bool(valid.all()):
            # a plain text prompt (every chat turn on a text model): _append_text copies it anyway, so compacting
            # it first would be one more copy of every layer's keys and values (~1% of a 2k CPU prefill)
            self._append_text(k, v, [t] * b)
            return
        vis = valid & visual
        if bool(vis.any()):
            idx, lens = compact_indices(vis)
            lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
            self.visual.append(self.visual_method.quantize(gather_tokens(k, idx), gather_tokens(v, idx), lens_t))
            self.visual_lens.append(lens)
        idx, lens = compact_indices(valid & ~visual)
        self._append_text(gather_tokens(k, idx), gather_tokens(v, idx), lens)

    def _steady_capacity(self) -> int:
        return self.spec.sinks + self.spec.window + self.text_method.flush_block

    def _append_text(self, k, v, lens: list[int]) -> None:
        b, h, _, d = k.shape
        if self.dense is None:
            cap = max(max(lens), 1)  # grows by doubling up to the steady size: short prompts stay small
            self.dense = DenseSeg(k.new_zeros(b, h, cap, d), v.new_zeros(b, h, cap, d),
                                  torch.zeros(b, dtype=torch.int32, device=k.device))
            self.dense_len = [0] * b
        need = max(dl + n for dl, n in zip(self.dense_len, lens))
        if need > S.capacity(self.dense):
            self.dense = S.grow(self.dense, need)
        for row, n in enumerate(lens):
            if n:
                at = self.dense_len[row]
                self.dense.k[row, :, at : at + n] = k[row, :, :n]
                self.dense.v[row, :, at : at + n] = v[row, :, :n]
                self.dense_len[row] += n
        self._flush()

    def _append_decode(self, k, v) -> None:
        need = max(self.dense_len) + 1
        if need > S.capacity(self.dense):
            self.dense = S.grow(self.dense, max(need, min(2 * S.capacity(self.dense), self._steady_capacity())))
        if k.shape[0] == 1 and k.device.type == "cpu":
            # one row on the CPU: its position is the host counter; two slice copies instead of an index_put each
            # (a tensor of rows, one of positions, two scatters: ~40 us a layer of a ~65 ms SmolLM2 step). Not on
            # a GPU, where a captured step must read the position from the device (mmkv/graphs.py).
            at = self.dense_len[0]
            self.dense.k[:, :, at : at + 1].copy_(k)
            self.dense.v[:, :, at : at + 1].copy_(v)
            self.dense.lens += 1
        else:
            d = self.dense
            if use_triton(k) and switch("MMKV_APPEND_KERNEL") != "0" and supports_append(d.k, d.v, k, v, d.lens):
                append_token(d.k, d.v, k, v, d.lens, check=False)  # one launch instead of the reference's five
            else:
                reference.append_token(d.k, d.v, k, v, d.lens)
        self.dense_len = [n + 1 for n in self.dense_len]
        if max(self.dense_len) - min(self.spec.sinks, max(self.dense_len)) >= self.spec.window + self.text_method.flush_block:
            self._flush()

    def _flush(self) -> None:
        """Move whole blocks of the oldest window tokens (after the sinks) of every row into the text method."""
        sinks, window, blk = self.spec.sinks, self.spec.window, self.text_method.flush_block
        moved = False
        for row, n in enumerate(self.dense_len):
            m = max(n - min(sinks, n) - window, 0) // blk * blk
            if m == 0:
                continue
            k = self.dense.k[row : row + 1, :, sinks : sinks + m]
            v = self.dense.v[row : row + 1, :, sinks : sinks + m]
            offset = self.text_len[row] if self.text is not None else 0
            self._text_append(row, self.text_method.quantize_block(self, row, offset, k, v), m)
            S.move_tokens(self.dense, row, sinks + m, sinks, n - sinks - m)
            self.dense_len[row] = n - m
            moved = True
        set_lens(self.dense, self.dense_len)
        if moved and S.capacity(self.dense) > 2 * self._steady_capacity() >= 2 * max(self.dense_len):
            self.dense = S.shrink(self.dense, self._steady_capacity())
        if moved:
            set_lens(self.text, self.text_len)

    def _text_append(self, row: int, seg, n: int) -> None:
        blk = self.text_method.flush_block
        if self.text is None:
            self.text = S.empty_like_layout(seg, len(self.dense_len), max(n, 4 * blk))
            self.text_len = [0] * len(self.dense_len)
        need = self.text_len[row] + n
        cap = S.capacity(self.text)
        if need > cap:
            grown = max(need, cap + cap // 2)
            self.text = S.grow(self.text, -(-grown // blk) * blk)
        S.write_row(self.text, row, self.text_len[row], seg, 0, n)
        self.text_len[row] += n

    # --- accounting ----------------------------------------------------------------------------------------------
    def parts(self) -> list[tuple[str, object, list[int]]]:
        """(modality, segment, per-row lens) of everything held."""
        out = []
        if self.dense is not None:
            out.append(("fp16", self.dense, self.dense_len))
        out += [("visual", s, lens) for s, lens in zip(self.visual, self.visual_lens)]
        if self.text is not None:
            out.append(("text", self.text, self.text_len))
        return out

    def pending_nbytes(self) -> int:
        if self.pending is None:
            return 0
        k, v = self.pending[:2]
        return k.numel() * k.element_size() + v.numel() * v.element_size()
