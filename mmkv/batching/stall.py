"""How long a long prompt stalls a running request, with and without chunked prefill (docs/SERVE.md).

``python -m mmkv.batching.stall [--model smollm2-135m] [--prompt-tokens 1536] [--chunks 0,128,512]``: one request
decodes; once it runs, a second one with a long prompt arrives; the scheduler is driven step by step and the first
request's longest gap between two tokens (and its median) is reported per chunk size, with the second request's
time to first token. Prints one JSON line per chunk size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(engine, chunk: int | None, prompt_tokens: int, spec: str = "fp16", new_tokens: int = 48) -> dict:
    import torch

    from .scheduler import Scheduler

    s = Scheduler(engine, prefill_chunk=chunk)
    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.model.get_input_embeddings().weight.shape[0], 30000)
    # random-token prompts: a small model rarely ends such a text early, so the running request outlives the prefill
    running = s.submit(torch.randint(100, vocab, (1, 16), generator=gen), spec=spec, max_new_tokens=new_tokens)
    s.step()
    s.step()
    stamps = [time.perf_counter()]
    long = None
    while running.finish_reason is None:
        if long is None and len(running.tokens) >= 4:
            long = s.submit(torch.randint(100, vocab, (1, prompt_tokens), generator=gen), spec=spec,
                            max_new_tokens=2)
        before = len(running.tokens)
        s.step()
        if len(running.tokens) > before:
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    while long is not None and long.t_first is None:
        s.step()
    return {"prefill_chunk": chunk, "prompt_tokens": prompt_tokens, "max_gap_ms": round(max(gaps) * 1e3, 1),
            "median_gap_ms": round(statistics.median(gaps) * 1e3, 1),
            "long_ttft_ms": round((long.t_first - long.t_submit) * 1e3, 1) if long else None,
            "prefill_pieces": s.prefill_chunks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmkv.batching.stall", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--chunks", default="0,128,512", help="comma-separated chunk sizes (0: whole prompts)")
    ap.add_argument("--spec", default="fp16")
    args = ap.parse_args(argv)
    import mmkv

    engine = mmkv.Engine(mmkv.load_model(args.model))
    for c in args.chunks.split(","):
        print(json.dumps(measure(engine, int(c) or None, args.prompt_tokens, args.spec)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
