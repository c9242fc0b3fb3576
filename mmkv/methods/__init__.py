"""The method registry: name -> dataclass. Later methods register themselves here; nothing else hard-codes the list."""

from __future__ import annotations

from .alignedkv import AlignedKV
from .aquakv import AquaKV
from .base import Method
from .calibquant import CalibQuant
from .fp16 import FP16
from .kivi import KIVI
from .skvq import SKVQ
from .xquant import XQuant

METHODS: dict[str, type[Method]] = {
    m.name: m for m in (FP16, KIVI, CalibQuant, XQuant, SKVQ, AquaKV, AlignedKV)
}


def get_method(name: str) -> type[Method]:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown cache method {name!r}; available: {sorted(METHODS)}") from None


def describe() -> list[dict]:
    """Every registered method with its parameters, defaults and allowed values (the app builds its controls from this)."""
    return [m.describe() for m in METHODS.values()]


__all__ = ["METHODS", "Method", "describe", "get_method", "FP16", "KIVI", "CalibQuant", "XQuant", "SKVQ"]
