"""Decode steps replayed from a CUDA graph: the host cost of a step (Python in transformers, in the cache, in the
kernel launchers: tens of milliseconds per step for a 30-layer model on a slow host) drops to one ``replay()``.

Why it is exact: between two flushes a decode step of an ``MMKVCache`` runs the same kernels on the same memory;
only device-side values change (the new token's K/V, the per-row ``lens`` counters, which the cache updates in
place). The host-side part of the step (token counters) is mirrored by ``MMKVCache.advance_decode``. So:

* a step where some layer must flush or grow (``cache.decode_steps_free() == 0``) runs eagerly; if it reallocated
  anything the cache's ``layout_signature`` changes and the graph is dropped;
* otherwise a captured graph whose signature still holds is replayed; without one, the step is captured (the
  capture performs the step's host bookkeeping) and then replayed once (which performs its device work).

The first decode step is always eager (Triton compiles there, outside any capture). A capture that fails (an
operation that cannot be captured) restores the cache's host state, warns once, and decoding goes on eagerly.
Transformers builds a causal mask from host-side counters inside the captured forward; mmkv's decode attention
reads each row's stored tokens (per-row ``lens``) and never the mask, so the frozen mask is harmless.
"""

from __future__ import annotations

import copy
import warnings

import torch

from .cache import MMKVCache, cache_kwargs
from .models.cpu_forward import cpu_forward


class DecodeStepper:
    """``stepper(ids [B, 1], positions [B, 1]) -> logits [B, V]`` of one decode step, graphed where possible.

    The returned logits live in a buffer the next call overwrites: consume them first.
    """

    def __init__(self, model, cache: MMKVCache, graphs: bool = True):
        self.model, self.cache = model, cache
        self.cache_kw = cache_kwargs(model, cache)
        from .models.sharding import model_devices

        devices = model_devices(model)
        # one GPU only: a capture records one device's stream, a sharded model runs on several
        self.enabled = (graphs and len(devices) == 1 and devices[0].type == "cuda"
                        and all(getattr(m, "graphable", True) for m in (cache.spec.visual, cache.spec.text)))
        self.cpu = cpu_forward(model, devices)  # on the CPU: mmkv/models/cpu_forward.py
        self.graph = None
        self.signature = None
        self.logits = None
        self.warm = False
        self.ids = self.pos = None
        self.replays = self.captures = self.eager_steps = 0

    def _eager(self, ids, pos):
        self.eager_steps += 1
        with self.cpu:
            out = self.model(input_ids=ids, position_ids=pos, **self.cache_kw, use_cache=True, logits_to_keep=1)
        if self.graph is not None and self.cache.layout_signature() != self.signature:
            self.graph = self.logits = None  # a flush or growth moved memory the graph reads; frees its pool
        return out.logits[:, -1]

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not self.enabled or self.cache.decode_steps_free() < 1 or not self.warm:
            self.warm = True
            return self._eager(ids, pos)
        if self.graph is not None:
            self.ids.copy_(ids)
            self.pos.copy_(pos)
            self.graph.replay()
            self.cache.advance_decode()  # host counters only: mirrored while the GPU runs the step
            self.replays += 1
            return self.logits
        return self._capture(ids, pos)

    def _capture(self, ids, pos):
        if self.ids is None or self.ids.shape != ids.shape:
            self.ids, self.pos = ids.clone(), pos.clone()
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        host = _host_state(self.cache)
        # Each graph gets its own private memory pool (released with the graph): re-opening a shared pool after
        # its last graph was dropped trips an allocator assert in torch 2.11.
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self.model(input_ids=self.ids, position_ids=self.pos, **self.cache_kw, use_cache=True,
                                 logits_to_keep=1)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager decoding, loudly
            _restore_host_state(self.cache, host)
            self.enabled = False
            warnings.warn(f"CUDA-graph decode disabled ({e!r}); decoding eagerly", stacklevel=3)
            return self._eager(ids, pos)
        self.graph, self.logits = graph, out.logits[:, -1]
        self.signature = self.cache.layout_signature()
        self.captures += 1
        graph.replay()
        return self.logits

    def stats(self) -> dict:
        return {"graph_replays": self.replays, "graph_captures": self.captures, "eager_steps": self.eager_steps}


def _host_state(cache: MMKVCache) -> list[dict]:
    """The per-layer host counters a step changes (what a failed capture must put back)."""
    return [{f: copy.deepcopy(getattr(layer, f)) for f in layer.host_fields} for layer in cache.layers]


def _restore_host_state(cache: MMKVCache, state: list[dict]) -> None:
    for layer, s in zip(cache.layers, state, strict=True):
        for f, value in s.items():
            setattr(layer, f, value)
