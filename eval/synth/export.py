"""Held-out sets from the generators, written in the public layouts the eval tasks read (``mmkv-eval ... --data``):

* ``coco_caption/``: ``annotations.json`` (COCO's ``images`` / ``annotations`` with captions) and ``images/*.jpg``
  from scenes, charts and text cards;
* ``docvqa/``: ``val_v1.0.json`` (DocVQA's ``data`` rows: questionId, question, image, docId, answers) and
  ``documents/*.png``;
* ``mmbench_video/``: ``MMBench-Video.tsv`` (index, video, video_type, question, answer, dimensions, video_path)
  and ``video/<name>.mp4`` (H.264 when the PyAV build has it, else MPEG-4 part 2).

    python -m eval.synth.export --out data/synth-val --coco 200 --docvqa 200 --video 60 --seed 1000

Any seed gives held-out sets: ``generate`` seeds item i of a kind with ``crc32("<seed>/<kind>/<i>")`` (under 2**32),
while the trainer (``eval/train/towers.py``) seeds every item from a string (``random.Random("mmkv-train/...")``,
a SHA-512-derived seed far above 2**32), so no training item shares a random stream with an exported one. 1000+
is the convention for the published sets.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from .make import generate

DIMENSION = {"move": "Object Motion", "appear": "Counting", "disappear": "Counting"}


def write_coco(root: Path, n: int, seed: int) -> int:
    (root / "images").mkdir(parents=True, exist_ok=True)
    kinds = ("scene", "chart", "text")
    images, anns = [], []
    for k, kind in enumerate(kinds):
        for j, it in enumerate(generate(kind, n // len(kinds) + (k < n % len(kinds)), seed)):
            iid = len(images) + 1
            name = f"{iid:012d}.jpg"
            it.image.save(root / "images" / name, quality=95)
            images.append({"id": iid, "file_name": name, "width": it.image.width, "height": it.image.height,
                           "source": f"eval.synth {kind} seed={seed} item={j}"})
            anns.append({"id": len(anns) + 1, "image_id": iid, "caption": it.caption})
    (root / "annotations.json").write_text(json.dumps({"images": images, "annotations": anns}, indent=1))
    return len(images)


def write_docvqa(root: Path, n: int, seed: int) -> int:
    (root / "documents").mkdir(parents=True, exist_ok=True)
    rows = []
    for j, it in enumerate(generate("document", n, seed)):
        name = f"doc_{j:05d}.png"
        it.image.save(root / "documents" / name)
        for q, a in it.qa:
            rows.append({"questionId": len(rows) + 1, "question": q, "question_types": [it.meta["type"]],
                         "image": f"documents/{name}", "docId": j + 1, "answers": [a], "data_split": "val"})
    doc = {"dataset_name": "docvqa", "dataset_version": f"mmkv-synth-seed{seed}", "dataset_split": "val",
           "data": rows}
    (root / "val_v1.0.json").write_text(json.dumps(doc, indent=1))
    return len(rows)


def write_mp4(path: Path, frames, fps: int = 4) -> None:
    import av
    import numpy as np

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as out:
        st = out.add_stream(codec, rate=fps)
        st.width, st.height, st.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        for im in frames:
            for pkt in st.encode(av.VideoFrame.from_ndarray(np.asarray(im.convert("RGB")), format="rgb24")):
                out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)


def write_mmbench_video(root: Path, n: int, seed: int) -> int:
    (root / "video").mkdir(parents=True, exist_ok=True)
    rows = []
    for j, it in enumerate(generate("clip", n, seed)):
        name = f"clip_{j:05d}"
        write_mp4(root / "video" / f"{name}.mp4", it.frames)
        for q, a in it.qa:
            rows.append({"index": len(rows), "video": name, "video_type": "synthetic", "question": q, "answer": a,
                         "dimensions": json.dumps([DIMENSION[it.meta["type"]]]), "video_path": f"video/{name}.mp4"})
    with open(root / "MMBench-Video.tsv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t")
        w.writeheader()
        w.writerows(rows)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.synth.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--coco", type=int, default=200, help="images")
    ap.add_argument("--docvqa", type=int, default=200, help="documents (several questions each)")
    ap.add_argument("--video", type=int, default=60, help="clips (several questions each)")
    ap.add_argument("--seed", type=int, default=1000)
    args = ap.parse_args(argv)
    n1 = write_coco(args.out / "coco_caption", args.coco, args.seed)
    n2 = write_docvqa(args.out / "docvqa", args.docvqa, args.seed)
    n3 = write_mmbench_video(args.out / "mmbench_video", args.video, args.seed)
    print(f"{args.out}: {n1} captioned images, {n2} document questions, {n3} video questions (seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
