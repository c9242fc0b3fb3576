"""Auxiliary supervision for a demo tower from the generator's own labels: small heads on the tokens the projector
reads predict, per patch, the colour under it, the shape under it and the characters whose centres fall in its left
and right halves, per image the number of shapes, and (``--aux-kinds ...,position``) each token's row and column.
Used only in training (``eval/train/towers.py --aux``); the heads are never exported, so the shipped tower keeps the
architecture the loaders build.

Why: the answer-token loss reaches the tower only through a frozen language model, a few tokens a row; a tower
trained from scratch on it alone learned little (a linear probe on the shipped demo-llava tower's patch tokens,
``eval/train/probe.py``: docs/results/demo_quality_tw2/). Per-patch targets give every one of the 576 tokens of
every image a direct signal.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from PIL import Image, ImageDraw

from eval.synth.common import BACKGROUNDS, COLOURS
from eval.synth.scenes import SHAPES, draw_shape

PALETTE = {**COLOURS, **BACKGROUNDS}
PALETTE_NAMES = list(PALETTE)
_RGB = np.array(list(PALETTE.values()), dtype=np.float32)
CHARS = [chr(c) for c in range(33, 127)]  # printable ASCII without the space; class 0 is "no character"
MAX_COUNT = 5  # scenes hold 1-5 shapes
IGNORE = -100
# a patch is named by its ink when at least this share of its pixels is a foreground colour, else by its background
INK_SHARE = 0.08
FOREGROUND = len(COLOURS)  # palette indices below this are the shapes' / text's colours


@cache
def _palette_image() -> Image.Image:
    """``PALETTE`` as a P-mode image for ``Image.quantize`` (nearest colour in C: ~50x faster than numpy here)."""
    pal = Image.new("P", (1, 1))
    flat = [int(v) for rgb in PALETTE.values() for v in rgb]
    pal.putpalette(flat + flat[-3:] * (256 - len(PALETTE)))
    return pal


def _patch_votes(idx: np.ndarray, grid: int, classes: int) -> np.ndarray:
    """``[grid * grid, classes]`` pixel counts of each class per patch (one ``bincount`` for the whole image)."""
    h, w = idx.shape
    rows = np.minimum(np.arange(h) * grid // h, grid - 1)
    cols = np.minimum(np.arange(w) * grid // w, grid - 1)
    patch = rows[:, None] * grid + cols[None, :]
    return np.bincount((patch * classes + idx).ravel(), minlength=grid * grid * classes).reshape(grid * grid, classes)


def colour_map(image: Image.Image, grid: int) -> np.ndarray:
    """``[grid * grid]`` palette index per patch: the commonest foreground colour when it covers ``INK_SHARE`` of
    the patch, else the commonest colour; pixels far from every palette colour (antialiased edges, chart axes) vote
    for nothing (``IGNORE`` where no pixel votes)."""
    rgb = image.convert("RGB")
    idx = np.asarray(rgb.quantize(palette=_palette_image(), dither=Image.Dither.NONE), dtype=np.int64)
    idx = np.minimum(idx, len(PALETTE) - 1)  # the padding entries repeat the last colour
    far = ((np.asarray(rgb, dtype=np.int32) - _RGB.astype(np.int32)[idx]) ** 2).sum(-1) > 45 ** 2
    idx[far] = len(PALETTE)  # "none"
    votes = _patch_votes(idx, grid, len(PALETTE) + 1)
    fg = votes[:, :FOREGROUND]
    out = np.where(fg.max(1) >= INK_SHARE * votes.sum(1), fg.argmax(1), votes[:, :len(PALETTE)].argmax(1))
    return np.where(votes[:, :len(PALETTE)].any(1), out, IGNORE).astype(np.int64)


def shape_map(objects: list[dict], size: int, grid: int) -> np.ndarray:
    """``[grid * grid]``: 1 + the index in ``SHAPES`` of the shape covering most of the patch (>= 15%), else 0."""
    label = Image.new("L", (size, size), 0)
    d = ImageDraw.Draw(label)
    for o in objects:
        draw_shape(d, o["shape"], o["x"], o["y"], o["r"], 1 + SHAPES.index(o["shape"]))
    votes = _patch_votes(np.asarray(label, dtype=np.int64), grid, len(SHAPES) + 1)
    return np.where(votes[:, 1:].max(1) >= 0.15 * votes.sum(1), votes[:, 1:].argmax(1) + 1, 0).astype(np.int64)


def char_map(chars: list[list], size: int, grid: int) -> np.ndarray:
    """``[grid, grid, 2]``: the class (1 + index in ``CHARS``) of the character whose centre lies in the patch's
    left / right half, 0 where none does (the later character wins a half that holds two)."""
    out = np.zeros((grid, grid, 2), dtype=np.int64)
    p = size / grid
    for ch, x0, y0, x1, y1 in chars:
        if ch not in CHARS:
            continue
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        r, c = int(cy // p), int(cx // p)
        if 0 <= r < grid and 0 <= c < grid:
            out[r, c, int((cx - c * p) >= p / 2)] = 1 + CHARS.index(ch)
    return out


def targets(item, grid: int) -> dict[str, torch.Tensor]:
    """Per-patch and per-image targets of one generated image (``IGNORE`` where a target does not apply)."""
    size = item.image.width
    colour = torch.from_numpy(colour_map(item.image, grid))
    if item.kind == "scene":
        shape = torch.from_numpy(shape_map(item.meta["objects"], size, grid))
        count = torch.tensor(len(item.meta["objects"]))
    else:  # no shapes on text cards and documents; a chart's bars and dots are not the scenes' shapes
        shape = torch.full((grid * grid,), 0 if item.kind in ("text", "document") else IGNORE)
        count = torch.tensor(IGNORE)
    chars = torch.from_numpy(char_map(item.meta.get("chars", []), size, grid)).reshape(-1, 2)
    return {"colour": colour, "shape": shape, "chars": chars, "count": count}


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {f"aux_{k}": torch.stack([r[k] for r in rows]) for k in rows[0]}


KINDS = ("colour", "shape", "chars", "count")  # ``--aux``'s heads unless ``--aux-kinds`` says otherwise
GRID_KINDS = ("position", "place")  # read by the same two heads, each token's row and column
ALL_KINDS = (*KINDS, *GRID_KINDS)


class Heads(torch.nn.Module):
    """Linear heads on the projector's input tokens ``[rows, tokens, dim]``, one per kind of ``kinds``.

    "position": each token's row and column in its image's ``grid`` x ``grid`` tokens, from the token alone. The
    trained towers' tokens had lost where they are (a probe read an object's half of the image at chance, where a
    random tower's tokens tell it: docs/BENCHMARKS.md), and without that the language model cannot say which of two
    named shapes is left of the other; the target is the token's index, the same for every image.

    "place": the same row and column, scored only on the tokens a scene's shape covers (``aux_shape`` > 0). Why:
    position heads on every token at the projector's output taught its background tokens where they are (a probe
    over random tokens: column 0.84), not the tokens under an object (that object's half of the image: chance), and
    the questions ask where an object is. With "position" too, both losses share the two heads."""

    def __init__(self, dim: int, kinds: tuple[str, ...] = KINDS, grid: int | None = None):
        super().__init__()
        unknown = set(kinds) - set(ALL_KINDS)
        if unknown or not kinds:
            raise ValueError(f"auxiliary heads must be some of {ALL_KINDS}, got {kinds}")
        self.kinds, self.grid = tuple(kinds), grid
        sizes = {"colour": len(PALETTE), "shape": len(SHAPES) + 1, "chars": 2 * (len(CHARS) + 1),
                 "count": MAX_COUNT + 1}
        # the grid kinds' one pair of heads is made where the first of them stands (the same init order as before)
        for k in dict.fromkeys("grid" if k in GRID_KINDS else k for k in self.kinds):
            if k != "grid":
                setattr(self, k, torch.nn.Linear(dim, sizes[k]))
            elif not grid:
                raise ValueError("position heads need the token grid's side")
            else:
                self.row, self.column = torch.nn.Linear(dim, grid), torch.nn.Linear(dim, grid)

    def forward(self, tokens: torch.Tensor, batch: dict) -> dict[str, torch.Tensor]:
        """Each head's cross-entropy (mean over the positions its target applies to; 0 where none does)."""
        t = tokens.float()
        heads = {"colour": lambda: _ce(self.colour(t).flatten(0, 1), batch["aux_colour"].flatten()),
                 "shape": lambda: _ce(self.shape(t).flatten(0, 1), batch["aux_shape"].flatten()),
                 "chars": lambda: _ce(self.chars(t).reshape(-1, len(CHARS) + 1), batch["aux_chars"].flatten()),
                 "count": lambda: _ce(self.count(t.mean(1)), batch["aux_count"])}
        out = {k: heads[k]() for k in self.kinds if k not in GRID_KINDS}
        if "position" in self.kinds:
            out.update(self._position(t))
        if "place" in self.kinds:
            out.update({f"place {k}": v for k, v in self._position(t, batch["aux_shape"].flatten() > 0).items()})
        return out

    def _position(self, t: torch.Tensor, on: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Row and column cross-entropy over every token, or (``on``: [rows * tokens] bool) over those tokens only."""
        if t.shape[1] != self.grid * self.grid:
            raise ValueError(f"position heads expect {self.grid}x{self.grid} tokens an image, got {t.shape[1]}")
        idx = torch.arange(t.shape[1], device=t.device).expand(t.shape[0], -1).flatten()
        rows, cols = idx // self.grid, idx % self.grid
        if on is not None:  # IGNORE off the chosen tokens: no boolean indexing, so no host sync
            rows, cols = rows.masked_fill(~on, IGNORE), cols.masked_fill(~on, IGNORE)
        return {"row": _ce(self.row(t).flatten(0, 1), rows), "column": _ce(self.column(t).flatten(0, 1), cols)}


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # a batch without any such target (no scene among its rows) gives 0, not the NaN of a mean over nothing; no
    # host sync (the count stays on the device)
    valid = (target != IGNORE).sum()
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum")
    return loss / valid.clamp(min=1)


def aux_grid(model) -> int:
    """Tokens a side of one image at the projector's input: demo-llava 336/14 = 24, demo-internvl 448/14 = 32
    pixel-shuffled by 0.5 to 16."""
    v = model.config.vision_config
    side = v.image_size if isinstance(v.image_size, int) else v.image_size[0]
    patch = v.patch_size if isinstance(v.patch_size, int) else v.patch_size[0]
    return round(side // patch * getattr(model.config, "downsample_ratio", 1.0))


def projector_input(model) -> tuple[dict, torch.nn.Linear]:
    """A dict that holds the projector's latest input (``"x"``: ``[images, tokens, dim]``) through a forward
    pre-hook, and the projector's first linear layer (whose input width the heads take)."""
    held: dict = {}
    proj = model.model.multi_modal_projector
    proj.register_forward_pre_hook(lambda _m, args: held.__setitem__("x", args[0]))
    first = next(m for m in proj.modules() if isinstance(m, torch.nn.Linear))
    return held, first


def projector_output(model) -> tuple[dict, int]:
    """A dict that holds the projector's latest output (``"x"``: ``[images, tokens, dim]``, what the language model
    reads) through a forward hook, and that output's width."""
    held: dict = {}
    proj = model.model.multi_modal_projector
    proj.register_forward_hook(lambda _m, _a, out: held.__setitem__("x", out))
    last = [m for m in proj.modules() if isinstance(m, torch.nn.Linear)][-1]
    return held, last.out_features


def attach(model, device, kinds: tuple[str, ...] = KINDS, at: str = "input") -> tuple[Heads, dict, int]:
    """(heads of ``kinds`` on ``device``, the dict holding the projector's latest input, or with ``at="output"`` its
    output, tokens a side of one image). Why the output: position heads on the input made every token carry its row
    and column there, and the projector dropped them again (a probe on demo-internvl: side 0.98 before the
    projector, 0.49 after; docs/BENCHMARKS.md)."""
    if at not in ("input", "output"):
        raise ValueError(f"auxiliary heads sit at the projector's input or output, got {at!r}")
    if at == "output":
        held, dim = projector_output(model)
    else:
        held, first = projector_input(model)
        dim = first.in_features
    grid = aux_grid(model)
    return Heads(dim, kinds, grid).to(device), held, grid


def losses(heads: Heads | None, held: dict, batch: dict) -> dict[str, torch.Tensor]:
    """The heads' losses for this step, or {} (no heads, no targets: a clip or tiled step)."""
    if heads is None or "aux_colour" not in batch:
        return {}
    # one image a row (a demo-internvl image may be tiled): only then do targets and tokens line up
    if held["x"].shape[0] != batch["aux_colour"].shape[0]:
        return {}
    return heads(held["x"], batch)
