"""What visual-cache quantization does to the answers of a demo VLM whose tower can see (issue 28, item 4).

    python -m eval.studies.demo_quality --model demo-llava --tower assets/demo_towers/demo-llava --n 200 \\
        --device cuda --out results/demo_quality_llava.json

Held-out items come from ``eval.synth.generate(kind, n, seed)`` with ``--seed`` >= 1000. They can never be training
items whatever the seed: ``generate`` seeds item i with ``crc32("<seed>/<kind>/<i>")`` (< 2**32), the trainer seeds
every item from a string (a SHA-512-sized integer; ``eval/train/towers.py``). Each question runs through mmkv's
``Engine`` (greedy, batched) under every spec of ``SPECS``. Scores: exact and normalized match of short answers per
category (shape, colour, count, position, text reading, chart), DocVQA's ANLS on documents
(``eval.tasks.docvqa.anls``), video QA accuracy (normalized match; clips written to mp4 and read back through
``mmkv.models.video`` as an uploaded clip is, when PyAV is installed, else their frames), COCO caption metrics
(``eval.tasks.coco_caption.metrics``: CIDEr and the rest) on scene, chart and text-card captions. Tables follow
CalibQuant's Tables 1-3 (``eval.tables.render``), plus a short-answer table and each spec's share of the fp16
score. ``--after-media``: each question is fed over the stored cache instead, as a follow-up question is
(``run_after_media``).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from ..jsonout import save_json

# 1-bit rows: the default (the authors' clip, calibrated), without calibration, and without the clip (the paper's text)
SPECS = ["fp16", "visual=calibquant:bits=1", "visual=calibquant:bits=1,calibrate=false",
         "visual=calibquant:bits=1,clip=off", "visual=calibquant:bits=2", "visual=kivi:bits=2",
         # a prompt's text here is ~50 tokens: under the default window (128) XQuant would store none of it
         "visual=calibquant:bits=1 text=xquant:kq=28,vq=2,km=30,vm=14 window=16"]
CATEGORIES = ("shape", "colour", "count", "position", "text", "chart")
SCENE = CATEGORIES[:4]  # issue 28's 90% target counts these: "held-out shape/colour/count/position questions"
CAPTION_PROMPT = "Describe the image in one sentence."
VQA_KINDS = {"scene": 0.5, "text": 0.25, "chart": 0.25}
CAPTION_KINDS = ("scene", "chart", "text")
MAX_NEW = {"vqa": 16, "doc": 16, "video": 16, "caption": 48}


def category(kind: str, question: str) -> str:
    q = question.lower()
    if kind == "chart":
        return "chart"
    if kind == "text":
        return "colour" if "colour" in q else "count" if q.startswith("how many") else "text"
    if q.startswith("how many"):
        return "count"
    if "colour" in q:
        return "colour"
    if q.startswith("is there"):
        return "shape"
    return "position"  # left of / above / on the left or the right


def normalize_answer(text: str) -> str:
    """Case, surrounding quotes and punctuation, articles and whitespace do not count ("The word is red." != "red")."""
    t = str(text).strip().lower()
    t = re.sub(r"^[\"'`]+|[\"'`.!?,;:]+$", "", t).strip()
    t = re.sub(r"^(a|an|the)\s+", "", t)
    return " ".join(t.split())


def questions(task: str, n: int, seed: int) -> list[dict]:
    """``n`` samples of ``task`` ("vqa", "doc", "video", "caption") from held-out items of ``seed``: each
    ``{"id", "kind", "media", "question", "answer"/"refs", "category"}``; every question of an item is used."""
    from eval.synth import generate

    out: list[dict] = []
    if task == "caption":
        per = [n // len(CAPTION_KINDS) + (k < n % len(CAPTION_KINDS)) for k in range(len(CAPTION_KINDS))]
        for kind, m in zip(CAPTION_KINDS, per, strict=True):
            for j, it in enumerate(generate(kind, m, seed)):
                out.append({"id": f"{kind}/{j}", "kind": kind, "media": it.image, "question": CAPTION_PROMPT,
                            "refs": [it.caption], "category": "caption"})
        return out
    if task == "vqa":
        for kind, share in VQA_KINDS.items():
            want = max(1, round(n * share))
            got = []
            for j, it in enumerate(generate(kind, want, seed)):  # <= want items: each has >= 1 question
                got += [{"id": f"{kind}/{j}/{k}", "kind": kind, "media": it.image, "question": q, "answer": a,
                         "category": category(kind, q), "meta": it.meta, "caption": it.caption}
                        for k, (q, a) in enumerate(it.qa)]
            out += _spread(got, want)
        return out
    kind = {"doc": "document", "video": "clip"}[task]
    got = []
    for j, it in enumerate(generate(kind, n, seed)):
        media = it.frames if kind == "clip" else it.image
        got += [{"id": f"{kind}/{j}/{k}", "kind": kind, "media": media, "question": q, "answer": a,
                 "category": it.meta["type"]} for k, (q, a) in enumerate(it.qa)]
    return _spread(got, n)


def _spread(samples: list[dict], n: int) -> list[dict]:
    """``n`` samples spread evenly over the list (so every item and question type shows up, not the first items')."""
    if len(samples) <= n:
        return samples
    return [samples[round(i * len(samples) / n)] for i in range(n)]


def _media_item(sample: dict, video_dir: Path | None) -> dict:
    if sample["kind"] != "clip":
        return {"type": "image", "image": sample["media"]}
    if video_dir is None:
        return {"type": "video", "frames": sample["media"]}
    from eval.synth.export import write_mp4

    path = video_dir / (sample["id"].replace("/", "_").rsplit("_", 1)[0] + ".mp4")
    if not path.is_file():
        write_mp4(path, sample["media"])
    return {"type": "video", "video": str(path)}


def run(engine, samples: list[dict], specs: list[str], batch: int, max_new_tokens: int,
        video_dir: Path | None = None, video_frames: int | None = None) -> dict[str, tuple[list[str], float]]:
    """``{spec: (greedy answers of samples, mean KV cache MiB per sample)}``. Each batch of prompts is prefilled
    once for all specs (``Engine.generate_many``: the same answers as a run per spec, one forward instead of one a
    spec)."""
    preds = {s: [] for s in specs}
    mib = dict.fromkeys(specs, 0.0)
    for s in range(0, len(samples), batch):
        chunk = samples[s:s + batch]
        chats = [[{"role": "user", "content": [_media_item(x, video_dir), {"type": "text", "text": x["question"]}]}]
                 for x in chunk]
        outs = engine.generate_many(chats, specs, max_new_tokens=max_new_tokens, video_frames=video_frames)
        for spec, out in zip(specs, outs, strict=True):
            preds[spec] += [t.strip() for t in out.text]
            mib[spec] += sum(out.stats["cache_bytes"].values()) / 2 ** 20
    return {spec: (preds[spec], mib[spec] / max(1, len(samples))) for spec in specs}


def run_after_media(engine, samples: list[dict], specs: list[str], max_new_tokens: int, video_dir: Path | None = None,
                    video_frames: int | None = None) -> dict[str, tuple[list[str], float]]:
    """``run`` with each question read over the stored cache (``--after-media``). A prompt's own attention is exact
    under every spec, so in ``run`` the question, sent with its media, reads fp16 keys and values, and so does the
    first answer token: a one-word answer never reads the quantized cache. Here the media alone are prefilled first
    (one forward for every spec, one answer token), then the same prompt as ``run``'s goes through the engine's
    multi-turn path (``past=``): the cache keeps the tokens both prompts share (through the media), and the question
    is fed over it, reading the visual tokens as the spec stored them, as a follow-up question about an uploaded
    image does. One conversation at a time."""
    preds = {s: [] for s in specs}
    mib = dict.fromkeys(specs, 0.0)
    for x in samples:
        media = _media_item(x, video_dir)
        firsts = engine.generate_many([[{"role": "user", "content": [media]}]], specs, max_new_tokens=1,
                                      video_frames=video_frames)
        chat = [[{"role": "user", "content": [media, {"type": "text", "text": x["question"]}]}]]
        for spec, past in zip(specs, firsts, strict=True):
            out = engine.generate(chat, spec, past=past, max_new_tokens=max_new_tokens, video_frames=video_frames)
            preds[spec].append(out.text[0].strip())
            mib[spec] += sum(out.stats["cache_bytes"].values()) / 2 ** 20
    return {spec: (preds[spec], mib[spec] / max(1, len(samples))) for spec in specs}


def score(task: str, samples: list[dict], preds: list[str]) -> tuple[dict, list[str]]:
    notes: list[str] = []
    if task == "caption":
        # without pycocoevalcap (a GPU box) the predictions are kept and scored later: ``--rescore FILE``
        try:
            from eval.tasks.coco_caption.metrics import caption_scores

            return caption_scores({x["id"]: x["refs"] for x in samples},
                                  {x["id"]: p for x, p in zip(samples, preds, strict=True)})
        except ImportError as e:
            return {"CIDEr": None}, [str(e)]
    exact = [p.strip() == x["answer"] for x, p in zip(samples, preds, strict=True)]
    norm = [normalize_answer(p) == normalize_answer(x["answer"]) for x, p in zip(samples, preds, strict=True)]
    # the answer's words first, then anything: tells an answer read right but not ended (no <|im_end|>) from one
    # read wrong, which exact and normalized match both count as wrong
    first = [normalize_answer(p).split()[:len(normalize_answer(x["answer"]).split())]
             == normalize_answer(x["answer"]).split() for x, p in zip(samples, preds, strict=True)]
    m = {"exact": sum(exact) / len(exact), "normalized": sum(norm) / len(norm), "first words": sum(first) / len(first)}
    if task == "doc":
        from eval.tasks.docvqa.anls import anls

        m = {"ANLS": anls(preds, [[x["answer"]] for x in samples]), **m}
    cats = sorted({x["category"] for x in samples}, key=lambda c: (CATEGORIES + (c,)).index(c))
    for c in cats:
        idx = [i for i, x in enumerate(samples) if x["category"] == c]
        m[f"{c} exact"] = sum(exact[i] for i in idx) / len(idx)
        m[f"{c} normalized"] = sum(norm[i] for i in idx) / len(idx)
        m[f"{c} n"] = len(idx)
    scene = [i for i, x in enumerate(samples) if x.get("category") in SCENE]
    if task == "vqa" and scene:
        m["scene exact"] = sum(exact[i] for i in scene) / len(scene)
        m["scene normalized"] = sum(norm[i] for i in scene) / len(scene)
        m["scene n"] = len(scene)
    return m, notes


HEADLINE = {"vqa": "normalized", "doc": "ANLS", "video": "normalized", "caption": "CIDEr"}
TITLES = {"caption": "Table 1 layout: captions of generated scenes, charts and text cards (COCO metrics)",
          "doc": "Table 2 layout: generated documents, DocVQA-style ANLS",
          "video": "Table 3 layout: generated clips, video QA accuracy (normalized match)",
          "vqa": "Short answers per category (exact / normalized match)"}


def tables(result: dict) -> str:
    from eval.tables import render

    cfg = {"model": result["config"]["model"], "synthetic": result["config"]["synthetic"]}
    parts = []
    for task, per in result["tasks"].items():
        fp16 = per["fp16"]["metrics"].get(HEADLINE[task])
        keys = [k for k in per["fp16"]["metrics"] if not k.endswith(" n")]
        if task == "caption":
            keys = [k for k in keys if k != "METEOR" or per["fp16"]["metrics"].get(k) is not None]
        rows = []
        for spec, r in per.items():
            v = r["metrics"].get(HEADLINE[task])
            share = v / fp16 if (v is not None and fp16) else None
            rows.append({"spec": spec, "metrics": {**r["metrics"], "of fp16": share}, "kv_mib": r["kv_mib"],
                         "n": r["n"]})
        notes = per["fp16"].get("notes", [])
        title = TITLES[task] + (", the question read over the stored cache (--after-media)"
                                if result["config"].get("after_media") else "")
        md, _ = render(title, cfg, keys + ["of fp16"], rows, notes)
        parts.append(md)
    return "\n".join(parts)


def rescore(path: Path) -> dict:
    """A result file scored again from its stored predictions (the held-out samples are regenerated from its
    ``n`` and ``seed``): captions from a box without pycocoevalcap, or a metric changed after the run."""
    result = json.loads(path.read_text())
    cfg = result["config"]
    for task, per in result["tasks"].items():
        samples = questions(task, cfg["n"], cfg["seed"])
        for spec, row in per.items():
            if [p["id"] for p in row["predictions"]] != [x["id"] for x in samples]:
                raise ValueError(f"{path}: the {task} predictions of {spec!r} are not the held-out samples of "
                                 f"n={cfg['n']} seed={cfg['seed']}")
            row["metrics"], row["notes"] = score(task, samples, [p["prediction"] for p in row["predictions"]])
    result["tables"] = tables(result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.studies.demo_quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo-llava", choices=["demo-llava", "demo-internvl"])
    ap.add_argument("--tower", default="auto", help="trained tower folder, 'auto' (shipped) or 'random'")
    ap.add_argument("--n", type=int, default=200, help="questions per task (captions: images)")
    ap.add_argument("--seed", type=int, default=1000, help="held-out seed (>= 1000)")
    ap.add_argument("--tasks", default="vqa,doc,video,caption")
    ap.add_argument("--spec", action="append", help="cache spec (repeatable); default: SPECS")
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=int, default=None, help="questions per Engine call (default 16 GPU, 4 CPU)")
    ap.add_argument("--video", choices=["mp4", "frames"], default=None,
                    help="clips as mp4 files read back (default when PyAV is installed) or as frames")
    ap.add_argument("--video-frames", type=int, default=None,
                    help="frames a clip is sampled to (default: the model's own, 8 llava / 16 internvl)")
    ap.add_argument("--after-media", action="store_true",
                    help="prefill each prompt through its media first, so that the question reads the stored "
                         "(quantized) visual cache (run_after_media); default: the papers' protocol, the question's "
                         "attention exact")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rescore", type=Path, default=None, metavar="FILE",
                    help="score a result file again from its predictions (written to --out, else in place)")
    args = ap.parse_args(argv)
    if args.rescore:
        result = rescore(args.rescore)
        print(result["tables"])
        save_json(args.out or args.rescore, result)
        return 0
    if args.seed < 1000:
        ap.error("--seed must be >= 1000 (the published held-out convention)")
    import importlib.util

    import torch

    from mmkv.engine import Engine
    from mmkv.models import load_model

    lm = load_model(args.model, device=args.device, tower=args.tower)
    engine = Engine(lm)
    on_gpu = engine.device.type == "cuda"
    batch = args.batch or (16 if on_gpu else 4)
    video = args.video or ("mp4" if importlib.util.find_spec("av") else "frames")
    specs = args.spec or SPECS
    if specs[0] != "fp16":
        specs = ["fp16", *[s for s in specs if s != "fp16"]]
    result = {"config": {"model": args.model, "tower": args.tower, "synthetic": lm.adapter.synthetic,
                         "n": args.n, "seed": args.seed, "specs": specs, "device": str(engine.device),
                         "dtype": str(next(lm.model.parameters()).dtype), "batch": batch, "video": video,
                         "video_frames": args.video_frames or lm.adapter.default_video_frames,
                         "after_media": args.after_media, "torch": torch.__version__}, "tasks": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        video_dir = Path(tmp) if video == "mp4" else None
        for task in args.tasks.split(","):
            samples = questions(task, args.n, args.seed)
            result["tasks"][task] = {}
            t = time.perf_counter()
            if args.after_media:
                answers = run_after_media(engine, samples, specs, MAX_NEW[task], video_dir, args.video_frames)
            else:
                answers = run(engine, samples, specs, batch, MAX_NEW[task], video_dir, args.video_frames)
            result.setdefault("task_seconds", {})[task] = time.perf_counter() - t  # every spec, one prefill a batch
            for spec in specs:
                preds, mib = answers[spec]
                metrics, notes = score(task, samples, preds)
                result["tasks"][task][spec] = {
                    "metrics": metrics, "notes": notes, "kv_mib": mib, "n": len(samples),
                    "predictions": [{"id": x["id"], "question": x["question"],
                                     "gold": x.get("answer", x.get("refs")), "prediction": p}
                                    for x, p in zip(samples, preds, strict=True)]}
                print(f"[{task}] {spec}: {HEADLINE[task]} {metrics.get(HEADLINE[task])}", flush=True)
            print(f"[{task}] {len(specs)} specs in {time.perf_counter() - t:.0f} s", flush=True)
    result["seconds"] = time.perf_counter() - t0
    result["tables"] = tables(result)
    print(result["tables"])
    save_json(args.out, result)
    if args.out:
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
