"""OpenAI request bodies -> mmkv generation arguments, and OpenAI-style errors.

``parse_chat`` / ``parse_completion`` validate a ``/v1/chat/completions`` or ``/v1/completions`` body and return a
``Request``: the engine's inputs (a chat: messages whose content items are text, images and videos as
``mmkv.models.inputs`` takes them), the cache spec (the extra field ``mmkv.spec``, else the server's), and the
sampling settings. Media come as data URLs (base64, size-limited) or, where the server allows a folder
(``--allowed-media-dir``), as paths inside it; remote URLs are refused: mmkv never fetches from the network.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MAX_STOP = 4
MAX_TOKENS_DEFAULT = 256


class APIError(Exception):
    """An error the client caused (4xx) or the server hit (5xx), rendered as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Limits:
    max_media_bytes: int = 20 * 2**20
    max_images: int = 8
    allowed_media_dir: Path | None = None
    max_tokens_cap: int = 4096


@dataclass
class Request:
    inputs: list | str
    spec: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    chat: bool
    temp_files: list[str] = field(default_factory=list)

    def sampling(self) -> dict:
        return dict(max_new_tokens=self.max_tokens, do_sample=self.temperature > 0,
                    temperature=self.temperature if self.temperature > 0 else 1.0, top_p=self.top_p, seed=self.seed)

    def cleanup(self) -> None:
        for p in self.temp_files:
            try:
                os.unlink(p)
            except OSError:
                pass


def _number(body: dict, key: str, default, lo, hi, kind=float):
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise APIError(400, f"'{key}' must be a {'integer' if kind is int else 'number'}, got {v!r}", key)
    if not lo <= v <= hi:
        raise APIError(400, f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return kind(v)


def _common(body: dict, default_spec: str, limits: Limits, chat: bool, inputs) -> Request:
    if body.get("n", 1) != 1:
        raise APIError(400, "only n=1 is supported", "n")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    extra = body.get("mmkv") or {}
    if not isinstance(extra, dict):
        raise APIError(400, "'mmkv' must be an object such as {\"spec\": \"text=kivi:bits=2\"}", "mmkv")
    spec = extra.get("spec", default_spec)
    if not isinstance(spec, str):
        raise APIError(400, "'mmkv.spec' must be a string", "mmkv.spec")
    try:
        from mmkv.spec import CacheSpec

        spec = str(CacheSpec.parse(spec))
    except ValueError as e:
        raise APIError(400, f"invalid cache spec: {e}", "mmkv.spec") from e
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be true or false", "stream")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, "'seed' must be an integer", "seed")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    return Request(inputs=inputs, spec=spec,
                   max_tokens=_number(body, key, MAX_TOKENS_DEFAULT, 1, limits.max_tokens_cap, int),
                   temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                   top_p=_number(body, "top_p", 1.0, 1e-6, 1.0), seed=seed, stop=stop, stream=stream, chat=chat)


def parse_completion(body: dict, default_spec: str, limits: Limits) -> Request:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError(400, "'prompt' must be a string (one prompt per request)", "prompt")
    if not prompt.strip():
        raise APIError(400, "empty prompt", "prompt")
    return _common(body, default_spec, limits, chat=False, inputs=prompt)


def parse_chat(body: dict, default_spec: str, limits: Limits) -> Request:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    temp: list[str] = []
    try:
        out, n_media = [], 0
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise APIError(400, f"messages[{i}] needs a role of system, user or assistant", f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, str):
                out.append({"role": m["role"], "content": content})
                continue
            if not isinstance(content, list):
                raise APIError(400, f"messages[{i}].content must be a string or a list of parts",
                               f"messages[{i}].content")
            items = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    items.append({"type": "text", "text": str(part.get("text", ""))})
                elif kind in ("image_url", "video_url"):
                    n_media += 1
                    if n_media > limits.max_images:
                        raise APIError(400, f"at most {limits.max_images} images or videos per request", where)
                    url = (part.get(kind) or {}).get("url") if isinstance(part.get(kind), dict) else part.get(kind)
                    src = _media(url, kind[:5], limits, temp, where)
                    items.append({"type": kind[:5], kind[:5]: src})
                else:
                    raise APIError(400, f"unsupported content part type {kind!r}", where)
            out.append({"role": m["role"], "content": items})
        req = _common(body, default_spec, limits, chat=True, inputs=out)
    except Exception:
        for p in temp:
            os.unlink(p)
        raise
    req.temp_files = temp
    return req


def _media(url, kind: str, limits: Limits, temp: list[str], where: str):
    """A PIL image (images) or a local file path (videos) from a data URL or an allowed local path."""
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{kind} part needs a url", where)
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if ";base64" not in head:
            raise APIError(400, "data URLs must be base64-encoded", where)
        if len(data) * 3 // 4 > limits.max_media_bytes:
            raise APIError(413, f"{kind} larger than {limits.max_media_bytes} bytes", where)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise APIError(400, f"invalid base64 in the {kind} data URL", where) from e
        if kind == "image":
            from PIL import Image, UnidentifiedImageError

            try:
                with Image.open(io.BytesIO(raw)) as im:
                    im.load()
                    return im.convert("RGB")
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
                raise APIError(400, f"unreadable image ({e.__class__.__name__})", where) from e
        fd, path = tempfile.mkstemp(suffix=".mp4", prefix="mmkv-video-")
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        temp.append(path)
        return path
    if url.startswith(("http://", "https://")):
        raise APIError(400, "remote media URLs are not fetched: send the file as a base64 data URL", where)
    path = Path(url.removeprefix("file://")).expanduser()
    root = limits.allowed_media_dir
    if root is None:
        raise APIError(400, "local media paths need the server's --allowed-media-dir; send a data URL instead", where)
    try:
        resolved = path.resolve(strict=True)
    except OSError as e:
        raise APIError(400, f"{kind} file not found: {url}", where) from e
    if not resolved.is_relative_to(root.resolve()):
        raise APIError(403, f"{url} is outside the allowed media folder", where)
    if resolved.stat().st_size > limits.max_media_bytes:
        raise APIError(413, f"{kind} larger than {limits.max_media_bytes} bytes", where)
    return str(resolved)
