"""CacheSpec: which method stores which token kind, and the fp16 window and sinks.

String form (used by the app, eval and bench CLIs), fields separated by spaces::

    visual=calibquant:bits=1 text=kivi:bits=2,group=32 window=128 sinks=4
    fp16                      # everything fp16 (the baseline)
    fp16 window=32 sinks=4    # fp16, with the window and sinks given (they still shape the segments)

A field left out keeps its default: visual and text fp16, window 128 (KIVI's residual R), sinks 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .methods import FP16, Method, get_method

DEFAULT_WINDOW = 128
DEFAULT_SINKS = 4


def parse_method(text: str, modality: str) -> Method:
    name, _, rest = text.strip().partition(":")
    cls = get_method(name.strip().lower())
    if modality not in cls.modalities:
        raise ValueError(f"method {cls.name!r} does not handle {modality} tokens (it handles: {list(cls.modalities)})")
    params = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{cls.name}: expected key=value, got {item!r}")
        params[key.strip()] = value
    return cls.from_params(params)


@dataclass
class CacheSpec:
    visual: Method = field(default_factory=FP16)
    text: Method = field(default_factory=FP16)
    window: int = DEFAULT_WINDOW
    sinks: int = DEFAULT_SINKS

    def __post_init__(self):
        if isinstance(self.visual, str):
            self.visual = parse_method(self.visual, "visual")
        if isinstance(self.text, str):
            self.text = parse_method(self.text, "text")
        if self.window < 0 or self.sinks < 0:
            raise ValueError(f"window and sinks must be >= 0, got window={self.window} sinks={self.sinks}")

    @classmethod
    def parse(cls, text: str | CacheSpec | None) -> CacheSpec:
        if isinstance(text, CacheSpec):
            return text
        if text is None or not str(text).strip() or str(text).strip().lower() == "fp16":
            return cls()
        kw: dict = {}
        for tok in str(text).split():
            key, eq, value = tok.partition("=")
            key = key.strip().lower()
            if key == "fp16" and not eq:  # "fp16 window=32": both modalities fp16, other fields given
                continue
            if not eq:
                raise ValueError(f"spec field {tok!r} is not key=value; fields are visual=, text=, window=, sinks=")
            if key in ("visual", "text"):
                kw[key] = parse_method(value, key)
            elif key in ("window", "sinks"):
                try:
                    kw[key] = int(value)
                except ValueError:
                    raise ValueError(f"{key} must be an integer, got {value!r}") from None
            else:
                raise ValueError(f"unknown spec field {key!r}; fields are visual=, text=, window=, sinks=")
        return cls(**kw)

    def check(self, head_dim: int, num_layers: int) -> None:
        self.visual.check(head_dim, num_layers)
        self.text.check(head_dim, num_layers)

    @property
    def is_fp16(self) -> bool:
        return isinstance(self.visual, FP16) and isinstance(self.text, FP16)

    def __str__(self) -> str:
        return f"visual={self.visual} text={self.text} window={self.window} sinks={self.sinks}"
