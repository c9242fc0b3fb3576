"""A CUDA device's compute capability, asked once per device index: the plan and the SKVQ launch read it on every
decode call, and ``torch.cuda.get_device_capability`` queries the driver each time."""

from __future__ import annotations

import torch

_CAPABILITY: dict = {}


def capability(device: torch.device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]
