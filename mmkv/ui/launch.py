"""``python app.py`` / ``mmkv-app``: parse flags, load the model, build the Blocks, serve on localhost."""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile

from mmkv.ui.models import DEFAULT_MODEL


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mmkv-app", description="mmkv chat app: a multimodal LLM with a 1-4 bit KV cache")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, hub id or local folder (default %(default)s)")
    p.add_argument("--port", type=int, default=7860, help="port (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--share", action="store_true", help="also open a public share link (off by default)")
    p.add_argument("--max-upload-mb", type=float, default=20.0, help="largest upload accepted (default %(default)s)")
    p.add_argument("--max-video-seconds", type=float, default=60.0, help="longest video accepted (default %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow hub models that ship their own code")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default of the max-new-tokens slider")
    p.add_argument("--no-preload", action="store_true", help="start without loading a model (pick one in the UI)")
    p.add_argument("--shared", action="store_true",
                   help="chat turns of all users share one continuous batch (mmkv/batching) instead of a queue")
    p.add_argument("--kv-budget-gb", type=float, default=None,
                   help="with --shared: KV-cache budget in GB (10^9 bytes) that admits requests (default: no limit)")
    # mmkv-serve's default (mmkv.batching.chunks.DEFAULT_CHUNK, a test keeps them equal); not imported here, so that
    # --help does not load torch
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="with --shared: prompt tokens prefilled per step between decode steps (0: whole prompts)")
    args = p.parse_args(argv)
    if args.kv_budget_gb is not None and args.kv_budget_gb <= 0:
        p.error(f"--kv-budget-gb must be positive, got {args.kv_budget_gb}")
    if args.prefill_chunk < 0:
        p.error(f"--prefill-chunk must be 0 (off) or a positive number of tokens, got {args.prefill_chunk}")
    return args


def make_host(args: argparse.Namespace):
    """The model host; with ``--shared`` its engine is a ``SharedEngine`` over one scheduler."""
    from mmkv.ui.models import ModelHost, mmkv_loader, pick_loader

    if not args.shared:
        return ModelHost(trust_remote_code=args.trust_remote_code)
    from mmkv.ui.shared import shared_loader

    def base(name: str):
        loader = pick_loader(name)
        if args.trust_remote_code and loader is mmkv_loader:
            return loader(name, trust_remote_code=True)
        return loader(name)

    budget = None if args.kv_budget_gb is None else int(args.kv_budget_gb * 1e9)
    return ModelHost(loader=shared_loader(base, budget, args.prefill_chunk or None))


def private_upload_dir() -> str:
    """Uploads go to a fresh temporary folder that is deleted when the app exits (unless GRADIO_TEMP_DIR is set)."""
    if os.environ.get("GRADIO_TEMP_DIR"):
        return os.environ["GRADIO_TEMP_DIR"]
    path = tempfile.mkdtemp(prefix="mmkv-uploads-")
    os.environ["GRADIO_TEMP_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    private_upload_dir()
    from mmkv.ui.blocks import CSS, build_app
    from mmkv.ui.uploads import Limits

    host = make_host(args)
    if not args.no_preload:
        print(f"mmkv-app: loading {args.model} …", flush=True)
        try:
            host.load(args.model)
        except Exception as e:  # noqa: BLE001 - start anyway; the UI shows the error and offers the picker
            print(f"mmkv-app: {host.error or e}", file=sys.stderr, flush=True)
    limits = Limits(max_upload_mb=args.max_upload_mb, max_video_seconds=args.max_video_seconds)
    demo = build_app(host, limits, default_model=args.model, max_new_tokens=args.max_new_tokens, shared=args.shared)
    demo.queue(default_concurrency_limit=1)
    from mmkv.ui.examples import ASSETS

    demo.launch(server_name=args.host, server_port=args.port, share=args.share,
                max_file_size=int(args.max_upload_mb * 2**20), allowed_paths=[str(ASSETS)], css=CSS, show_error=True)
    return 0
