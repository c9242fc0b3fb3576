"""Chat examples from ``assets/``: one per image and video found there, plus a text-only one.

Generated examples (``synth_*``, written by ``python -m eval.studies.demo_examples``: scenes, charts, documents and
clips the trained demo VLMs answer right, their questions in ``prompts.json``) come before the photographs, which
only a real checkpoint can describe."""

from __future__ import annotations

import json
from pathlib import Path

from mmkv.ui.uploads import IMAGE_EXTS, VIDEO_EXTS

ASSETS = Path(__file__).resolve().parents[2] / "assets"
# Long enough (about 320 prompt tokens on SmolLM2) to leave the default 128-token fp16 window and 4 sinks, so the
# first example shows what quantizing the older tokens saves; a one-line question would sit wholly in the window.
PASSAGE = (
    "When a transformer writes text, it produces one token at a time. For each new token, every attention layer "
    "compares the new query with the keys of all earlier tokens and mixes their values. Recomputing those keys and "
    "values at every step would repeat the same work again and again, so inference engines keep them in memory: "
    "this is the key-value cache. Its size grows with the number of layers, the number of key-value heads, the head "
    "dimension and, above all, the number of tokens in the context. A single high-resolution image can add hundreds "
    "or thousands of visual tokens, and a video many times more, so for vision-language models the cache often "
    "takes more memory than the weights themselves. Reading it also dominates the time of each decoding step, "
    "because the whole cache must be streamed from memory for every new token. Quantizing the cache stores each key "
    "and value with fewer bits, for example two bits for text tokens and a single bit for visual tokens, together "
    "with a scale and a zero point per group. The most recent tokens and the first few sink tokens usually stay in "
    "full precision, because attention relies on them most. The cost is a small error in the attention scores, "
    "which calibration and careful grouping try to keep from changing the answer."
)
TEXT_PROMPT = ("Read this passage, then answer the question after it.\n\n" + PASSAGE +
               "\n\nQuestion: in two sentences, why does quantizing the key-value cache help vision-language models most?")
MAX_EXAMPLES = 6
GENERATED = "synth_"  # files written by eval.studies.demo_examples


def prompt_for(path: Path, default: str) -> str:
    """A sidecar ``<name>.txt`` or an entry in the assets folder's ``prompts.json`` overrides the default question."""
    side = path.with_suffix(".txt")
    if side.is_file():
        return side.read_text().strip() or default
    table = path.parent.parent / "prompts.json"
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


def _generated_first(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: not p.name.startswith(GENERATED))


def collect(root: Path | None = None) -> list[dict]:
    """Text, then single images, a two-photo turn and a video, from ``assets/images`` and ``assets/videos``."""
    root = Path(root or ASSETS)
    images = _generated_first(_files(root / "images", IMAGE_EXTS))
    videos = _generated_first(_files(root / "videos", VIDEO_EXTS))
    out = [{"text": TEXT_PROMPT, "files": []}]
    for p in images[:3]:
        out.append({"text": prompt_for(p, "Hello! What do you see?"), "files": [str(p)]})
    photos = [p for p in images if not p.name.startswith(GENERATED)]
    if len(photos) >= 2:
        out.append({"text": "What do these two images have in common?", "files": [str(p) for p in photos[:2]]})
    for p in videos[:1]:
        out.append({"text": prompt_for(p, "What happens in this video?"), "files": [str(p)]})
    return out[:MAX_EXAMPLES]
