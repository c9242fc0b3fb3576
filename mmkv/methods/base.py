"""What every cache method is: a dataclass of its knobs plus a quantize rule that turns fp16 K/V into a segment.

A method never owns attention (docs/ARCHITECTURE.md): it only produces segments in one of the layouts that
``kernels/layouts.py`` specifies, and the attention path reads them.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

import torch

SCALE_DTYPE = torch.float16  # scales and zero-points are stored in fp16 and counted as 2 bytes each


@dataclass
class Method(ABC):
    name: ClassVar[str] = ""
    modalities: ClassVar[tuple[str, ...]] = ("visual", "text")
    needs_artifact: ClassVar[bool] = False
    # methods that store keys before RoPE get the RoPE position of every text token (``layer.positions``)
    needs_positions: ClassVar[bool] = False
    # decode steps may replay a CUDA graph (mmkv/graphs.py): nothing host-side may change between flushes
    graphable: ClassVar[bool] = True
    # allowed values per field, for validation and for the app's controls
    choices: ClassVar[dict[str, tuple]] = {}

    def __post_init__(self):
        for f, allowed in self.choices.items():
            v = getattr(self, f)
            if v not in allowed:
                raise ValueError(f"{self.name}: {f}={v!r} is not supported; allowed values: {list(allowed)}")

    # tokens a text flush moves out of the fp16 window at once (methods that quantize in token blocks need whole blocks)
    @property
    def flush_block(self) -> int:
        return 32

    def check(self, head_dim: int, num_layers: int) -> None:
        """Raise ValueError if this configuration cannot run on a model of this shape."""

    def bind(self, adapter) -> Method:
        """The method ready for one model: methods with a calibration artifact (``needs_artifact``) load and check
        it here (``mmkv.methods.artifacts.load``); the rest need nothing. Called once per cache."""
        return self

    def for_layer(self, layer_idx: int, num_layers: int) -> Method:
        """The configuration layer ``layer_idx`` uses (methods with per-layer bit-widths return a variant)."""
        return self

    # A layer whose method names a partner layer (``share_from``) gets ``layer.partner`` set by the cache.
    share_from: ClassVar[int | None] = None

    def without_partner(self, partner) -> Method:
        """This layer's configuration when its ``share_from`` layer keeps no text codes (a sliding-window layer):
        methods that can store their own codes instead override this."""
        raise ValueError(f"{self.name}: layer {getattr(self, 'layer_idx', '?')} reads layer {partner.layer_idx}'s "
                         "text codes, but that layer is a sliding-window layer and keeps none; use another text "
                         "method with this model")

    def quantize_block(self, layer, row: int, offset: int, k: torch.Tensor, v: torch.Tensor):
        """Quantize ``n`` tokens that leave the window of ``layer`` (row ``row``, text offset ``offset``).
        Methods that need the layer (cross-layer sharing) override this; the rest only define ``quantize``."""
        return self.quantize(k, v, torch.tensor([k.shape[2]], dtype=torch.int32, device=k.device))

    def resolve(self, seg, layer):
        """The segment attention reads (a method that stores a pointer to another layer's codes fills it in)."""
        return seg

    @abstractmethod
    def quantize(self, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor):
        """``k, v: [B, H, T, D]`` fp16 (row ``b`` valid in ``[0, lens[b])``) -> a segment (kernels/layouts.py)."""

    def __str__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                parts.append(f"{f.name}={_fmt(v)}")
        return self.name + (":" + ",".join(parts) if parts else "")

    @classmethod
    def from_params(cls, params: dict[str, str]) -> Method:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        for key, raw in params.items():
            if key not in fields:
                raise ValueError(f"{cls.name}: unknown parameter {key!r}; parameters are {sorted(fields)}")
            kw[key] = _convert(cls.name, key, raw, fields[key].default)
        return cls(**kw)

    @classmethod
    def describe(cls) -> dict:
        params = {}
        for f in dataclasses.fields(cls):
            params[f.name] = {
                "default": f.default,
                "choices": list(cls.choices[f.name]) if f.name in cls.choices else None,
                "type": type(f.default).__name__,
            }
        return {"name": cls.name, "modalities": list(cls.modalities), "params": params,
                "needs_artifact": cls.needs_artifact, "doc": (cls.__doc__ or "").strip().split("\n\n")[0]}


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _convert(method: str, key: str, raw: str, default):
    raw = raw.strip()
    try:
        if isinstance(default, bool):
            low = raw.lower()
            if low not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
                raise ValueError
            return low in ("1", "true", "on", "yes")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(Fraction(raw))  # allows eta1=1/6 as the XQuant paper writes it
        if default is None:
            return raw
        return type(default)(raw)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{method}: parameter {key}={raw!r} is not a valid {type(default).__name__}") from None
