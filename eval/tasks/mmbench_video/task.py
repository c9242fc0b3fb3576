"""MMBench-Video: free-form questions on videos, answers graded 0-3 by a judge model; Perception, Reasoning and
Overall as the benchmark defines them (CalibQuant Table 3)."""

from __future__ import annotations

from ...runtime import Runtime, generate
from .data import load
from .judge import judge_label, make_judge
from .rating import rate, unknown_dimensions

# Frames reach the model through the engine's video input; the text follows the benchmark's frame prompt.
PREFACE = ("The video is given as frames sampled uniformly from it, in chronological order. Answer the question "
           "about the video content. Reply directly with your answer to the question.\n")


def load_samples(opts: dict, rt: Runtime) -> list[dict]:
    return load(opts.get("data"))


def run_sample(rt: Runtime, sample: dict, spec: str, opts: dict) -> dict:
    messages = [{"role": "user", "content": [
        {"type": "video", "video": sample["video"]},
        {"type": "text", "text": f"{PREFACE}Question: {sample['question']}\nAnswer: "}]}]
    rec = generate(rt, messages, spec, opts["max_new_tokens"],
                   video_frames=None if opts.get("fps") else opts["frames"], video_fps=opts.get("fps"))
    rec.update(question=sample["question"], answer=sample["answer"], dimensions=sample["dimensions"])
    return rec


def judge_pending(rt: Runtime, store, specs: list[str], ids: set[str], opts: dict, log=print) -> None:
    """Score every finished prediction that the current judge has not scored yet (resumable like inference)."""
    judge = None
    label = judge_label(opts)
    if label is None:
        return
    for spec in specs:
        done = {i for i, r in store.records(spec, "judge").items() if r.get("judge") == label}
        todo = [r for i, r in sorted(store.records(spec).items()) if i in ids and i not in done]
        for rec in todo:
            judge = judge or make_judge(opts)
            score, raw = judge.judge(rec["question"], rec["answer"], rec["prediction"])
            store.append(spec, {"id": rec["id"], "judge": label, "score": score, "raw": raw,
                                "judge_synthetic": getattr(judge, "synthetic", None)}, kind="judge")
        if todo:
            log(f"[judge] {spec}: scored {len(todo)} answers with {label}")


def score(records: list[dict], baseline: list[dict], opts: dict) -> tuple[dict, list[str]]:
    label = judge_label(opts)
    notes = []
    unknown = sorted({d for r in records for d in unknown_dimensions(r["dimensions"])})
    if unknown:
        notes.append(f"dimensions outside the MMBench-Video taxonomy (counted in no group): {unknown}")
    if label is None:
        notes.append("no judge given (--infer-only or no --judge-*): predictions stored, scores left empty; "
                     "rerun with --judge-url/--judge-model or --judge-local on the same --out to score them")
        return {"Perception": None, "Reasoning": None, "Overall": None, "judged": 0}, notes
    judged = [r for r in records if r.get("judge") == label]
    ratings = rate([(r["dimensions"], r["score"]) for r in judged])
    failed = sum(r["score"] < 0 for r in judged)
    notes.append(f"judge: {label}" + (" (SYNTHETIC judge model)" if any(r.get("judge_synthetic") for r in judged)
                                      else ""))
    if failed or len(judged) < len(records):
        notes.append(f"{failed} failed judgments and {len(records) - len(judged)} unjudged answers count as 0")
    return {"Perception": ratings["Perception"], "Reasoning": ratings["Reasoning"],
            "Overall": ratings["Overall"], "judged": len(judged)}, notes


TASK = {
    "title": "MMBench-Video (judge scores 0-3)",
    "paper": "CalibQuant Table 3",
    "load": load_samples, "run": run_sample, "score": score, "post": judge_pending, "annotations": "judge",
    "metrics": ["Perception", "Reasoning", "Overall", "judged"], "digits": 2, "needs": "video",
    "defaults": {"max_new_tokens": 128},
    "options": [
        (["--frames"], {"type": int, "default": 8, "help": "frames sampled uniformly per video (default 8)"}),
        (["--fps"], {"type": float, "default": None, "help": "sample at this rate instead (e.g. 1 for 1 fps)"}),
        (["--judge-url"], {"help": "OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1"}),
        (["--judge-model"], {"help": "model name the endpoint serves, e.g. gpt-4-1106-preview"}),
        (["--judge-key-env"], {"default": "OPENAI_API_KEY", "help": "env var holding the endpoint's API key"}),
        (["--judge-local"], {"help": "judge with a local model through mmkv (fp16), e.g. a hub id"}),
        (["--infer-only"], {"action": "store_true", "help": "store predictions only; judge in a later run"}),
    ],
}
