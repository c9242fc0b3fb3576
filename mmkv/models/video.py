"""Video -> a list of RGB frames (PIL), the form both VLM families take video in here.

LLaVA-1.5 has no video input, and InternVL's transformers video processor needs torchvision; so mmkv samples
frames itself and hands them to the model as images (each frame its own visual span). Sampling is either
``num_frames`` uniform segments (the middle frame of each, as LLaVA-style and InternVL evaluation code does)
or ``fps`` frames per second of video.

Backends: decord (``pip install "mmkv[video]"``) first, PyAV (``pip install av``) as a fallback. Both decode in
their own bundled FFmpeg, so no system FFmpeg is needed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v")
DEFAULT_FRAMES = 8
MAX_SECONDS = 600.0  # longer clips would need hundreds of frames x 256-576 tokens: refuse them up front
MAX_FRAMES = 64
BACKENDS = ("decord", "av")
INSTALL_HINT = 'pip install "mmkv[video]"  (decord), or: pip install av'


def available_backend() -> str | None:
    import importlib.util

    for name in BACKENDS:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def sample_indices(total: int, native_fps: float, num_frames: int | None, fps: float | None,
                   max_frames: int) -> list[int]:
    """Frame indices: middles of ``num_frames`` equal segments, or one frame per ``1/fps`` seconds."""
    if fps is not None:
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        duration = total / native_fps
        n = max(1, math.ceil(duration * fps))
        if n > max_frames:
            raise ValueError(f"sampling {duration:.1f} s of video at {fps} fps gives {n} frames, more than "
                             f"max_frames={max_frames}; lower fps or raise max_frames")
        idx = [min(total - 1, int((i + 0.5) / fps * native_fps)) for i in range(n)]
    else:
        n = num_frames if num_frames is not None else DEFAULT_FRAMES
        if n <= 0:
            raise ValueError(f"num_frames must be positive, got {n}")
        if n > max_frames:
            raise ValueError(f"num_frames={n} is more than max_frames={max_frames}")
        seg = total / n
        idx = [min(total - 1, int(seg * i + seg / 2)) for i in range(n)]
    return idx


def _check_path(path) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"video file not found: {p}")
    if p.suffix.lower() not in VIDEO_SUFFIXES:
        raise ValueError(f"{p}: unsupported video type {p.suffix or '(no extension)'!r}; "
                         f"supported: {', '.join(VIDEO_SUFFIXES)}")
    return p


def _read_decord(p: Path):
    import decord

    try:
        vr = decord.VideoReader(str(p), num_threads=1)
        total, native_fps = len(vr), float(vr.get_avg_fps())
    except Exception as e:  # decord raises its own DECORDError (a RuntimeError) for any bad input
        raise ValueError(f"{p} is not a readable video ({e.__class__.__name__}: {str(e).splitlines()[0]})") from e
    return total, native_fps, lambda idx: [f for f in vr.get_batch(idx).asnumpy()]


def _read_av(p: Path):
    import av

    try:
        container = av.open(str(p))
        stream = container.streams.video[0]
        native_fps = float(stream.average_rate or 25)
        total = stream.frames
        if not total and stream.duration is not None:
            total = int(float(stream.duration * stream.time_base) * native_fps)
    except Exception as e:  # av.error.* for corrupt containers, IndexError for no video stream
        raise ValueError(f"{p} is not a readable video ({e.__class__.__name__}: {e})") from e

    def get(idx: list[int]) -> list:
        # Decode forward once, keeping only the wanted frames (a long clip never sits in memory whole).
        want, kept, last = set(idx), {}, None
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i in want:
                    kept[i] = frame.to_ndarray(format="rgb24")
                last = kept.get(i, last)
                if i >= idx[-1]:
                    break
        except Exception as e:
            raise ValueError(f"{p} is not a readable video ({e.__class__.__name__}: {e})") from e
        finally:
            container.close()
        if last is None:
            raise ValueError(f"{p} is not a readable video (no decodable frames)")
        # Container frame counts can overstate by a frame or two; reuse the last decoded one.
        return [kept.get(i, last) for i in idx]

    return total, native_fps, get


class Clip(list):
    """Sampled frames (RGB ``PIL.Image``s, in order) that also know which frames of the file they are and the
    file's frame rate: Qwen2.5-VL spaces temporal positions by it, Qwen3-VL writes each frame pair's time into the
    prompt."""

    def __init__(self, frames, indices, native_fps: float, total: int):
        super().__init__(frames)
        self.indices = [int(i) for i in indices]
        self.native_fps = float(native_fps)
        self.total = int(total)


def load_video_frames(path, num_frames: int | None = None, fps: float | None = None,
                      max_seconds: float = MAX_SECONDS, max_frames: int = MAX_FRAMES,
                      backend: str | None = None) -> Clip:
    """Decode ``path`` and return sampled frames as RGB ``PIL.Image``s (``num_frames`` default 8), a ``Clip``.

    Raises ValueError for a missing file, an unsupported extension, an undecodable file, a video longer than
    ``max_seconds`` or a sampling that needs more than ``max_frames`` frames; ImportError if no backend.
    """
    from PIL import Image

    if num_frames is not None and fps is not None:
        raise ValueError("give num_frames or fps, not both")
    p = _check_path(path)
    backend = backend or available_backend()
    if backend is None:
        raise ImportError(f"reading video needs decord or PyAV: {INSTALL_HINT}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown video backend {backend!r}; expected one of {BACKENDS}")
    total, native_fps, get = (_read_decord if backend == "decord" else _read_av)(p)
    if total <= 0 or native_fps <= 0:
        raise ValueError(f"{p} is not a readable video (no frames)")
    seconds = total / native_fps
    if seconds > max_seconds:
        raise ValueError(f"{p} is {seconds:.1f} s long; the limit is max_seconds={max_seconds:g}")
    idx = sample_indices(total, native_fps, num_frames, fps, max_frames)
    frames = [Image.fromarray(np.ascontiguousarray(f)).convert("RGB") for f in get(idx)]
    return Clip(frames, idx, native_fps, total)
