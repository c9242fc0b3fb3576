"""Documents: receipts, forms and tables with key/value questions (DocVQA's style: the answer is text on the page)."""

from __future__ import annotations

from PIL import Image, ImageDraw

from .common import SIZE, Item, draw_text, font

ITEMS = ("coffee", "bread", "milk", "tea", "rice", "soap", "juice", "apples", "pasta", "butter")
NAMES = ("Ada Brown", "Ben Clark", "Cleo Diaz", "Dan Evans", "Eve Fox", "Finn Gray", "Gia Hale", "Hugo Ito")
CITIES = ("Lyon", "Oslo", "Porto", "Kyoto", "Quito", "Perth", "Cairo", "Turin")


def _date(rng) -> str:
    return f"{rng.randint(2019, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def document(rng, size: int = SIZE) -> Item:
    kind = rng.choice(("receipt", "form", "table"))
    img = Image.new("RGB", (size, size), (252, 252, 248))
    d = ImageDraw.Draw(img)
    f = font(rng, 15)
    lines: list[str] = []
    qa: list[tuple[str, str]] = []
    if kind == "receipt":
        shop = rng.choice(CITIES) + " Market"
        rows = [(it, rng.randint(1, 4), rng.randint(50, 990)) for it in rng.sample(ITEMS, rng.randint(2, 5))]
        total = sum(q * c for _, q, c in rows)
        date = _date(rng)
        lines = [shop, f"Date: {date}", *(f"{it} x{q}  {q * c / 100:.2f}" for it, q, c in rows), f"TOTAL  {total / 100:.2f}"]
        qa = [("What is the total?", f"{total / 100:.2f}"), ("What is the date?", date),
              ("What is the name of the shop?", shop), ("How many items are listed?", str(len(rows)))]
        it, q, c = rng.choice(rows)
        qa.append((f"How much does the {it} cost?", f"{q * c / 100:.2f}"))
        caption = f"A receipt from {shop} dated {date} with {len(rows)} items, total {total / 100:.2f}."
    elif kind == "form":
        name, city = rng.choice(NAMES), rng.choice(CITIES)
        number = str(rng.randint(10000, 99999))
        date = _date(rng)
        lines = ["APPLICATION FORM", f"Name: {name}", f"City: {city}", f"Member No: {number}", f"Date: {date}"]
        qa = [("What is the name on the form?", name), ("Which city is given?", city),
              ("What is the member number?", number), ("What is the date?", date)]
        caption = f"An application form for {name} from {city}, member number {number}."
    else:
        cols = rng.sample(CITIES, 3)
        years = sorted(rng.sample(range(2015, 2025), 3))
        vals = {(y, c): rng.randint(10, 99) for y in years for c in cols}
        lines = ["Year  " + "  ".join(cols)] + [f"{y}  " + "  ".join(f"{vals[(y, c)]:>{len(c)}}" for c in cols)
                                                for y in years]
        y, c = rng.choice(years), rng.choice(cols)
        best = max(cols, key=lambda cc: (vals[(years[-1], cc)], cc))
        qa = [(f"What is the value for {c} in {y}?", str(vals[(y, c)])), ("How many years are listed?", "3"),
              (f"Which city has the highest value in {years[-1]}?", best)]
        caption = f"A table of values for {', '.join(cols)} in {years[0]}-{years[-1]}."
    y, chars = 14, []
    for ln in lines:
        chars += draw_text(d, (14, y), ln, (25, 25, 25), f)
        y += 22
    return Item("document", caption, qa, {"type": kind, "lines": lines, "chars": chars}, image=img)
