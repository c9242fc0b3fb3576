"""The ceiling a frozen SmolLM2 puts on the demo VLMs' short answers (issue 28): the held-out questions of
``demo_quality --tasks vqa``, answered by SmolLM2-135M-Instruct alone from a perfect text description of the image.

    python -m eval.studies.text_oracle --n 200 --out results/text_oracle.json

A trained tower never sees the question: its tokens must describe the image so that the frozen language model can
answer any question about it. Here the description is the generator's own ground truth, written out in words and
numbers (every object's colour, shape, size and pixel position; a chart's every value; a card's text), so the only
thing left between the question and the answer is the language model. Variants: ``plain`` (description, then the
question), ``terse`` (plus an instruction to answer with one word or number, since a tower's tokens can steer the
answer's form as well), ``shots`` (``terse`` after three worked examples of other, non-held-out images: a soft
prompt can hold those too), ``sorted`` (``shots`` with the objects listed left to right, which turns left/right
questions into reading order). Scored as ``demo_quality`` scores the VLMs (exact, normalized, first words; per
category), plus ``contains``: the gold answer appears among the answer's words (number words read as digits), a
lenient score that forgives any form, to bound the language model's reading, not its phrasing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..jsonout import save_json
from .demo_quality import CATEGORIES, normalize_answer, questions, score

TERSE = "Answer with one word or number."
VARIANTS = ("plain", "terse", "shots", "sorted")
SHOT_SEED = 7  # below 1000: never a held-out item
NUMBERS = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}


def _where(x: float, y: float, size: int) -> str:
    col = "left" if x < size / 3 else "right" if x > 2 * size / 3 else "centre"
    row = "top" if y < size / 3 else "bottom" if y > 2 * size / 3 else "middle"
    return f"{row} {col}, x={round(x)}, y={round(y)}"


def describe(kind: str, meta: dict, caption: str, by_x: bool = False) -> str:
    """Everything the generator knows about the image that its questions ask about, in words (pixels for
    positions: x grows to the right, y downwards)."""
    if kind == "scene":
        objs = sorted(meta["objects"], key=lambda o: o["x"]) if by_x else meta["objects"]
        size = meta["size"]
        parts = [f"a {o['size']} {o['colour']} {o['shape']} ({_where(o['x'], o['y'], size)})" for o in objs]
        order = ", listed from left to right" if by_x else ""
        return (f"A {size}x{size} pixel image (x grows to the right, y grows downwards) with a {meta['background']} "
                f"background and {len(objs)} shape{'s' if len(objs) > 1 else ''}{order}: " + "; ".join(parts) + ".")
    if kind == "chart":
        values = ", ".join(f"{lab} = {v}" for lab, v in zip(meta["labels"], meta["values"], strict=True))
        return f"A {meta['colour']} {meta['type']} chart with {len(meta['labels'])} categories: {values}."
    if kind == "text":
        return f'The text "{meta["text"]}" written in {meta["colour"]} on a {meta["background"]} background.'
    return caption


def samples_with_descriptions(n: int, seed: int, by_x: bool) -> list[dict]:
    samples = questions("vqa", n, seed)
    for x in samples:
        x["description"] = describe(x["kind"], x["meta"], x["caption"], by_x)
    return samples


def shots(by_x: bool) -> list[dict]:
    """Three worked examples (a scene, a chart, a text card) from a seed no held-out set uses, as earlier turns."""
    from eval.synth import generate

    turns = []
    for kind, k in (("scene", 2), ("chart", 0), ("text", 1)):
        it = generate(kind, 1, SHOT_SEED)[0]
        q, a = it.qa[min(k, len(it.qa) - 1)]
        turns += [{"role": "user", "content": f"Image: {describe(kind, it.meta, it.caption, by_x)}\n\n"
                                              f"Question: {q}\n{TERSE}"},
                  {"role": "assistant", "content": a}]
    return turns


def chat(x: dict, variant: str) -> list[dict]:
    text = f"Image: {x['description']}\n\nQuestion: {x['question']}"
    if variant == "plain":
        return [{"role": "user", "content": text}]
    turn = {"role": "user", "content": f"{text}\n{TERSE}"}
    return [turn] if variant == "terse" else [*shots(variant == "sorted"), turn]


def contains(pred: str, gold: str) -> bool:
    """The gold answer's words appear, in order, among the prediction's (number words as digits)."""
    def words(t: str) -> list[str]:
        t = "".join(c if c.isalnum() or c == "." else " " for c in normalize_answer(t))
        return [NUMBERS.get(w, w) for w in t.replace(". ", " ").rstrip(".").split()]

    g, p = words(gold), words(pred)
    return any(p[i:i + len(g)] == g for i in range(len(p) - len(g) + 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.studies.text_oracle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="the demo VLMs' language model")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1000, help="held-out seed (>= 1000), as demo_quality")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    from mmkv.engine import Engine
    from mmkv.models import load_model

    engine = Engine(load_model(args.model, device=args.device))
    result = {"config": {"model": args.model, "n": args.n, "seed": args.seed, "device": str(engine.device)},
              "variants": {}}
    t0 = time.perf_counter()
    for variant in variants:
        samples = samples_with_descriptions(args.n, args.seed, by_x=variant == "sorted")
        preds = []
        for s in range(0, len(samples), args.batch):
            chats = [chat(x, variant) for x in samples[s:s + args.batch]]
            out = engine.generate_many(chats, ["fp16"], max_new_tokens=16)[0]
            preds += [t.strip() for t in out.text]
        metrics, _ = score("vqa", samples, preds)
        hit = [contains(p, x["answer"]) for x, p in zip(samples, preds, strict=True)]
        metrics["contains"] = sum(hit) / len(hit)
        for c in CATEGORIES:
            idx = [i for i, x in enumerate(samples) if x["category"] == c]
            if idx:
                metrics[f"{c} contains"] = sum(hit[i] for i in idx) / len(idx)
        result["variants"][variant] = {
            "metrics": metrics,
            "predictions": [{"id": x["id"], "prompt": chat(x, variant)[-1]["content"], "gold": x["answer"], "prediction": p}
                            for x, p in zip(samples, preds, strict=True)]}
        cats = "  ".join(f"{c} {metrics[c + ' normalized']:.2f}/{metrics[c + ' contains']:.2f}"
                         for c in CATEGORIES if c + " n" in metrics)
        print(f"{variant}: exact {metrics['exact']:.3f} normalized {metrics['normalized']:.3f} first words "
              f"{metrics['first words']:.3f} contains {metrics['contains']:.3f} | normalized/contains: {cats}",
              flush=True)
    result["seconds"] = time.perf_counter() - t0
    save_json(args.out, result)
    if args.out:
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
