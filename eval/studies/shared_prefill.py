"""What one shared prefill saves the app's compare: the fp16 answer and the default spec's answer of the app's first
example, as two ``Engine.generate`` calls and as one ``Engine.generate_many`` (one prompt forward for both), timed
in alternating rounds on the same loaded model; the answers are checked equal in every round.

    python -m eval.studies.shared_prefill --model demo-llava --model smollm2-135m --repeats 3 \
        --out docs/results/cpu_compare_shared_prefill.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ..jsonout import save_json

SPECS = ["fp16", "visual=calibquant:bits=1 text=kivi:bits=2 window=128 sinks=4"]


def run(name: str, repeats: int, new_tokens: int, device: str) -> dict:
    from eval.bench.cpu import app_prompt, image_prompt
    from mmkv.engine import Engine
    from mmkv.models import load_model

    lm = load_model(name, device=device)
    eng = Engine(lm)
    msgs = image_prompt(lm)[0] if lm.adapter.takes_images else app_prompt(lm)
    eng.generate_many(msgs, SPECS, max_new_tokens=2)  # warm-up (compiled CPU loops, allocator)
    two, one = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        alone = [eng.generate(msgs, s, max_new_tokens=new_tokens) for s in SPECS]
        two.append(time.perf_counter() - t)
        t = time.perf_counter()
        shared = eng.generate_many(msgs, SPECS, max_new_tokens=new_tokens)
        one.append(time.perf_counter() - t)
        if not all(torch.equal(a.tokens, b.tokens) for a, b in zip(alone, shared, strict=True)):
            raise AssertionError(f"{name}: generate_many's answers differ from two generate calls")
    return {"model": name, "specs": SPECS, "two_generate_s": two, "generate_many_s": one,
            "speedup": statistics.median(two) / statistics.median(one), "prefill_ms": alone[0].stats["prefill_ms"],
            "new_tokens": [a.tokens.shape[1] for a in alone]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="registry name (repeatable; default demo-llava)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 1:
        ap.error("--repeats and --new-tokens must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [run(m, args.repeats, args.new_tokens, args.device) for m in args.model or ["demo-llava"]]
    for r in rows:
        print(f"{r['model']}: two generate {statistics.median(r['two_generate_s']):.2f} s, generate_many "
              f"{statistics.median(r['generate_many_s']):.2f} s ({r['speedup']:.2f}x), prefill {r['prefill_ms']:.0f} ms")
    if args.out:
        save_json(args.out, {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
