"""``mmkv-serve --model NAME [--spec SPEC] [--kv-budget-gb G] [--host 127.0.0.1] [--port 8000]
[--allowed-media-dir DIR] [--prefill-chunk 512]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..batching.chunks import DEFAULT_CHUNK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmkv-serve", description="OpenAI-compatible API over an mmkv model")
    ap.add_argument("--model", default="smollm2-135m", help="registry name, hub id or local folder")
    ap.add_argument("--spec", default="fp16", help="the cache spec of requests that do not name one (mmkv.spec)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--allowed-media-dir", type=Path, default=None,
                    help="local image/video paths are accepted only inside this folder (default: none, data URLs only)")
    ap.add_argument("--max-media-mb", type=float, default=20.0)
    ap.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask for")
    ap.add_argument("--kv-budget-gb", type=float, default=None,
                    help="KV-cache budget in GB (10^9 bytes): requests are admitted by the exact bytes their caches "
                         "will hold and queue (or are preempted and recomputed) beyond it; default: no limit")
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_CHUNK,
                    help="prompt tokens prefilled per scheduler step, between decode steps of the running batch "
                         "(default %(default)s; 0: each prompt at once). Visual spans are never split")
    ap.add_argument("--trust-remote-code", action="store_true")
    args = ap.parse_args(argv)
    if args.prefill_chunk < 0:
        ap.error(f"--prefill-chunk must be 0 (off) or a positive number of tokens, got {args.prefill_chunk}")

    import uvicorn

    import mmkv
    from mmkv.spec import CacheSpec

    from .app import create_app
    from .protocol import Limits

    CacheSpec.parse(args.spec)  # a bad default spec fails here, not on the first request
    lm = mmkv.load_model(args.model, trust_remote_code=args.trust_remote_code)
    limits = Limits(max_media_bytes=int(args.max_media_mb * 2**20), allowed_media_dir=args.allowed_media_dir,
                    max_tokens_cap=args.max_tokens_cap)
    budget = None if args.kv_budget_gb is None else int(args.kv_budget_gb * 1e9)
    if budget is not None and budget <= 0:
        ap.error(f"--kv-budget-gb must be positive, got {args.kv_budget_gb}")
    app = create_app(mmkv.Engine(lm), args.model, args.spec, limits, kv_budget_bytes=budget,
                     prefill_chunk=args.prefill_chunk or None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
