"""Short clips (8-16 frames): an object moving in a direction, objects appearing or disappearing."""

from __future__ import annotations

from PIL import Image, ImageDraw

from .common import BACKGROUNDS, COLOURS, SIZE, Item
from .scenes import SHAPES, draw_shape

DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


def clip(rng, size: int = SIZE, frames: int | None = None) -> Item:
    n = frames or rng.randint(8, 16)
    kind = rng.choice(("move", "appear", "disappear"))
    bg = rng.choice(sorted(BACKGROUNDS))
    shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
    r = size * 0.08
    out = []
    if kind == "move":
        direction = rng.choice(sorted(DIRECTIONS))
        dx, dy = DIRECTIONS[direction]
        span = size - 4 * r
        x0 = size / 2 - dx * span / 2 if dx else rng.uniform(2 * r, size - 2 * r)
        y0 = size / 2 - dy * span / 2 if dy else rng.uniform(2 * r, size - 2 * r)
        for t in range(n):
            img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
            f = t / (n - 1)
            draw_shape(ImageDraw.Draw(img), shape, x0 + dx * span * f, y0 + dy * span * f, r, COLOURS[colour])
            out.append(img)
        caption = f"A {colour} {shape} moves {direction}."
        qa = [(f"Which way does the {colour} {shape} move?", direction), ("How many shapes are there?", "1")]
        meta = {"type": kind, "direction": direction, "start": [x0, y0]}
    else:
        count = rng.randint(2, 4)
        spots = [(size * (i + 1) / (count + 1), size / 2) for i in range(count)]
        order = rng.sample(range(count), count)
        when = sorted(rng.sample(range(1, n), count))  # frame at which the k-th change happens
        for t in range(n):
            img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
            dr = ImageDraw.Draw(img)
            changed = {order[k] for k in range(count) if when[k] <= t}
            for i, (x, y) in enumerate(spots):
                if (i in changed) == (kind == "appear"):
                    draw_shape(dr, shape, x, y, r, COLOURS[colour])
            out.append(img)
        first = ["left", "middle", "right"][0 if order[0] == 0 else 2 if order[0] == count - 1 else 1]
        verb = "appear" if kind == "appear" else "disappear"
        caption = f"{count} {colour} {shape}s {verb} one after another."
        qa = [(f"How many {shape}s {verb}?", str(count)),
              (f"Do the {shape}s appear or disappear?", verb),
              (f"Where is the first {shape} to {verb}?", first)]
        meta = {"type": kind, "count": count, "order": order, "when": when, "spots": spots}
    return Item("clip", caption, qa, {**meta, "shape": shape, "colour": colour, "background": bg, "frames": n},
                frames=out)
