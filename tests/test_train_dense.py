"""The dense auxiliary targets (``eval/train/dense.py``) against hand-drawn images whose answers are known by
construction: a square's colour and shape cover exactly the patches drawn, a character's class sits in the half of
the patch holding its centre, and the heads' losses ignore what does not apply (no NaN on a batch without scenes)."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image, ImageDraw

from eval.synth.common import BACKGROUNDS, COLOURS, Item
from eval.synth.scenes import draw_shape
from eval.train import dense


def _scene(objects, bg="white", size=56):
    img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
    d = ImageDraw.Draw(img)
    for o in objects:
        draw_shape(d, o["shape"], o["x"], o["y"], o["r"], COLOURS[o["colour"]])
    return Item("scene", "", [], {"objects": objects, "background": bg}, image=img)


def test_a_square_labels_exactly_the_patches_it_covers():
    # 56 px, grid 4: 14 px patches; a red square over pixels 14..41 covers the middle 2 x 2 patches exactly
    sq = {"shape": "square", "colour": "red", "x": 27.5, "y": 27.5, "r": 13.5}
    t = dense.targets(_scene([sq], "beige"), grid=4)
    red, beige = dense.PALETTE_NAMES.index("red"), dense.PALETTE_NAMES.index("beige")
    want_colour = torch.full((4, 4), beige)
    want_colour[1:3, 1:3] = red
    assert torch.equal(t["colour"].reshape(4, 4), want_colour)
    want_shape = torch.zeros(4, 4, dtype=torch.long)
    want_shape[1:3, 1:3] = 1 + dense.SHAPES.index("square")
    assert torch.equal(t["shape"].reshape(4, 4), want_shape)
    assert int(t["count"]) == 1 and (t["chars"] == 0).all()  # a scene has no text


def test_thin_ink_names_the_patch_and_off_palette_pixels_do_not_vote():
    img = Image.new("RGB", (28, 28), BACKGROUNDS["white"])
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, 13, 1], fill=COLOURS["blue"])       # 28 of 196 pixels: 14% >= INK_SHARE
    d.rectangle([14, 14, 27, 27], fill=(0, 255, 255))       # cyan: far from every palette colour
    got = dense.colour_map(img, 2).tolist()
    white, blue = dense.PALETTE_NAMES.index("white"), dense.PALETTE_NAMES.index("blue")
    assert got == [blue, white, white, dense.IGNORE]


def test_characters_land_in_the_half_of_the_patch_that_holds_their_centre():
    # grid 2 on 28 px: 14 px patches, halves of 7 px
    chars = [["A", 1, 1, 5, 5],        # centre (3, 3): patch 0, left half
             ["b", 8, 1, 12, 5],       # centre (10, 3): patch 0, right half
             ["7", 14, 15, 18, 19],    # centre (16, 17): patch 3, left half
             ["é", 21, 15, 26, 19],    # not in CHARS: no label
             ["z", 40, 1, 44, 5]]      # outside the image
    got = dense.char_map(chars, 28, 2).reshape(4, 2).tolist()
    cls = {c: 1 + dense.CHARS.index(c) for c in "Ab7"}
    assert got == [[cls["A"], cls["b"]], [0, 0], [0, 0], [cls["7"], 0]]


def test_generated_text_boxes_follow_the_drawn_ink():
    """``draw_text``'s boxes (the reading targets) cover the ink the card actually drew, in reading order."""
    from eval.synth.make import make

    it = make("text", random.Random("dense-test/3"))
    boxes = it.meta["chars"]
    assert "".join(b[0] for b in boxes) == it.meta["text"].replace(" ", "")
    assert all(b[1] < b[3] and b[2] < b[4] for b in boxes) and [b[1] for b in boxes] == sorted(b[1] for b in boxes)
    x0, y0, x1, y1 = it.meta["box"]
    assert boxes[0][1] <= x0 + 3 and boxes[-1][3] >= x1 - 3 and boxes[0][2] <= y0 + 1 and boxes[0][4] >= y1 - 1


@pytest.mark.parametrize("kind", ["text", "document", "chart"])
def test_targets_of_every_image_kind_have_the_grid_shape(kind):
    from eval.synth.make import make

    t = dense.targets(make(kind, random.Random(f"dense-test/{kind}")), grid=24)
    assert t["colour"].shape == t["shape"].shape == (576,) and t["chars"].shape == (576, 2)
    assert int(t["count"]) == dense.IGNORE and (t["chars"] > 0).sum() >= 1  # every kind prints some text
    assert (t["shape"] == (0 if kind != "chart" else dense.IGNORE)).all()


def test_head_losses_ignore_what_does_not_apply():
    torch.manual_seed(0)
    heads = dense.Heads(8)
    tokens = torch.randn(2, 4, 8)
    batch = dense.collate([{"colour": torch.tensor([0, 1, 2, dense.IGNORE]), "shape": torch.zeros(4, dtype=torch.long),
                            "chars": torch.zeros(4, 2, dtype=torch.long), "count": torch.tensor(dense.IGNORE)}] * 2)
    out = heads(tokens, batch)
    assert out["count"].item() == 0.0 and all(torch.isfinite(v) for v in out.values())
    keep = batch["aux_colour"].flatten() != dense.IGNORE
    ref = torch.nn.functional.cross_entropy(heads.colour(tokens).flatten(0, 1)[keep], batch["aux_colour"].flatten()[keep])
    assert torch.allclose(out["colour"], ref)


def test_position_heads_read_each_tokens_row_and_column():
    torch.manual_seed(0)
    heads = dense.Heads(8, ("position",), grid=3)
    tokens = torch.randn(2, 9, 8)
    out = heads(tokens, {})
    assert set(out) == {"row", "column"}
    rows, cols = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2] * 2), torch.tensor([0, 1, 2] * 6)
    ce = torch.nn.functional.cross_entropy
    assert torch.allclose(out["row"], ce(heads.row(tokens).flatten(0, 1), rows))
    assert torch.allclose(out["column"], ce(heads.column(tokens).flatten(0, 1), cols))
    # tokens that carry their grid position are read exactly once fitted: the target is learnable from the token
    onehot = torch.eye(9).expand(2, -1, -1)
    fit = dense.Heads(9, ("position",), grid=3)
    opt = torch.optim.Adam(fit.parameters(), lr=0.1)
    for _ in range(200):
        opt.zero_grad()
        sum(fit(onehot, {}).values()).backward()
        opt.step()
    assert all(v.item() < 0.05 for v in fit(onehot, {}).values())
    with pytest.raises(ValueError, match="3x3 tokens"):
        heads(torch.randn(1, 4, 8), {})
    with pytest.raises(ValueError, match="grid"):
        dense.Heads(8, ("position",))
    with pytest.raises(ValueError, match="some of"):
        dense.Heads(8, ("colour", "depth"))
    assert not hasattr(dense.Heads(8, ("colour",)), "shape")  # only the heads asked for: no unused parameters


def test_place_heads_score_row_and_column_only_under_a_shape():
    """"place" is "position" restricted to the tokens a scene's shape covers (``aux_shape`` > 0): background,
    text/document (0) and chart (IGNORE) tokens add nothing; with "position" too, both share the two heads."""
    torch.manual_seed(0)
    heads = dense.Heads(8, ("position", "place"), grid=3)
    assert sum(p.numel() for p in heads.parameters()) == 2 * (8 * 3 + 3)
    tokens = torch.randn(2, 9, 8)
    shape = torch.tensor([[0, 2, 0, 0, 0, 5, 0, 0, 1], [dense.IGNORE] * 9])
    out = heads(tokens, {"aux_shape": shape})
    assert set(out) == {"row", "column", "place row", "place column"}
    on = torch.tensor([1, 5, 8])  # the covered tokens of image 0: grid (0, 1), (1, 2), (2, 2)
    ce = torch.nn.functional.cross_entropy
    assert torch.allclose(out["place row"], ce(heads.row(tokens[0, on]), torch.tensor([0, 1, 2])))
    assert torch.allclose(out["place column"], ce(heads.column(tokens[0, on]), torch.tensor([1, 2, 2])))
    assert not torch.allclose(out["place row"], out["row"])
    # no covered token in the batch: 0, not NaN
    none = dense.Heads(8, ("place",), grid=3)(tokens, {"aux_shape": torch.zeros(2, 9, dtype=torch.long)})
    assert all(v.item() == 0.0 for v in none.values())


def test_aux_kinds_enter_the_plan_only_when_not_the_default(tmp_path):
    from eval.train import towers

    args = towers.parser("").parse_args(["--out", str(tmp_path), "--steps", "1", "--aux", "0.5",
                                         "--aux-kinds", "colour,position"])
    assert towers.new_plan(args)["aux_kinds"] == ["colour", "position"]
    args = towers.parser("").parse_args(["--out", str(tmp_path), "--steps", "1", "--aux", "0.5"])
    assert "aux_kinds" not in towers.new_plan(args)
    with pytest.raises(SystemExit):
        towers.main(["--model", "demo-llava", "--out", str(tmp_path), "--steps", "1", "--aux", "1",
                     "--aux-kinds", "depth"])


def test_heads_at_the_projectors_output_read_what_the_language_model_reads(tmp_path):
    """``--aux-at output``: the heads take the projector's output width and the tokens it returned (the hook holds
    exactly the projector's result); the choice enters the plan only when not the default."""
    from eval.train import towers

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    class Model(torch.nn.Module):  # the attribute path dense reads: model.model.multi_modal_projector
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.multi_modal_projector = Proj()
            self.config = type("C", (), {"vision_config": type("V", (), {"image_size": 6, "patch_size": 2})()})()

    m = Model()
    heads_in, held_in, grid = dense.attach(m, "cpu", ("position",))
    heads_out, held_out, _ = dense.attach(m, "cpu", ("position",), at="output")
    assert grid == 3 and heads_in.row.in_features == 6 and heads_out.row.in_features == 4
    x = torch.randn(2, 9, 6)
    y = m.model.multi_modal_projector(x)
    assert held_in["x"] is x and torch.equal(held_out["x"], y)
    assert set(heads_out(held_out["x"], {})) == {"row", "column"}
    with pytest.raises(ValueError, match="input or output"):
        dense.attach(m, "cpu", ("position",), at="middle")
    args = towers.parser("").parse_args(["--out", str(tmp_path), "--steps", "1", "--aux", "0.5", "--aux-at", "output"])
    assert towers.new_plan(args)["aux_at"] == "output"
    args = towers.parser("").parse_args(["--out", str(tmp_path), "--steps", "1", "--aux", "0.5"])
    assert "aux_at" not in towers.new_plan(args)
