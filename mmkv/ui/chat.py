"""Chat handlers as plain functions of (session, engine, ...): Gradio wiring lives in ``blocks.py``.

``respond`` streams; it yields ``(chat, fp16_chat, diff)`` after every piece, where the chats are lists of Gradio
message dicts. A failure (out of memory, bad input, a bug) ends the answer with an error line in the chat.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from mmkv.ui.compare import token_diff
from mmkv.ui.session import Session, Turn
from mmkv.ui.uploads import Limits, UploadError, sort_uploads

THINKING = "…"


@dataclass
class GenParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    video_frames: int | None = 8
    video_fps: float | None = None

    def engine_kwargs(self) -> dict:
        sample = self.temperature is not None and self.temperature > 0
        seed = None if self.seed in (None, "", -1) else int(self.seed)
        return {
            "max_new_tokens": max(1, int(self.max_new_tokens)),
            "do_sample": sample,
            "temperature": float(self.temperature) if sample else 1.0,
            "top_p": float(self.top_p) if sample else 1.0,
            "seed": seed,
            "video_frames": int(self.video_frames) if self.video_frames else None,
            "video_fps": float(self.video_fps) if self.video_fps else None,
        }


def render(turns: list[Turn]) -> list[dict]:
    """Session turns -> Gradio Chatbot messages (text plus image/video files)."""
    out = []
    for t in turns:
        if t.error and t.role == "assistant":
            out.append({"role": "assistant", "content": f"⚠️ **Error:** {t.text}"})
            continue
        content: list = [{"path": p} for p in t.images]
        if t.video:
            content.append({"path": t.video})
        if t.text or not content:
            content.append(t.text or THINKING)
        out.append({"role": t.role, "content": content if len(content) > 1 else content[0]})
    return out


def to_messages(turns: list[Turn], takes_media: bool) -> list[dict]:
    """Session turns -> the engine's chat messages (errors and unanswered user turns before the last left out)."""
    turns = [t for t in turns if not t.error]
    turns = [t for i, t in enumerate(turns)
             if not (t.role == "user" and i + 1 < len(turns) and turns[i + 1].role == "user")]
    msgs = []
    for t in turns:
        if not takes_media or t.role == "assistant":
            msgs.append({"role": t.role, "content": t.text})
            continue
        parts = [{"type": "image", "image": p} for p in t.images]
        if t.video:
            parts.append({"type": "video", "video": t.video})
        parts.append({"type": "text", "text": t.text})
        msgs.append({"role": t.role, "content": parts})
    return msgs


def add_turn(session: Session, message, info: dict | None, limits: Limits) -> tuple[list[dict], bool]:
    """Validate the user's message -> (chat, accepted). A rejected message stays visible with the reason."""
    message = message or {}
    if isinstance(message, str):
        message = {"text": message, "files": []}
    text = (message.get("text") or "").strip()
    files = message.get("files") or []
    if info is None:
        session.turns += [Turn("user", text, error=True),
                          Turn("assistant", "No model is loaded; pick one and press Load.", error=True)]
        return render(session.turns), False
    try:
        if not text and not files:
            raise UploadError("The message is empty: type a question (and attach images or a video if you like).")
        images, video = sort_uploads(files, limits, info.get("takes_images", False), info.get("takes_video", False))
        if not text:
            raise UploadError("Add a question to go with the attachment.")
    except UploadError as e:
        session.turns += [Turn("user", text or "(attachment)", error=True), Turn("assistant", str(e), error=True)]
        return render(session.turns), False
    session.uploads.update(images + ([video] if video else []))
    session.turns.append(Turn("user", text, images, video))
    return render(session.turns), True


def pending(session: Session) -> bool:
    return bool(session.turns) and session.turns[-1].role == "user" and not session.turns[-1].error


def explain(e: BaseException) -> str:
    name = type(e).__name__
    if "OutOfMemory" in name:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass
        return f"Out of memory ({e}). Try fewer bits, a shorter prompt, fewer frames or fewer new tokens."
    if isinstance(e, (ValueError, ImportError)):
        return str(e)
    traceback.print_exc()
    return f"{name}: {e}"


def stream_answer(session: Session, engine, messages, spec: str, params: GenParams, label: str, show, made=None):
    """Run one answer (``made``: its stream, already made); yields after each piece with the text so far. Returns
    (text, output or None, error or None)."""
    session.stop.clear()
    session.live_label = label
    text = ""
    try:
        s = made if made is not None else engine.stream(messages, spec=spec, stop=session.stop,
                                                        **params.engine_kwargs())
        session.stream = s
        for piece in s:
            text += piece
            yield show(text)
        return text, getattr(s, "output", None), None
    except Exception as e:  # noqa: BLE001 - any failure becomes a message; the app keeps serving
        return text, None, explain(e)


def respond(session: Session, engine, info: dict, spec: str, params: GenParams, compare: bool = False):
    """Answer the pending user turn with ``spec`` (and first with FP16 when ``compare``)."""
    if not pending(session):
        yield render(session.turns), [], []
        return
    takes_media = bool(info.get("takes_images") or info.get("takes_video"))
    messages = to_messages(session.conversation(), takes_media)
    session.generation += 1
    session.last_messages, session.last_spec = messages, spec
    session.fp16_stats = session.fp16_output = None if compare else session.fp16_stats
    base = list(session.turns)
    fp16_chat: list[dict] = []
    fp16_text = None
    pair = [None, None]
    if compare and hasattr(engine, "streams"):  # mmkv's engine: one prefill of the prompt serves both answers
        try:
            pair = engine.streams(messages, ["fp16", spec], stop=session.stop, **params.engine_kwargs())
        except Exception:  # noqa: BLE001 - pair stays empty: each half makes its own stream, reports its own error
            pass
    if compare:
        def show_fp16(text):
            return render(session.turns), render(base + [Turn("assistant", text)]), []

        text, out, err = yield from stream_answer(session, engine, messages, "fp16", params, "FP16", show_fp16,
                                                  pair[0])
        fp16_turn = Turn("assistant", err, error=True) if err else Turn("assistant", text)
        fp16_chat = render(base + [fp16_turn])
        session.fp16_output = out
        session.fp16_stats = getattr(out, "stats", None)
        fp16_text = None if err else text
        if session.stop.is_set():  # Stop during the FP16 half stops the whole comparison
            session.stream = None
            yield render(session.turns), fp16_chat, []
            return
    answer = Turn("assistant", "")
    session.turns.append(answer)

    def show(text):
        answer.text = text
        return render(session.turns), fp16_chat, []

    text, out, err = yield from stream_answer(session, engine, messages, spec, params, "quantized", show, pair[1])
    if err:
        answer.text, answer.error = (f"{err} (answer so far: {text})" if text else err), True
    else:
        answer.text = text or "(empty answer: the model stopped at once)"
    session.last_output = out
    session.last_stats = getattr(out, "stats", None) or (dict(session.stream.stats) if session.stream else None)
    session.stream = None
    diff = token_diff(fp16_text, text, session.fp16_output, out, engine) if compare and fp16_text is not None else []
    yield render(session.turns), fp16_chat, diff


def stop(session: Session) -> None:
    session.stop.set()
    s = session.stream
    if s is not None and hasattr(s, "stop"):
        s.stop()


def regenerate(session: Session) -> tuple[list[dict], bool]:
    """Drop the last answer (and any error lines) so ``respond`` answers the last user turn again."""
    while session.turns and (session.turns[-1].role == "assistant" or session.turns[-1].error):
        session.turns.pop()
    return render(session.turns), pending(session)


def clear(session: Session) -> list[dict]:
    session.reset()
    return []
