"""Chat examples from ``assets/``: one per image and video found there, plus a text-only one."""

from __future__ import annotations

import json
from pathlib import Path

from mmkv.ui.uploads import IMAGE_EXTS, VIDEO_EXTS

ASSETS = Path(__file__).resolve().parents[2] / "assets"
TEXT_PROMPT = "In two sentences, what does a key-value cache store in a transformer?"
MAX_EXAMPLES = 6


def prompt_for(path: Path, default: str) -> str:
    """A sidecar ``<name>.txt`` or an entry in ``assets/prompts.json`` overrides the default question."""
    side = path.with_suffix(".txt")
    if side.is_file():
        return side.read_text().strip() or default
    table = ASSETS / "prompts.json"
    if table.is_file():
        try:
            data = json.loads(table.read_text())
            if isinstance(data, dict) and isinstance(data.get(path.name), str):
                return data[path.name]
        except ValueError:
            pass
    return default


def _files(folder: Path, exts) -> list[Path]:
    return sorted(p for p in folder.glob("*") if p.suffix.lower() in exts) if folder.is_dir() else []


def collect(root: Path | None = None) -> list[dict]:
    """Text, then single images, a two-image turn and a video, from ``assets/images`` and ``assets/videos``."""
    root = Path(root or ASSETS)
    images, videos = _files(root / "images", IMAGE_EXTS), _files(root / "videos", VIDEO_EXTS)
    out = [{"text": TEXT_PROMPT, "files": []}]
    for p in images[:3]:
        out.append({"text": prompt_for(p, "Hello! What do you see?"), "files": [str(p)]})
    if len(images) >= 2:
        out.append({"text": "What do these two images have in common?", "files": [str(p) for p in images[:2]]})
    for p in videos[:1]:
        out.append({"text": prompt_for(p, "What happens in this video?"), "files": [str(p)]})
    return out[:MAX_EXAMPLES]
