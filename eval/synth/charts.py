"""Bar and line charts with labelled categories: which is highest, a value, the trend."""

from __future__ import annotations

from PIL import Image, ImageDraw

from .common import COLOURS, SIZE, Item, draw_text, font


def chart(rng, size: int = SIZE) -> Item:
    kind = rng.choice(("bar", "line"))
    n = rng.randint(3, 6)
    labels = [chr(ord("A") + i) for i in range(n)]
    values = rng.sample(range(1, 10), n)  # distinct: "the highest" is unambiguous
    img = Image.new("RGB", (size, size), (250, 250, 250))
    d = ImageDraw.Draw(img)
    f = font(rng, 16)
    left, bottom, top = 40, size - 40, 30
    unit = (bottom - top) / 10
    d.line([(left, top), (left, bottom), (size - 16, bottom)], fill=(20, 20, 20), width=2)
    chars = []
    for v in range(0, 11, 2):
        chars += draw_text(d, (8, bottom - v * unit - 8), str(v), (60, 60, 60), f)
    step = (size - 16 - left) / n
    colour = rng.choice([c for c in sorted(COLOURS) if c not in ("grey", "yellow")])
    pts = []
    for i, (lab, v) in enumerate(zip(labels, values, strict=True)):
        cx = left + step * (i + 0.5)
        if kind == "bar":
            d.rectangle([cx - step * 0.3, bottom - v * unit, cx + step * 0.3, bottom - 1], fill=COLOURS[colour])
        pts.append((cx, bottom - v * unit))
        chars += draw_text(d, (cx - 5, bottom + 8), lab, (20, 20, 20), f)
    if kind == "line":
        d.line(pts, fill=COLOURS[colour], width=3)
        for x, y in pts:
            d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=COLOURS[colour])
    hi = labels[values.index(max(values))]
    lo = labels[values.index(min(values))]
    k = rng.randrange(n)
    qa = [("Which category has the highest value?", hi), ("Which category has the lowest value?", lo),
          (f"What is the value of {labels[k]}?", str(values[k])), ("How many categories are there?", str(n)),
          ("What kind of chart is this?", f"{kind} chart")]
    if kind == "line":
        trend = "up" if values[-1] > values[0] else "down"
        qa.append(("Does the line end higher or lower than it starts?", "higher" if trend == "up" else "lower"))
    caption = f"A {colour} {kind} chart of {n} categories, {hi} highest at {max(values)}."
    return Item("chart", caption, qa, {"type": kind, "labels": labels, "values": values, "colour": colour,
                                    "chars": chars},
                image=img)
