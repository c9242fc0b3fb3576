"""The item type, the seeded streams, the palette and the fonts every generator shares."""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from PIL import ImageFont

SIZE = 336  # LLaVA-1.5's input side; InternVL's 448 tiles are made by resizing

COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
           "purple": (140, 60, 180), "orange": (240, 130, 30), "black": (20, 20, 20), "grey": (128, 128, 128)}
BACKGROUNDS = {"white": (250, 250, 250), "beige": (240, 230, 210), "light blue": (215, 230, 245)}

# Pillow's bundled scalable font (Aileron Regular, SIL Open Font Licence, inside the Pillow wheel) is the only font
# by default: an item must be the same image on every machine, or a tower trained where no system fonts exist (the
# GPU image) cannot read the held-out documents of a machine with DejaVu (ANLS 0.55 -> 0.11 on 24 of them, demo-llava).
FONTS_ENV = "MMKV_SYNTH_FONTS"
_FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/truetype/liberation", "/Library/Fonts",
              "C:/Windows/Fonts")


@dataclass
class Item:
    kind: str
    caption: str
    qa: list[tuple[str, str]]
    meta: dict
    image: object = None                       # PIL.Image (RGB)
    frames: list = field(default_factory=list)  # PIL.Images of a clip


def rng_for(seed: int, kind: str, i: int) -> random.Random:
    """Item ``i`` of ``kind`` draws from its own stream: adding items or kinds never changes the others."""
    return random.Random(zlib.crc32(f"{seed}/{kind}/{i}".encode()))


@cache
def _font_files(choice: str) -> tuple[str, ...]:
    if choice in ("", "bundled"):
        return ()
    dirs = _FONT_DIRS if choice == "system" else (choice,)
    if choice != "system" and not Path(choice).is_dir():
        raise ValueError(f"{FONTS_ENV}={choice!r}: expected 'bundled', 'system' or a folder of .ttf files")
    found = []
    for d in dirs:
        p = Path(d)
        if p.is_dir():
            found += sorted(str(f) for f in p.glob("*.ttf") if "Bold" not in f.name and "Oblique" not in f.name
                            and "Italic" not in f.name)
    return tuple(found[:8])


def font_files() -> tuple[str, ...]:
    """The .ttf files drawn from besides Pillow's bundled font: none unless ``MMKV_SYNTH_FONTS`` says "system" (the
    machine's DejaVu/Liberation/...) or names a folder. Either changes every text item (and the draws after its font),
    so neither may be used for held-out sets or the shipped towers."""
    return _font_files(os.environ.get(FONTS_ENV, "").strip())


def draw_text(d, xy: tuple[float, float], text: str, fill, font) -> list[list]:
    """Draw ``text`` at ``xy`` (as ``ImageDraw.text`` does) and return each visible character's box
    ``[char, x0, y0, x1, y1]`` (horizontal extent from the advance widths of its prefixes, vertical from the line's
    ink): what a trainer's per-patch reading targets are cut from (``eval/train/dense.py``)."""
    d.text(xy, text, fill=fill, font=font)
    top, bottom = d.textbbox(xy, text, font=font)[1::2]
    out, x = [], xy[0]
    for i, ch in enumerate(text):
        nxt = xy[0] + d.textlength(text[:i + 1], font=font)
        if not ch.isspace():
            out.append([ch, x, top, nxt, bottom])
        x = nxt
    return out


def font(rng: random.Random, size: int):
    files = font_files()
    pick = rng.randrange(len(files) + 1)
    if pick < len(files):
        return ImageFont.truetype(files[pick], size)
    return ImageFont.load_default(size=size)  # Pillow's bundled scalable font
