"""Per-browser-session state: the conversation, the live generation, the last results, the uploaded files.

One :class:`Session` lives in a ``gr.State`` per tab. Gradio hands handlers the stored object itself, so the
generation handler (in the GPU queue) and the stats timer (outside it) see the same live ``stream``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One chat message. ``error`` turns are shown in the chat but never sent to the model."""

    role: str  # "user" | "assistant"
    text: str = ""
    images: list[str] = field(default_factory=list)
    video: str | None = None
    error: bool = False


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    stream: Any = None  # the engine stream being decoded now (its .stats is live)
    live_label: str = ""  # "FP16" or "quantized" while a compare run is in flight
    last_stats: dict | None = None  # stats of the last finished chosen-spec answer
    fp16_stats: dict | None = None  # stats of the last FP16 answer (compare mode)
    last_output: Any = None  # GenerationOutput of the last chosen-spec answer
    fp16_output: Any = None
    last_messages: list | None = None  # the engine messages of the last answered prompt (for the lens)
    last_spec: str = ""
    uploads: set[str] = field(default_factory=set)
    generation: int = 0  # bumps on every new answer (the lens re-captures when it changes)
    lens_key: Any = None
    lens_data: Any = None

    def __deepcopy__(self, memo):  # gr.State deep-copies its value; a Session is never shared, so keep it
        return self

    def conversation(self) -> list[Turn]:
        return [t for t in self.turns if not t.error]

    def reset(self) -> None:
        self.stop.set()
        self.turns.clear()
        self.stream = None
        self.last_stats = self.fp16_stats = None
        self.last_output = self.fp16_output = None
        self.last_messages = None
        self.generation += 1
        self.cleanup_uploads()

    def cleanup_uploads(self) -> None:
        """Delete this session's uploaded files (they are kept only for the session)."""
        for path in list(self.uploads):
            try:
                os.remove(path)
            except OSError:
                pass
            self.uploads.discard(path)


def new_session() -> Session:
    return Session()


def drop_session(session: Session | None) -> None:
    """``gr.State`` delete callback: stop any generation and delete uploads."""
    if session is not None:
        session.stop.set()
        session.cleanup_uploads()
