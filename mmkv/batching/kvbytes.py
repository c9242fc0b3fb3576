"""The exact bytes a request's quantized KV cache holds at a given length, before it runs (admission control).

A request alone holds, per layer: its visual tokens in one segment of the visual method, its first ``sinks`` and
latest text tokens in the dense segment, and whole flush blocks of older text tokens in the text segment; where
the text method stores keys before RoPE, one int32 position per text token (mmkv/cache/positions.py). Which
tokens sit where follows from the flush rule alone (``text_len`` below: the same for a prompt routed at once and
for tokens decoded one at a time), and the bytes of each follow from the layouts' own accounting
(``segments.used_nbytes``) on segments the methods produce for one probe. ``KVBytes.by_modality`` therefore
equals ``cache.nbytes_by_modality(used=True)`` of that request's cache, alone or as rows of a batch
(tests/test_batching_rows.py checks it for every method).
"""

from __future__ import annotations

import torch

from ..cache import MMKVCache
from ..cache import segments as S
from ..spec import CacheSpec


def text_len(n_text: int, sinks: int, window: int, block: int) -> int:
    """Text tokens (of ``n_text`` in a row) that have left the fp16 window for the text segment."""
    return max(n_text - min(sinks, n_text) - window, 0) // block * block


class KVBytes:
    """Byte accounting of one spec on one model: ``by_modality(n_visual, n_text)`` and ``total(...)``."""

    def __init__(self, engine, spec):
        self.spec = CacheSpec.parse(spec)
        a = engine.adapter
        self.dtype = engine.model.get_input_embeddings().weight.dtype
        self.device = engine.device
        self.shape = (a.num_kv_heads, a.head_dim)
        probe = MMKVCache.for_model(self.spec, a)
        self.layers = probe.layers
        sinks, window = self.spec.sinks, self.spec.window
        t = sinks + window + max(layer.text_method.flush_block for layer in self.layers)
        gen = torch.Generator().manual_seed(0)
        k = torch.randn(1, *self.shape[:1], t, self.shape[1], generator=gen).to(self.device, self.dtype)
        v = torch.randn(k.shape, generator=gen).to(self.device, self.dtype)
        with torch.inference_mode():  # one flush in every layer: each layer's text segment, as its method makes it
            for i in range(len(self.layers)):
                probe.update(k, v, i)
            probe.finalize()
        self.dense_per_token, self.text_per_block, self.blocks = [], [], []
        for layer in self.layers:
            blk = layer.text_method.flush_block
            one, two = S.used_nbytes(layer.text, [blk]), S.used_nbytes(layer.text, [2 * blk])
            if two != 2 * one:  # a block must be whole units of every field (what write_row needs too)
                raise ValueError(f"{self.spec.text}: a flush block of {blk} tokens is not a whole number of units")
            self.blocks.append(blk)
            self.text_per_block.append(one)
            self.dense_per_token.append(S.used_nbytes(layer.dense, [1]))
        # layers of one flush block add up: the per-step accounting (every running request, every step) loops over
        # these few groups, not the model's layers (64 requests x 32 layers was ~0.5 ms of Python a GPU step)
        groups: dict[int, list[int]] = {}
        for dense, text, blk in zip(self.dense_per_token, self.text_per_block, self.blocks):
            g = groups.setdefault(blk, [0, 0])
            g[0] += dense
            g[1] += text
        self._groups = [(blk, dense, text) for blk, (dense, text) in groups.items()]
        self.positions = self.spec.text.needs_positions
        self._visual: dict[int, list[int]] = {}
        self._visual_sum: dict[int, int] = {}
        self.elements_per_token = probe.elements_per_token()

    def visual_bytes(self, n_visual: int) -> list[int]:
        """Per layer: the bytes of one visual span of ``n_visual`` tokens (quantized once, then remembered)."""
        if n_visual not in self._visual:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(1, self.shape[0], n_visual, self.shape[1], generator=gen).to(self.device, self.dtype)
            lens = torch.tensor([n_visual], dtype=torch.int32, device=self.device)
            with torch.inference_mode():
                self._visual[n_visual] = [S.used_nbytes(layer.visual_method.quantize(x, x, lens), [n_visual])
                                          for layer in self.layers]
        return self._visual[n_visual]

    def by_modality(self, n_visual: int, n_text: int) -> dict[str, int]:
        """Bytes per modality of a request holding ``n_visual`` visual tokens (one prompt) and ``n_text`` text
        tokens (prompt text + generated tokens fed back), as ``MMKVCache.nbytes_by_modality(used=True)``."""
        s, w = self.spec.sinks, self.spec.window
        if n_visual and n_visual not in self._visual_sum:
            self._visual_sum[n_visual] = sum(self.visual_bytes(n_visual))
        out = {"visual": self._visual_sum[n_visual] if n_visual else 0, "text": 0, "fp16": 0}
        for blk, dense, text in self._groups:
            tl = text_len(n_text, s, w, blk)
            out["text"] += tl // blk * text
            out["fp16"] += (n_text - tl) * dense
        if self.positions:
            tl0 = text_len(n_text, s, w, self.blocks[0])
            out["text"] += 4 * tl0
            out["fp16"] += 4 * (n_text - tl0)
        return out

    def total(self, n_visual: int, n_text: int) -> int:
        return sum(self.by_modality(n_visual, n_text).values())

    def peak(self, n_visual: int, first: int, last: int) -> int:
        """The most bytes the request holds while its text tokens go from ``first`` to ``last``. Not always at the
        end: the fp16 window fills token by token and a flush moves a block into (smaller) codes, so with a
        quantized text method the bytes just before a flush can exceed the bytes at the end."""
        s, w = self.spec.sinks, self.spec.window
        n = torch.arange(first, last + 1, dtype=torch.int64)
        out = torch.zeros_like(n)
        for dense, text, blk in zip(self.dense_per_token, self.text_per_block, self.blocks):
            tl = (n - n.clamp(max=s) - w).clamp(min=0) // blk * blk  # text_len, for every n at once
            out += tl // blk * text + (n - tl) * dense
        if self.positions:
            out += 4 * n
        return int(out.max()) + (sum(self.visual_bytes(n_visual)) if n_visual else 0)

    def effective_bits(self, n_visual: int, n_text: int) -> dict[str, float]:
        """As ``MMKVCache.effective_bits`` of that request's cache."""
        used = self.by_modality(n_visual, n_text)
        tl0 = text_len(n_text, self.spec.sinks, self.spec.window, self.blocks[0])
        tokens = {"visual": n_visual, "text": tl0, "fp16": n_text - tl0}
        per = self.elements_per_token
        out = {m: 8.0 * used[m] / (tokens[m] * per) if tokens[m] else 0.0 for m in used}
        n = sum(tokens.values())
        out["total"] = 8.0 * sum(used.values()) / (n * per) if n else 0.0
        return out
