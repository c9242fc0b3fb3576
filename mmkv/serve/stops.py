"""Stop strings in streamed text: what may be sent now, and what must wait until it cannot start a stop."""

from __future__ import annotations


class StopScanner:
    """Emits generated text while holding back what could still become a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.hit = False

    def feed(self, piece: str) -> str:
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            self.text = self.text[:cut]
            return self.flush()
        end = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
