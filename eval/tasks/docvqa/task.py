"""DocVQA validation: document image + question -> short answer, scored by ANLS (CalibQuant Table 2)."""

from __future__ import annotations

from pathlib import Path

from ...runtime import Runtime, generate
from ...sources import HubRows, find_file, load_hub, read_json
from .anls import anls, question_score

HUB = ("lmms-lab/DocVQA", "DocVQA", "validation")
PROMPT = "\nAnswer the question using a single word or phrase."  # lmms-eval's default post_prompt


def load_samples(opts: dict, rt: Runtime) -> list[dict]:
    if opts.get("data"):
        path = find_file(Path(opts["data"]), ["val.json", "val_v1.0.json", "val_v1.0_withQT.json"])
        payload = read_json(path)
        rows = payload["data"] if isinstance(payload, dict) else payload
        return [{"id": str(r["questionId"]), "question": r["question"], "answers": list(r["answers"]),
                 "image": str(path.parent / r["image"])} for r in rows]
    repo, name, split = HUB
    hub = HubRows(load_hub(repo, split, name), "image")
    rt.cache["docvqa_hub"] = hub
    return [{"id": str(r["questionId"]), "question": r["question"], "answers": list(r["answers"]), "row": i}
            for i, r in enumerate(hub.row(i) for i in range(len(hub)))]


def run_sample(rt: Runtime, sample: dict, spec: str, opts: dict) -> dict:
    image = sample["image"] if "image" in sample else rt.cache["docvqa_hub"].media(sample["row"]).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": sample["question"] + PROMPT}]}]
    rec = generate(rt, messages, spec, opts["max_new_tokens"])
    rec["answers"] = sample["answers"]
    rec["anls"] = question_score(rec["prediction"], sample["answers"])
    return rec


def score(records: list[dict], baseline: list[dict], opts: dict) -> tuple[dict, list[str]]:
    value = anls([r["prediction"] for r in records], [r["answers"] for r in records]) if records else None
    return {"ANLS": value}, []


TASK = {
    "title": "DocVQA (validation), ANLS",
    "paper": "CalibQuant Table 2",
    "load": load_samples, "run": run_sample, "score": score,
    "metrics": ["ANLS"], "digits": 4, "needs": "images",
    "defaults": {"max_new_tokens": 128},  # lmms-eval docvqa_val
    "options": [],
}
