"""Pick the app's example images and clip from generated items the trained demo VLMs answer right (issue 28, item 5).

    python -m eval.studies.demo_examples --seed 7000 --out assets

Candidates are ``eval.synth`` items of seed ``--seed`` (outside the held-out seeds the quality study reports and,
like them, never training items: see eval/studies/demo_quality.py). An image question is kept when both
``demo-llava`` and ``demo-internvl`` answer it right with an fp16 cache (normalized match, greedy), a clip question
when every demo that takes video does; questions whose answer is 0, yes or no are not
candidates (a blind guess gets them). The first ``--images``
scenes/documents/charts of different kinds that pass and the first clip that passes are written to
``<out>/images/synth_*.png`` and ``<out>/videos/synth_*.mp4``, their questions to ``<out>/prompts.json`` (what the
app asks of them), and every answer, including the 1-bit CalibQuant one the app shows beside it, to
``<out>/examples.json``. So the examples are chosen because the demos get them right; the quality study
(docs/BENCHMARKS.md) says how often that happens on held-out items.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

IMAGE_KINDS = ("scene", "chart", "document", "text")
ONE_BIT = "visual=calibquant:bits=1"
TRIVIAL = {"0", "no", "yes"}  # answers a blind guess gets right: an example must show the tower seeing


def _ask(engine, media: dict, question: str, spec: str) -> str:
    chat = [{"role": "user", "content": [media, {"type": "text", "text": question}]}]
    return engine.generate(chat, spec=spec, max_new_tokens=16).text[0].strip()


def candidates(seed: int, per_kind: int):
    """(kind, item index, item, question, answer) of ``per_kind`` items of each image kind and of clips."""
    from eval.studies.demo_quality import normalize_answer as normalize
    from eval.synth import generate

    for kind in (*IMAGE_KINDS, "clip"):
        for i, it in enumerate(generate(kind, per_kind, seed)):
            for q, a in it.qa:
                if normalize(a) not in TRIVIAL:
                    yield kind, i, it, q, a


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.studies.demo_examples", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=7000)
    ap.add_argument("--per-kind", type=int, default=6, help="items of each kind tried")
    ap.add_argument("--images", type=int, default=3, help="example images to keep (at most one per kind)")
    ap.add_argument("--out", type=Path, default=Path("assets"))
    args = ap.parse_args(argv)

    from eval.studies.demo_quality import normalize_answer
    from eval.synth.export import write_mp4
    from mmkv.engine import Engine
    from mmkv.models import load_model

    engines = {m: Engine(load_model(m)) for m in ("demo-llava", "demo-internvl")}
    kept, kinds_kept, record = [], set(), []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, i, it, q, a in candidates(args.seed, args.per_kind):
            is_clip = kind == "clip"
            if (is_clip and any(k == "clip" for k, *_ in kept)) or (not is_clip and (
                    kind in kinds_kept or sum(k != "clip" for k, *_ in kept) >= args.images)):
                continue
            if is_clip:  # asked as the app reads an upload: the mp4 file, decoded and sampled by mmkv.models.video
                clip_path = Path(tmp) / f"{kind}_{i}.mp4"
                write_mp4(clip_path, it.frames)
                media = {"type": "video", "video": str(clip_path)}
            else:
                media = {"type": "image", "image": it.image}
            need = ["demo-internvl"] if is_clip and not engines["demo-llava"].adapter.takes_video else list(engines)
            answers = {m: {"fp16": _ask(engines[m], media, q, "fp16")} for m in need}
            ok = all(normalize_answer(answers[m]["fp16"]) == normalize_answer(a) for m in need)
            print(f"{kind}/{i}: {q!r} -> {a!r}: " + ", ".join(f"{m} {v['fp16']!r}" for m, v in answers.items()),
                  "KEEP" if ok else "", flush=True)
            if not ok:
                continue
            for m in need:
                answers[m][ONE_BIT] = _ask(engines[m], media, q, ONE_BIT)
            kept.append((kind, i, it, q, a))
            kinds_kept.add(kind)
            record.append({"kind": kind, "seed": args.seed, "index": i, "question": q, "answer": a,
                           "checked_with": need, "answers": answers})
            if len(kept) == args.images + 1 and any(k == "clip" for k, *_ in kept):
                break
    prompts_path = args.out / "prompts.json"
    prompts = json.loads(prompts_path.read_text()) if prompts_path.is_file() else {}
    for rec, (kind, i, it, q, _) in zip(record, kept, strict=True):
        if kind == "clip":
            path = args.out / "videos" / f"synth_{kind}_{args.seed}_{i}.mp4"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_mp4(path, it.frames)
        else:
            path = args.out / "images" / f"synth_{kind}_{args.seed}_{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            it.image.save(path)
        rec["file"] = str(path.relative_to(args.out))
        prompts[path.name] = q
    prompts_path.write_text(json.dumps(prompts, indent=1) + "\n")
    (args.out / "examples.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"kept {len(record)}: " + ", ".join(r["file"] for r in record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
