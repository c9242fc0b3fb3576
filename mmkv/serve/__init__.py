"""``mmkv-serve``: an OpenAI-compatible HTTP server over one model (``app.py``; requests parsed in ``protocol.py``,
counted in ``metrics.py``; command line in ``cli.py``)."""

from .app import create_app
from .protocol import APIError, Limits

__all__ = ["APIError", "Limits", "create_app"]
