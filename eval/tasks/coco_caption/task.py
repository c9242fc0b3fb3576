"""COCO Caption (val 2017, as lmms-eval's coco2017_cap_val): image -> one-sentence caption, scored by BLEU-1..4,
METEOR, ROUGE-L, CIDEr (+ SPICE on request) against the reference captions (CalibQuant Tables 1 and 4)."""

from __future__ import annotations

from pathlib import Path

from ...runtime import Runtime, generate
from ...sources import HubRows, find_file, load_hub, read_json
from .metrics import ORDER, caption_scores

HUB = ("lmms-lab/COCO-Caption2017", None, "val")
PROMPT = "Provide a one-sentence caption for the provided image."  # lmms-eval coco_doc_to_text
ANNOTATION_NAMES = ["annotations.json", "captions_val2017.json", "annotations/captions_val2017.json"]


def _local(data: Path, image_dir: str | None) -> list[dict]:
    ann_path = find_file(data, ANNOTATION_NAMES)
    ann = read_json(ann_path)
    if image_dir:
        root = Path(image_dir)
    else:
        base = data if data.is_dir() else ann_path.parent
        root = next((base / d for d in ("images", "val2017") if (base / d).is_dir()), base)
    caps: dict[int, list[str]] = {}
    for a in ann["annotations"]:
        caps.setdefault(a["image_id"], []).append(a["caption"])
    return [{"id": str(im["id"]), "image": str(root / im["file_name"]), "refs": caps.get(im["id"], [])}
            for im in sorted(ann["images"], key=lambda im: im["id"]) if im["id"] in caps]


def load_samples(opts: dict, rt: Runtime) -> list[dict]:
    if opts.get("data"):
        return _local(Path(opts["data"]), opts.get("image_dir"))
    repo, name, split = HUB
    hub = HubRows(load_hub(repo, split, name), "image")
    rt.cache["coco_hub"] = hub
    # lmms-eval: question_id is the image file name, e.g. "000000397133.jpg" -> image id 397133
    return [{"id": str(int(r["question_id"].split("_")[-1].split(".")[0])), "refs": list(r["answer"]), "row": i}
            for i, r in enumerate(hub.row(i) for i in range(len(hub)))]


def run_sample(rt: Runtime, sample: dict, spec: str, opts: dict) -> dict:
    image = sample["image"] if "image" in sample else rt.cache["coco_hub"].media(sample["row"]).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": PROMPT}]}]
    rec = generate(rt, messages, spec, opts["max_new_tokens"])
    rec["refs"] = sample["refs"]
    return rec


def score(records: list[dict], baseline: list[dict], opts: dict) -> tuple[dict, list[str]]:
    if not records:
        return {}, []
    refs = {r["id"]: r["refs"] for r in records}
    preds = {r["id"]: r["prediction"] for r in records}
    return caption_scores(refs, preds, spice=opts.get("spice", False))


def metrics(opts: dict) -> list[str]:
    return [m for m in ORDER if m != "SPICE" or opts.get("spice")]


TASK = {
    "title": "COCO Caption (val 2017)",
    "paper": "CalibQuant Tables 1 and 4",
    "load": load_samples, "run": run_sample, "score": score,
    "metrics": metrics, "digits": 3, "needs": "images",
    "defaults": {"max_new_tokens": 64},  # lmms-eval coco2017_cap_val generation_kwargs
    "options": [
        (["--image-dir"], {"help": "image folder for a local COCO annotation JSON (default: beside it)"}),
        (["--spice"], {"action": "store_true", "help": "also compute SPICE (needs Java + Stanford CoreNLP jar)"}),
    ],
}
