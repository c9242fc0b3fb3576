"""How the studies and benchmarks write their JSON (``--out FILE``): parents created, indented, one place."""

from __future__ import annotations

import json
from pathlib import Path


def save_json(path: Path | None, doc: dict) -> None:
    """Write ``doc`` to ``path``; nothing when no ``--out`` was given."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
