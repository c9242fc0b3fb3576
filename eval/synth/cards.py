"""Rendered text: a word, a number or a short line, in a font the machine has (or Pillow's own), colour and size."""

from __future__ import annotations

from PIL import Image, ImageDraw

from .common import BACKGROUNDS, COLOURS, SIZE, Item, draw_text, font

WORDS = ("apple", "river", "stone", "garden", "window", "rocket", "silver", "planet", "forest", "candle", "bridge",
         "orange", "pencil", "mirror", "island", "thunder", "yellow", "guitar", "castle", "meadow")


def card(rng, size: int = SIZE) -> Item:
    what = rng.choice(("word", "number", "line"))
    if what == "word":
        text = rng.choice(WORDS)
    elif what == "number":
        text = str(rng.randint(0, 99999))
    else:
        text = " ".join(rng.sample(WORDS, 3))
    colour = rng.choice([c for c in sorted(COLOURS) if c not in ("yellow",)])  # yellow on beige is unreadable
    bg = rng.choice(sorted(BACKGROUNDS))
    img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
    d = ImageDraw.Draw(img)
    pt = rng.randint(28, 56) if what != "line" else rng.randint(20, 30)
    f = font(rng, pt)
    box = d.textbbox((0, 0), text, font=f)
    w, h = box[2] - box[0], box[3] - box[1]
    x = rng.uniform(4, max(5, size - w - 4)) - box[0]
    y = rng.uniform(4, max(5, size - h - 4)) - box[1]
    chars = draw_text(d, (x, y), text, COLOURS[colour], f)
    kind = {"word": "The word", "number": "The number", "line": "The text"}[what]
    caption = f'{kind} "{text}" written in {colour} on a {bg} background.'
    qa = [("What does the text say?", text), ("What colour is the text?", colour)]
    if what == "number":
        qa.append(("How many digits does the number have?", str(len(text))))
    if what == "line":
        qa.append(("What is the first word?", text.split()[0]))
    return Item("text", caption, qa, {"text": text, "colour": colour, "background": bg, "pt": pt,
                                      "box": [x + box[0], y + box[1], x + box[2], y + box[3]], "chars": chars}, image=img)
