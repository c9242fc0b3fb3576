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
    return p.parse_args(argv)


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
    from mmkv.ui.models import ModelHost
    from mmkv.ui.uploads import Limits

    host = ModelHost(trust_remote_code=args.trust_remote_code)
    if not args.no_preload:
        print(f"mmkv-app: loading {args.model} …", flush=True)
        try:
            host.load(args.model)
        except Exception as e:  # noqa: BLE001 - start anyway; the UI shows the error and offers the picker
            print(f"mmkv-app: {host.error or e}", file=sys.stderr, flush=True)
    limits = Limits(max_upload_mb=args.max_upload_mb, max_video_seconds=args.max_video_seconds)
    demo = build_app(host, limits, default_model=args.model, max_new_tokens=args.max_new_tokens)
    demo.queue(default_concurrency_limit=1)
    from mmkv.ui.examples import ASSETS

    demo.launch(server_name=args.host, server_port=args.port, share=args.share,
                max_file_size=int(args.max_upload_mb * 2**20), allowed_paths=[str(ASSETS)], css=CSS, show_error=True)
    return 0
