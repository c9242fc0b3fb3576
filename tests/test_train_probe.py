"""The towers' linear probes (``eval/train/probe.py``, issue 28): object tokens on either token grid, and
demo-internvl's features on both sides of its projector."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.slow


def test_object_tokens_on_both_grids_against_a_loop():
    from eval.synth.make import make
    from eval.train.probe import labels

    items = [make("scene", random.Random(f"probe-test/{i}")) for i in range(3)]
    for grid in (24, 16):
        got = labels(items, grid)["object"]
        want = []
        for it in items:
            cell = it.meta["size"] / grid
            want += [int(o["y"] // cell) * grid + int(o["x"] // cell) for o in it.meta["objects"]]
        assert got["token"] == want and max(want) < grid * grid
        assert got["side"] == [int(o["x"] >= it.meta["size"] / 2) for it in items for o in it.meta["objects"]]


def test_internvl_features_are_the_projectors_input_and_output(smollm2_load_info):
    from eval.train.probe import features_internvl, scenes
    from mmkv.models.demo import load_demo

    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    model, processor, _ = load_demo("demo-internvl", "cpu", torch.float32, vision=tiny, tower_dir="random")
    items = scenes(3)
    f = features_internvl(model, processor, items, batch=2)
    assert f["tower"].shape[:2] == f["projector"].shape[:2] == (3, 256)
    assert f["tower"].shape[2] == 4 * tiny["hidden_size"]  # pixel shuffle by 0.5: four tokens' channels
    assert f["projector"].shape[2] == model.config.text_config.hidden_size
    with torch.no_grad():  # the output is the projector applied to the input, as get_image_features returns it
        again = model.model.multi_modal_projector(f["tower"].float())
    assert torch.allclose(again.half(), f["projector"], atol=2e-3, rtol=1e-2)


def test_token_positions_are_each_drawn_tokens_column_and_side():
    """The "token side / column" probes' targets: distinct (image, token) pairs, and each token's own place in the
    grid (a 4 x 4 grid here: column = index % 4, side = column // 2)."""
    from eval.train.probe import token_positions

    t = token_positions(5, 16, k=40)
    pairs = set(zip(t["image"].tolist(), t["token"].tolist(), strict=True))
    assert len(pairs) == 40 and t["image"].max() < 5 and t["token"].max() < 16
    for tok, col, side in zip(t["token"].tolist(), t["column"].tolist(), t["side"].tolist(), strict=True):
        assert col == tok % 4 and side == int(col >= 2)
    assert token_positions(5, 16, k=500)["image"].numel() == 80  # no more than there are
    assert torch.equal(token_positions(5, 16, k=40)["token"], t["token"])  # fixed seed: the same draw
