"""Where a cache's segments live when the model is sharded over several devices (docs/MULTIGPU.md).

Rule: a layer's segments live on the device of the key states that layer's attention produced (its GPU). Every
segment tensor (codes, scales, zeros, ``lens``) is created from those key tensors or with their device, so the
rule holds by construction; the decode kernel for layer l then runs on layer l's GPU and nothing crosses devices
on the decode path. The one exception is a cross-layer method (XQuant) whose layer reads the codes of the layer
before it: when the model is split between the two, ``MMKVLayer.segments`` brings the partner's codes over with
:func:`to_device` on each call (a copy of one layer's text codes per decode step, at one layer boundary only).
"""

from __future__ import annotations

import dataclasses

import torch

from . import segments as S


def tensors(seg) -> list[tuple[str, torch.Tensor]]:
    """(field, tensor) of every tensor a segment holds, ``lens`` included."""
    out = [(n, getattr(seg, n)) for n, _ in S.token_fields(seg)]
    return out + [("lens", seg.lens)]


def segment_device(seg) -> torch.device:
    """The one device a segment lives on; ValueError if its tensors are spread over several."""
    devs = {t.device for _, t in tensors(seg)}
    if len(devs) != 1:
        raise ValueError(f"{type(seg).__name__} has tensors on several devices: {sorted(map(str, devs))}")
    return devs.pop()


def to_device(seg, device: torch.device | str):
    """``seg`` with every tensor on ``device`` (the same object when it is already there)."""
    device = torch.device(device)
    moved = {n: t.to(device) for n, t in tensors(seg) if t.device != device}
    return dataclasses.replace(seg, **moved) if moved else seg


def device_key(device: torch.device) -> str:
    return str(device)


def nbytes_by_device(cache, used: bool = False) -> dict[str, int]:
    """Bytes held per device (``{"cuda:0": ..., "cuda:1": ...}``), over every layer's segments and pending prefill
    tensors: capacity included, or with ``used=True`` only what valid tokens occupy (as ``nbytes``)."""
    out: dict[str, int] = {}
    for layer in cache.layers:
        for _, seg, lens in layer.parts():
            key = device_key(segment_device(seg))
            out[key] = out.get(key, 0) + (S.used_nbytes(seg, lens) if used else S.nbytes(seg))
        if layer.pending is not None:
            key = device_key(layer.pending[0].device)
            out[key] = out.get(key, 0) + layer.pending_nbytes()
    return dict(sorted(out.items()))


def layer_devices(cache) -> list[torch.device | None]:
    """Device of each layer's segments (None for a layer that holds nothing yet)."""
    out = []
    for layer in cache.layers:
        parts = layer.parts()
        out.append(segment_device(parts[0][1]) if parts else None)
    return out
