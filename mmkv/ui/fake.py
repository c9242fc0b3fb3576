"""A stand-in engine with the interface of ``mmkv.Engine`` (stream / generate / stats), for UI unit tests and for
working on the layout without a model: ``python app.py --model fake``. It writes canned words, no model runs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

WORDS = "the cache keeps visual tokens at one bit and text tokens at two bits while the window stays fp16".split()

FAKE_METHODS = [
    {"name": "calibquant", "modalities": ["visual"], "needs_artifact": False, "doc": "CalibQuant (fake registry).",
     "params": {"bits": {"default": 2, "choices": [1, 2, 4, 8], "type": "int"},
                "calibrate": {"default": True, "choices": None, "type": "bool"},
                "tau1": {"default": 0.2, "choices": None, "type": "float"},
                "tau2": {"default": 0.5, "choices": None, "type": "float"}}},
    {"name": "kivi", "modalities": ["text"], "needs_artifact": False, "doc": "KIVI (fake registry).",
     "params": {"bits": {"default": 2, "choices": [2, 4], "type": "int"},
                "group": {"default": 32, "choices": [32, 64, 128], "type": "int"}}},
    {"name": "aquakv", "modalities": ["text"], "needs_artifact": True, "doc": "AQUA-KV (fake registry).",
     "params": {"bits": {"default": 2, "choices": [2, 3, 4], "type": "int"}}},
]


def _bits_of(spec: str) -> float:
    if not spec or spec.strip() == "fp16" or "visual=" not in spec:
        return 16.0
    tail = spec.split("visual=", 1)[1].split()[0]
    for part in tail.replace(":", ",").split(","):
        if part.startswith("bits="):
            return float(part[5:])
    return 2.0


@dataclass
class FakeOutput:
    text: list[str]
    tokens: list[list[int]]
    stats: dict
    cache: object = None


@dataclass
class FakeStream:
    pieces: list[str]
    spec: str
    stop_event: threading.Event | None
    delay: float
    fail_at: int | None = None
    stats: dict = field(default_factory=dict)
    output: FakeOutput | None = None

    def stop(self):
        if self.stop_event is not None:
            self.stop_event.set()

    def __iter__(self):
        bits = _bits_of(self.spec)
        fp16_bytes = 400_000
        vis = int(300_000 * bits / 16)
        self.stats.update(prefill_ms=12.0, decode_tokens_per_s=0.0, peak_memory_bytes=50_000_000, new_tokens=0,
                          cache_bytes={"visual": vis, "text": 60_000, "fp16": 40_000}, spec=self.spec,
                          effective_bits={"visual": bits, "text": 2.0}, prompt_tokens={"visual": 576, "text": 20},
                          cache_bytes_used={"visual": vis, "text": 50_000, "fp16": 30_000}, cache_dtype="fp16",
                          fp16_equivalent_bytes=fp16_bytes, timeline=[])
        t0 = time.perf_counter()
        done = []
        for i, piece in enumerate(self.pieces):
            if self.stop_event is not None and self.stop_event.is_set():
                break
            if self.fail_at is not None and i == self.fail_at:
                raise RuntimeError("fake failure in decode")
            time.sleep(self.delay)
            done.append(piece)
            dt = max(time.perf_counter() - t0, 1e-6)
            self.stats["new_tokens"] = i + 1
            self.stats["decode_tokens_per_s"] = (i + 1) / dt
            self.stats["cache_bytes"]["text"] += 1000
            self.stats["cache_bytes_used"]["text"] += 1000
            self.stats["timeline"].append({"step": i + 1, "t_s": dt, "tokens_per_s": (i + 1) / dt,
                                           "cache_bytes": sum(self.stats["cache_bytes"].values())})
            yield piece
        self.output = FakeOutput(text=["".join(done)], tokens=[list(range(len(done)))], stats=dict(self.stats))


class FakeEngine:
    """``answers`` maps a spec to canned text; ``fail`` makes the next stream raise (once)."""

    def __init__(self, delay: float = 0.0, text: str | None = None):
        self.delay = delay
        self.text = text
        self.calls: list[dict] = []
        self.fail: Exception | None = None
        self.fail_at: int | None = None

    def _pieces(self, spec: str, max_new_tokens: int) -> list[str]:
        words = (self.text or " ".join(WORDS)).split()
        if _bits_of(spec) < 2:
            words = words[:3] + ["one", "bit"] + words[3:]
        return [(" " if i else "") + w for i, w in enumerate(words[:max_new_tokens])]

    def stream(self, inputs, spec="fp16", max_new_tokens=32, stop=None, **kw):
        self.calls.append({"inputs": inputs, "spec": spec, "max_new_tokens": max_new_tokens, **kw})
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err
        return FakeStream(self._pieces(spec, max_new_tokens), spec, stop, self.delay, fail_at=self.fail_at)

    def generate(self, inputs, spec="fp16", max_new_tokens=32, stop=None, **kw):
        s = self.stream(inputs, spec=spec, max_new_tokens=max_new_tokens, stop=stop, **kw)
        for _ in s:
            pass
        return s.output


def fake_loader(name: str):
    """``ModelHost`` loader for ``--model fake`` / ``fake-vlm``: (engine, info dict, None)."""
    vlm = name != "fake"
    info = {"name": name, "family": "llava" if vlm else "text", "synthetic": "random weights",
            "takes_images": vlm, "takes_video": vlm}
    return FakeEngine(delay=0.02), info, None
