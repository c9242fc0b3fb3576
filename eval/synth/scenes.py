"""Scenes of shapes: colour, shape, count, position, size and left/right/above/below relations."""

from __future__ import annotations

import math

from PIL import Image, ImageDraw

from .common import BACKGROUNDS, COLOURS, SIZE, Item

SHAPES = ("circle", "square", "triangle")


def draw_shape(d: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon([(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)],
                  fill=fill)


def _place(rng, n: int, size: int) -> list[tuple[float, float, float]]:
    """n non-overlapping discs (cx, cy, r) inside the image."""
    out = []
    while len(out) < n:
        r = rng.choice((size * 0.07, size * 0.13))
        cx, cy = rng.uniform(r + 4, size - r - 4), rng.uniform(r + 4, size - r - 4)
        if all(math.hypot(cx - x, cy - y) > r + q + 6 for x, y, q in out):
            out.append((cx, cy, r))
    return out


def scene(rng, size: int = SIZE, max_objects: int = 5) -> Item:
    n = rng.randint(1, max_objects)
    bg = rng.choice(sorted(BACKGROUNDS))
    img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
    d = ImageDraw.Draw(img)
    objs = []
    combos = rng.sample([(s, c) for s in SHAPES for c in sorted(COLOURS) if COLOURS[c] != BACKGROUNDS[bg]], n)
    for (cx, cy, r), (shape, colour) in zip(_place(rng, n, size), combos, strict=True):  # no two alike: unambiguous
        draw_shape(d, shape, cx, cy, r, COLOURS[colour])
        objs.append({"shape": shape, "colour": colour, "x": cx, "y": cy, "r": r,
                     "size": "large" if r > size * 0.1 else "small"})
    names = [f"a {o['size']} {o['colour']} {o['shape']}" for o in objs]
    caption = (names[0] if n == 1 else ", ".join(names[:-1]) + " and " + names[-1]) + f" on a {bg} background."
    caption = caption[0].upper() + caption[1:]
    qa = [("How many shapes are there?", str(n)), ("What colour is the background?", bg)]
    o = objs[0]
    qa.append((f"Is there a {o['colour']} {o['shape']}?", "yes"))
    absent = [(c, s) for c in sorted(COLOURS) for s in SHAPES
              if not any(p["colour"] == c and p["shape"] == s for p in objs)]
    c, s = rng.choice(absent)
    qa.append((f"Is there a {c} {s}?", "no"))
    for shape in SHAPES:
        qa.append((f"How many {shape}s are there?", str(sum(p["shape"] == shape for p in objs))))
    if n >= 2:
        a, b = rng.sample(objs, 2)
        qa.append((f"Is the {a['colour']} {a['shape']} left of the {b['colour']} {b['shape']}?",
                   "yes" if a["x"] < b["x"] else "no"))
        qa.append((f"Is the {a['colour']} {a['shape']} above the {b['colour']} {b['shape']}?",
                   "yes" if a["y"] < b["y"] else "no"))
        top = min(objs, key=lambda p: p["y"])
        qa.append(("What colour is the highest shape?", top["colour"]))
    side = "left" if o["x"] < size / 2 else "right"
    qa.append((f"Is the {o['colour']} {o['shape']} on the left or the right?", side))
    return Item("scene", caption, qa, {"objects": objs, "background": bg, "size": size}, image=img)
