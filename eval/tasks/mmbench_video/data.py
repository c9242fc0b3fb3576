"""MMBench-Video in the layout of the `opencompass/MMBench-Video` dataset repo: `MMBench-Video.tsv` (index, video,
video_type, question, answer, dimensions, video_path) beside `video/<video>.mp4`. The hub repo ships the videos
as pickled {name: mp4 bytes} files under `video_pkl/`; they are unpacked once into `video/`."""

from __future__ import annotations

import ast
import csv
import io
import json
import pickle
from pathlib import Path

TSV = "MMBench-Video.tsv"
HUB = "opencompass/MMBench-Video"


class _BytesOnly(pickle.Unpickler):
    """The video pickles hold only a dict of str -> bytes; refuse anything that would run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a video pickle")


def unpack_video_pickles(root: Path) -> None:
    src, dst = root / "video_pkl", root / "video"
    if not src.is_dir() or (dst.is_dir() and any(dst.iterdir())):
        return
    dst.mkdir(exist_ok=True)
    for pkl in sorted(src.iterdir()):
        with open(pkl, "rb") as f:
            videos = _BytesOnly(f).load()
        for name, payload in videos.items():
            (dst / f"{name}.mp4").write_bytes(payload)


def parse_dimensions(text: str) -> list[str]:
    text = text.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = ast.literal_eval(text)  # the official TSV writes Python list literals
    return [value] if isinstance(value, str) else list(value)


def read_tsv(root: Path) -> list[dict]:
    path = root / TSV if root.is_dir() else root
    base = path.parent
    rows = list(csv.DictReader(io.StringIO(path.read_text()), delimiter="\t"))
    samples = []
    for r in rows:
        rel = r.get("video_path") or f"video/{r['video']}.mp4"
        samples.append({"id": str(r["index"]), "video": str((base / rel).resolve()), "video_name": r["video"],
                        "question": r["question"], "answer": r["answer"],
                        "dimensions": parse_dimensions(r["dimensions"])})
    return samples


def load(data: str | None) -> list[dict]:
    if data:
        return read_tsv(Path(data))
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportError("reading MMBench-Video from the hub needs huggingface_hub; or pass --data") from None
    root = Path(snapshot_download(repo_id=HUB, repo_type="dataset"))
    unpack_video_pickles(root)
    return read_tsv(root)
