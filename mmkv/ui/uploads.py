"""Checks on uploaded files, each failure a :class:`UploadError` whose message the UI shows as it is."""

from __future__ import annotations

import os
from dataclasses import dataclass

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
VIDEO_EXTS = (".mp4", ".webm", ".mov", ".avi", ".mkv")
MAX_IMAGES_PER_TURN = 8
MAX_IMAGE_PIXELS = 40_000_000


class UploadError(ValueError):
    """Bad input from the user: the message says what is wrong and what is accepted."""


@dataclass(frozen=True)
class Limits:
    max_upload_mb: float = 20.0
    max_video_seconds: float = 60.0


def file_path(f) -> str:
    """Gradio gives a path string, a dict with "path", or a FileData-like object."""
    if isinstance(f, str):
        return f
    if isinstance(f, dict):
        return f.get("path") or f.get("name") or ""
    return getattr(f, "path", None) or getattr(f, "name", "")


def check_size(path: str, limits: Limits) -> None:
    size = os.path.getsize(path)
    if size > limits.max_upload_mb * 1024 * 1024:
        raise UploadError(
            f"{os.path.basename(path)} is {size / 2**20:.1f} MB; the limit is {limits.max_upload_mb:g} MB "
            "(start the app with --max-upload-mb to change it)."
        )


def check_image(path: str) -> None:
    from PIL import Image, UnidentifiedImageError

    name = os.path.basename(path)
    try:
        with Image.open(path) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise UploadError(f"{name} is {im.width}x{im.height}; images up to {MAX_IMAGE_PIXELS // 10**6} MP.")
            im.verify()
        with Image.open(path) as im:  # verify() leaves the file unusable; a full decode catches truncation
            im.load()
    except UploadError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise UploadError(f"{name} is not a readable image ({type(e).__name__}: {e}).") from e


def video_seconds(path: str) -> float:
    try:
        from decord import VideoReader, cpu
    except ImportError as e:
        raise UploadError("Video needs the decord package: pip install 'mmkv[video]'.") from e
    name = os.path.basename(path)
    try:
        vr = VideoReader(path, ctx=cpu(0))
        n, fps = len(vr), float(vr.get_avg_fps())
    except Exception as e:  # decord raises its own DECORDError for corrupt files
        raise UploadError(f"{name} is not a readable video ({type(e).__name__}).") from e
    if n == 0 or fps <= 0:
        raise UploadError(f"{name} has no frames.")
    return n / fps


def check_video(path: str, limits: Limits) -> None:
    secs = video_seconds(path)
    if secs > limits.max_video_seconds:
        raise UploadError(
            f"{os.path.basename(path)} is {secs:.0f} s long; videos up to {limits.max_video_seconds:g} s "
            "(start the app with --max-video-seconds to change it)."
        )


def sort_uploads(files, limits: Limits, takes_images: bool, takes_video: bool) -> tuple[list[str], str | None]:
    """Validate a turn's files -> (image paths, video path or None). Raises UploadError."""
    images, videos = [], []
    for f in files or []:
        path = file_path(f)
        if not path or not os.path.exists(path):
            raise UploadError("An uploaded file is missing on the server; please upload it again.")
        ext = os.path.splitext(path)[1].lower()
        check_size(path, limits)
        if ext in IMAGE_EXTS:
            check_image(path)
            images.append(path)
        elif ext in VIDEO_EXTS:
            check_video(path, limits)
            videos.append(path)
        else:
            raise UploadError(
                f"{os.path.basename(path)}: unsupported file type {ext or '(none)'}. "
                f"Images: {' '.join(IMAGE_EXTS)}; videos: {' '.join(VIDEO_EXTS)}."
            )
    if (images or videos) and not (takes_images or takes_video):
        raise UploadError("This model reads text only; pick a vision model (e.g. demo-llava) to send images.")
    if images and not takes_images:
        raise UploadError("This model does not take images.")
    if videos and not takes_video:
        raise UploadError("This model does not take video; try demo-internvl or send frames as images.")
    if len(videos) > 1:
        raise UploadError("One video per message, please.")
    if len(images) > MAX_IMAGES_PER_TURN:
        raise UploadError(f"At most {MAX_IMAGES_PER_TURN} images per message.")
    return images, (videos[0] if videos else None)
