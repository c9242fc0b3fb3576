"""CPU generation speed: mmkv's Engine vs transformers' own ``generate`` on the same loaded model object.

For each prompt length, a prompt of that many WikiText-2 test tokens goes through ``model.generate`` (DynamicCache,
SDPA: what a user gets without mmkv) and through ``Engine.generate`` with every spec, greedy, the same number of new
tokens. Both sides are timed the same way: prefill = the time to the first new token; decode tok/s = (new tokens -
1) / (time of the last token - time of the first), so the two count the same forward passes. Runs alternate
(transformers, then each spec, ``--repeats`` rounds) and the table gives medians and their ratios to transformers
of the same round, so a machine that slows down mid-run moves both sides.

    mmkv-bench cpu --prompts 256,2048,8192 --new-tokens 32 --threads 2 \
        --spec fp16 --spec "text=kivi:bits=2" --spec "text=xquant:kq=28,vq=2,km=30,vm=14" --out results/cpu.json

``--prompts app`` is the app's first answer as a newcomer gets it: the app's first example (a passage and a
question, chat template applied) and, unless ``--spec`` says otherwise, the app's default spec and fp16.
``--prompts image`` (with a VLM, e.g. ``--model demo-llava``) is the app's first image example the same way.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from ..jsonout import save_json
from ..studies.common import prompts

DEFAULT_SPECS = ["fp16", "text=kivi:bits=2", "text=xquant:kq=28,vq=2,km=30,vm=14"]


class _Clock:
    """A transformers streamer that only notes when each batch of tokens arrives (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_run(model, ids, new_tokens: int) -> dict:
    """``ids``: token ids, or prepared inputs (a VLM's: their mask and pixel values go along)."""
    clock = _Clock()
    kw = {"attention_mask": torch.ones_like(ids)} if isinstance(ids, torch.Tensor) else {
        "attention_mask": ids.attention_mask, **ids.model_kwargs}
    ids = ids if isinstance(ids, torch.Tensor) else ids.input_ids
    t0 = time.perf_counter()
    with torch.inference_mode():
        # min_new_tokens: a short answer (an image question: a word and the end of the turn) would leave one step
        # to time; mmkv's side is timed over the tokens it made
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=clock, pad_token_id=model.generation_config.eos_token_id, **kw)
    t = clock.times[1:]  # the new tokens
    n = out.shape[1] - ids.shape[1]
    return {"prefill_ms": (t[0] - t0) * 1e3, "new_tokens": n,
            "decode_tokens_per_s": (n - 1) / (t[-1] - t[0]) if n > 1 else None}


def mmkv_run(engine, ids, spec: str, new_tokens: int, messages=None) -> dict:
    out = engine.generate(messages if messages is not None else ids, spec, max_new_tokens=new_tokens)
    s = out.stats
    t = [x["t_s"] for x in s["timeline"]]  # one entry per new token, the first a few ms after the prefill
    n = out.tokens.shape[1]
    # n - 1 steps between the first token and the last, as on transformers' side (an earlier version put a 0 in
    # front of these times, which counted n - 1 steps over n - 2 step times: +3.3% for mmkv at 32 new tokens)
    return {"prefill_ms": s["prefill_ms"], "new_tokens": n,
            "decode_tokens_per_s": (n - 1) / (t[n - 1] - t[0]) if n > 1 and t[n - 1] > t[0] else None}


def app_prompt(loaded) -> torch.Tensor:
    """Token ids of the app's first example, as the app sends it (one user turn through the chat template)."""
    from mmkv.ui.examples import collect

    return loaded.prepare([{"role": "user", "content": collect()[0]["text"]}]).input_ids


def image_prompt(loaded):
    """``(messages, prepared inputs)`` of the app's first example with one image (its question and image, one user
    turn)."""
    from mmkv.ui.examples import collect

    ex = next(e for e in collect() if len(e["files"]) == 1 and not str(e["files"][0]).endswith(".mp4"))
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(ex["files"][0])},
                                         {"type": "text", "text": ex["text"]}]}]
    return msgs, loaded.prepare(msgs)


def run(name: str, lengths: list, specs: list[str], new_tokens: int, repeats: int) -> list[dict]:
    from mmkv.engine import Engine
    from mmkv.models import load_model

    loaded = load_model(name, device="cpu")
    engine = Engine(loaded)
    tok = engine.tokenizer
    rows = []
    for n in lengths:
        msgs = None
        if n == "image":
            msgs, ids = image_prompt(loaded)
            hf_run(loaded.model, ids, 2)  # warm both paths up once
            mmkv_run(engine, None, specs[0], 2, msgs)
        else:
            ids = app_prompt(loaded) if n == "app" else prompts(tok, 1, n)
            hf_run(loaded.model, ids[:, :64], 4)
            mmkv_run(engine, ids[:, :64], specs[0], 4)
        rounds: dict[str, list[dict]] = {"transformers": [], **{s: [] for s in specs}}
        for _ in range(repeats):
            rounds["transformers"].append(hf_run(loaded.model, ids, new_tokens))
            for s in specs:
                rounds[s].append(mmkv_run(engine, ids, s, new_tokens, msgs))
        for label, runs in rounds.items():
            row = {"prompt_tokens": n, "path": label, "runs": runs}
            for key in ("prefill_ms", "decode_tokens_per_s"):
                vals = [r[key] for r in runs if r[key] is not None]
                row[key] = statistics.median(vals) if vals else None
                base = [b[key] for b in rounds["transformers"]]
                ratios = [r[key] / b if key == "decode_tokens_per_s" else b / r[key]
                          for r, b in zip(runs, base) if r[key] and b]
                row[f"{key}_x_transformers"] = statistics.median(ratios) if ratios else None
            rows.append(row)
            print(f"n={n!s:>6} {label:40s} prefill {row['prefill_ms']:8.1f} ms  decode "
                  f"{row['decode_tokens_per_s'] or float('nan'):6.2f} tok/s  x transformers: decode "
                  f"{row['decode_tokens_per_s_x_transformers'] or float('nan'):.2f}, prefill speed "
                  f"{row['prefill_ms_x_transformers'] or float('nan'):.2f}", flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    out = ["| prompt tokens | path | prefill ms | decode tok/s | decode x transformers "
           "| prefill speed x transformers |",
           "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        d = r["decode_tokens_per_s"]
        out.append(f"| {r['prompt_tokens']} | {r['path']} | {r['prefill_ms']:.0f} | {d:.2f} | "
                   f"{r['decode_tokens_per_s_x_transformers']:.2f} | {r['prefill_ms_x_transformers']:.2f} |"
                   if d else f"| {r['prompt_tokens']} | {r['path']} | {r['prefill_ms']:.0f} | - | - | - |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="256,2048,8192",
                    help="prompt lengths in tokens, or 'app' / 'image' (module doc)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--spec", action="append", help=f"repeatable (default: {', '.join(DEFAULT_SPECS)})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    info = {"machine": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "model": args.model,
            "date": datetime.date.today().isoformat(), "new_tokens": args.new_tokens, "repeats": args.repeats}
    lengths = [x if x in ("app", "image") else int(x) for x in args.prompts.split(",")]
    specs = args.spec
    if not specs and all(x in ("app", "image") for x in lengths):
        from mmkv.ui.spec_controls import default_spec

        specs = [default_spec(), "fp16"]
    rows = run(args.model, lengths, specs or DEFAULT_SPECS, args.new_tokens, args.repeats)
    print(format_table(rows))
    if args.out:
        save_json(args.out, {"info": info, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
