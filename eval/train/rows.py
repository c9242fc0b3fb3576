"""What each training step of the demo towers' trainer (``eval/train/towers.py``) draws: its mode (image, clip,
tiled), its rows' generated items (``eval/synth``) and, per row, one question or the caption, or with ``--pack``
(``eval/train/pack.py``) all of the item's questions and its caption. Deterministic per (step, row)."""

from __future__ import annotations

import random

from eval.synth.make import make
from mmkv.models.demo import DEMO_MAX_TILES as MAX_TILES  # the processor's cap too: train and test tile alike

IMAGE_MIX = {"scene": 0.3, "text": 0.2, "document": 0.3, "chart": 0.2}
CLIP_STEPS = 0.2           # share of steps that are clip steps
TILED_STEPS = 0.1          # demo-internvl: share of steps with dynamically tiled images
CAPTION_SHARE = 0.3
CAPTION_PROMPT = "Describe the image in one sentence."
VIDEO_CAPTION_PROMPT = "Describe the video in one sentence."

TILE_GRIDS = ((2, 1), (1, 2), (2, 2), (3, 1), (1, 3), (4, 1), (1, 4))


def step_mode(step: int, model: str) -> str:
    u = random.Random(f"mmkv-train-step/{step}").random()
    if u < CLIP_STEPS:
        return "clip"
    if model == "demo-internvl" and u < CLIP_STEPS + TILED_STEPS:
        return "tiled"
    return "image"


def rows_for(mode: str, batch: int, frames: int) -> int:
    """Rows of a step: a clip row holds ``frames`` images, a tiled row up to ``MAX_TILES`` + 1 tiles."""
    if mode == "clip":
        return max(1, batch // frames)
    if mode == "tiled":
        return max(1, batch // (MAX_TILES + 1))
    return batch


def _tiled(rng: random.Random, image):
    """The image centred on a canvas of a tile grid's aspect (background from its corner), so that the processor's
    dynamic tiling cuts it into that grid (plus a thumbnail); centring keeps left/right/above/below answers true."""
    from PIL import Image

    gw, gh = rng.choice([g for g in TILE_GRIDS if g[0] * g[1] <= MAX_TILES])
    side = 448 * rng.uniform(0.8, 1.0)
    w, h = round(side * gw), round(side * gh)
    s = min(w, h) / max(image.size)
    im = image.resize((max(1, round(image.width * s)), max(1, round(image.height * s))), Image.BICUBIC)
    canvas = Image.new("RGB", (w, h), image.getpixel((0, 0)))
    canvas.paste(im, ((w - im.width) // 2, (h - im.height) // 2))
    return canvas


def parse_mix(text: str | None) -> dict[str, float]:
    """``"scene=0.55,text=0.12,..."`` -> image-kind weights (kinds of ``IMAGE_MIX`` only; unnamed kinds get 0)."""
    if not text:
        return dict(IMAGE_MIX)
    mix = dict.fromkeys(IMAGE_MIX, 0.0)
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k.strip() not in mix:
            raise ValueError(f"unknown image kind {k!r} in --mix; kinds: {list(IMAGE_MIX)}")
        mix[k.strip()] = float(v)
    if sum(mix.values()) <= 0 or min(mix.values()) < 0:
        raise ValueError(f"--mix needs non-negative weights with a positive sum, got {text!r}")
    return mix


def sample(step: int, i: int, mode: str = "image", mix: dict | None = None):
    """(chat content item for the picture or clip, prompt, answer) of row ``i`` at ``step``."""
    return sample_item(step, i, mode, mix)[1:]


def _draw(step: int, i: int, mode: str, mix: dict | None):
    """(the row's random stream, its kind, its generated item): image kinds drawn at ``mix`` (default
    ``IMAGE_MIX``), a clip on clip steps."""
    rng = random.Random(f"mmkv-train/{step}/{i}")
    mix = mix or IMAGE_MIX
    kind = "clip" if mode == "clip" else rng.choices(list(mix), weights=list(mix.values()))[0]
    return rng, kind, make(kind, rng)


def _content(rng: random.Random, kind: str, it, mode: str) -> dict:
    """The chat content item of a drawn item: its clip's frames, or its image (on a tile grid's canvas in tiled
    steps, which draws from ``rng``)."""
    if kind == "clip":
        return {"type": "video", "frames": it.frames}
    return {"type": "image", "image": _tiled(rng, it.image) if mode == "tiled" else it.image}


def _caption_prompt(kind: str) -> str:
    return VIDEO_CAPTION_PROMPT if kind == "clip" else CAPTION_PROMPT


def sample_item(step: int, i: int, mode: str = "image", mix: dict | None = None):
    """(generated item, chat content item, prompt, answer) of row ``i`` at ``step``: the caption
    (``CAPTION_SHARE``) or one of the item's questions."""
    rng, kind, it = _draw(step, i, mode, mix)
    if rng.random() < CAPTION_SHARE:
        prompt, answer = _caption_prompt(kind), it.caption
    else:
        prompt, answer = rng.choice(it.qa)
    return it, _content(rng, kind, it, mode), prompt, answer


def position_questions(it) -> list[tuple[str, str]]:
    """Training-only questions on where a scene's shapes are across the image, from its drawn positions: each
    shape's side (the generator asks it of one shape) and left-of for each next pair, with the other phrasing's
    answers too. Only shapes clear of the middle and pairs clear of each other: an answer decided by a few pixels
    teaches little. The held-out sets are untouched (the generator's questions are the same)."""
    if it.kind != "scene":
        return []
    objs, size = it.meta["objects"], it.meta["size"]
    name = lambda o: f"{o['colour']} {o['shape']}"  # noqa: E731
    out = [(f"Is the {name(o)} on the left or the right?", "left" if o["x"] < size / 2 else "right")
           for o in objs if abs(o["x"] - size / 2) > o["r"]]
    for a, b in zip(objs, objs[1:]):
        if abs(a["x"] - b["x"]) > a["r"] + b["r"]:
            out.append((f"Is the {name(a)} left of the {name(b)}?", "yes" if a["x"] < b["x"] else "no"))
            out.append((f"Is the {name(a)} right of the {name(b)}?", "yes" if a["x"] > b["x"] else "no"))
    return [qa for qa in out if qa not in it.qa]


def sample_packed(step: int, i: int, mode: str = "image", mix: dict | None = None, positions: bool = False):
    """(generated item, chat content item, [(prompt, answer), ...]) of row ``i`` at ``step``: the item of the same
    stream as ``sample_item``'s, with every question the generator wrote for it (and with ``positions``,
    ``position_questions``) and then its caption."""
    rng, kind, it = _draw(step, i, mode, mix)
    extra = position_questions(it) if positions else []
    return it, _content(rng, kind, it, mode), [*it.qa, *extra, (_caption_prompt(kind), it.caption)]
