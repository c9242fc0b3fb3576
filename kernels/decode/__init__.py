"""Decode attention over a layer's segments on the GPU (or Triton's interpreter).

The one place where layouts register: importing this package imports ``dispatch`` (the built-in dense, channel and
KIVI layouts) and every module that registers a plug-in layout with ``registry.register_layout``.
"""

from __future__ import annotations

from . import alignedkv, skvq  # noqa: F401  (each registers its layout)
from .dispatch import decode_attention
from .registry import LAYOUTS, LaunchContext, Layout, register_layout

__all__ = ["LAYOUTS", "Layout", "LaunchContext", "decode_attention", "register_layout"]
