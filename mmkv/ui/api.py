"""The app's named API (``/chat``, ``/compare``, ``/load_model``, ``/methods``): what a script calls through
``gradio_client``, with named, typed parameters and JSON results. The UI's own events are private (``blocks.py``),
so these four are all the API page lists. Handlers are plain functions of a ``ModelHost`` so tests call them
directly."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from mmkv.ui.chat import GenParams
from mmkv.ui.compare import FP16_ONLY, QUANT_ONLY, agreement, token_diff
from mmkv.ui.examples import ASSETS
from mmkv.ui.spec_controls import check_spec, default_spec, registry
from mmkv.ui.uploads import Limits, UploadError, file_path, sort_uploads

NAMES = ("chat", "compare", "load_model", "methods")
ONLY = {FP16_ONLY: "fp16", QUANT_ONLY: "quantized"}


def jsonable(x):
    """Stats hold tensors and numpy scalars in places; JSON needs plain numbers and lists."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _allowed(path: str) -> bool:
    """A client names files it uploaded (Gradio's upload folder) or the app's assets, never any server path."""
    roots = [ASSETS] + ([Path(os.environ["GRADIO_TEMP_DIR"])] if os.environ.get("GRADIO_TEMP_DIR") else [])
    real = Path(path).resolve()
    return any(real.is_relative_to(r.resolve()) for r in roots)


def engine_messages(messages, info: dict, limits: Limits) -> list[dict]:
    """Client messages (a string, or chat messages whose content is a string or typed parts with image/video files
    as paths or ``handle_file`` dicts) -> the engine's messages, each file checked as the chat box checks uploads."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not messages:
        raise UploadError("messages is empty: send a string or a list of {role, content} messages.")
    out = []
    for m in messages:
        content = m.get("content", "")
        if isinstance(content, str):
            out.append({"role": m.get("role", "user"), "content": content})
            continue
        files = [file_path(p.get(p.get("type"))) for p in content if p.get("type") in ("image", "video")]
        if any(not _allowed(f) for f in files):
            raise UploadError("Send files with gradio_client.handle_file(...); server paths are not read.")
        images, video = sort_uploads(files, limits, info.get("takes_images", False), info.get("takes_video", False))
        parts = [{"type": "image", "image": p} for p in images] + ([{"type": "video", "video": video}] if video else [])
        text = " ".join(p.get("text", "") for p in content if p.get("type") == "text").strip()
        out.append({"role": m.get("role", "user"), "content": parts + [{"type": "text", "text": text}]})
    return out


def _run(host, messages, spec: str, params: GenParams, limits: Limits) -> tuple[list[dict], object]:
    if not host.ready:
        raise UploadError("No model is loaded; call /load_model first.")
    problem = check_spec(spec)
    if problem:
        raise UploadError(problem)
    return engine_messages(messages, host.info or {}, limits), params


def answer(host, msgs, spec: str, params: GenParams) -> tuple[dict, object]:
    out = host.engine.generate(msgs, spec=spec, **params.engine_kwargs())
    return _result(out), out


def _result(out) -> dict:
    return {"text": out.text[0], "stats": jsonable(dict(out.stats))}


def answer_both(host, msgs, spec: str, params: GenParams) -> tuple[tuple[dict, object], tuple[dict, object]]:
    """The fp16 answer and the ``spec`` answer. An engine with ``generate_many`` (mmkv's own) prefills the prompt
    once for both (the same answers as two runs; the second's stats say ``shared_prefill``); others answer twice."""
    many = getattr(host.engine, "generate_many", None)
    if many is None:
        return answer(host, msgs, "fp16", params), answer(host, msgs, spec, params)
    base, mine = many(msgs, ["fp16", spec], **params.engine_kwargs())
    return (_result(base), base), (_result(mine), mine)


def build(host, limits: Limits | None = None) -> None:
    """Register the four endpoints in the current Blocks. Errors reach the client as ``gr.Error`` messages."""
    import gradio as gr

    limits = limits or Limits()
    spec0 = default_spec()

    def guarded(fn):
        @functools.wraps(fn)  # gr.api reads the names and types of the parameters through the wrapper
        def inner(*a, **kw):
            try:
                return fn(*a, **kw)
            except (UploadError, ValueError) as e:
                raise gr.Error(str(e)) from e
        return inner

    def chat(messages: list[dict] | str, spec: str = spec0, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = -1, video_frames: int = 8, video_fps: float = 0.0) -> dict:
        """Answer a conversation with the cache `spec`. Returns {model, spec, text, stats}: stats holds
        cache_bytes_used / cache_bytes (reserved) per segment, fp16_equivalent_bytes, cache_dtype, effective_bits,
        prefill_ms, decode_tokens_per_s."""
        params = GenParams(max_new_tokens, temperature, top_p, seed, video_frames, video_fps)
        msgs, params = _run(host, messages, spec, params, limits)
        res, _ = answer(host, msgs, spec, params)
        return {"model": host.info["name"], "spec": spec, **res}

    def compare(messages: list[dict] | str, spec: str = spec0, max_new_tokens: int = 64, temperature: float = 0.0,
                top_p: float = 1.0, seed: int = -1, video_frames: int = 8, video_fps: float = 0.0) -> dict:
        """Answer twice, first with an uncompressed cache, then with `spec` (one prefill of the prompt serves both).
        Returns {model, spec, fp16, quantized, diff, agreement}: diff is the token diff as [{text, only}] with only =
        null, "fp16" or "quantized"."""
        params = GenParams(max_new_tokens, temperature, top_p, seed, video_frames, video_fps)
        msgs, params = _run(host, messages, spec, params, limits)
        (base, base_out), (mine, mine_out) = answer_both(host, msgs, spec, params)
        pairs = token_diff(base["text"], mine["text"], base_out, mine_out, host.engine)
        return {"model": host.info["name"], "spec": spec, "fp16": base, "quantized": mine,
                "diff": [{"text": t, "only": ONLY.get(label)} for t, label in pairs], "agreement": agreement(pairs)}

    def load_model(name: str) -> dict:
        """Serve another model (a registry name, hub id or local folder); the previous one keeps serving if it
        fails. Returns {name, family, synthetic, takes_images, takes_video, num_layers, num_q_heads}."""
        try:
            return jsonable(host.load(name))
        except Exception as e:  # noqa: BLE001 - the client gets the reason; the app keeps serving
            raise gr.Error(f"Could not load {name}: {type(e).__name__}: {e}") from e

    def methods() -> list[dict]:
        """The cache methods, their token kinds and knobs with defaults and allowed values."""
        return jsonable(registry())

    gpu = {"concurrency_id": "gpu", "concurrency_limit": 1}
    gr.api(guarded(chat), api_name="chat", api_description=chat.__doc__, **gpu)
    gr.api(guarded(compare), api_name="compare", api_description=compare.__doc__, **gpu)
    gr.api(load_model, api_name="load_model", api_description=load_model.__doc__, **gpu)
    gr.api(methods, api_name="methods", api_description=methods.__doc__, queue=False)
