"""The anchor loss (``eval/train/anchor.py``) against values computed by hand on 2-d tokens and anchors: cosine
logits over a temperature, cross-entropy only where a label applies (shape's "none" and patches without a character
are skipped, the left half's character wins), 0 and not NaN on a batch without labels; a label word's anchor is
the normalized mean of its spellings' normalized token rows; the weight decays linearly to 0 at the plan's end."""

from __future__ import annotations

import math

import pytest
import torch

from eval.train import anchor
from eval.train.dense import IGNORE


def _anchors(tau=0.5):
    # colours: 3 unit vectors at 0, 90 and 180 degrees; shapes: 2; chars: 2 (the module only reads the rows)
    vec = {"colour": torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]),
           "shape": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
           "chars": torch.tensor([[0.0, 1.0], [1.0, 0.0]])}
    return anchor.Anchors(vec, tau)


def _batch(colour, shape, chars):
    return {"aux_colour": torch.tensor([colour]), "aux_shape": torch.tensor([shape]),
            "aux_chars": torch.tensor([chars])}


def test_loss_matches_a_hand_computed_reference():
    tau = 0.5
    # token 0 points along +x (norm 3: only the direction counts), token 1 along +y (norm 0.5), token 2 at 45 degrees
    tokens = torch.tensor([[[3.0, 0.0], [0.0, 0.5], [2.0, 2.0]]])
    batch = _batch(colour=[0, 2, IGNORE],
                   shape=[1, 0, 2],              # 1 + index: circle-like class 0 at token 0, none at 1, class 1 at 2
                   chars=[[0, 0], [2, 1], [0, 1]])  # none; left (class 1) wins over right; right only (class 0)
    out = _anchors(tau)(tokens, batch)

    def ce(logits, k):
        return -(logits[k] - math.log(sum(math.exp(x) for x in logits)))

    s = 1 / math.sqrt(2)
    # colour: token 0 cos (1, 0, -1) target 0; token 1 cos (0, 1, 0) target 2; token 2 ignored
    want_colour = (ce([1 / tau, 0, -1 / tau], 0) + ce([0, 1 / tau, 0], 2)) / 2
    # shape: token 0 class 0 (cos 1, 0); token 1 none: skipped; token 2 class 1 (cos s, s)
    want_shape = (ce([1 / tau, 0], 0) + ce([s / tau, s / tau], 1)) / 2
    # chars (rows (0,1), (1,0)): token 1 class 1 (cos 1, 0); token 2 class 0 (cos s, s)
    want_chars = (ce([1 / tau, 0], 1) + ce([s / tau, s / tau], 0)) / 2
    for k, want in (("colour", want_colour), ("shape", want_shape), ("chars", want_chars)):
        assert out[k].item() == pytest.approx(want, rel=1e-5), k
    # top-1 accuracies over the applicable tokens (a tie goes to the first class): colour 1/2 (token 1's nearest is
    # class 1, not 2), shape 1/2 (token 2 ties, target 1), chars 1/2 (token 1 is nearest class 0; token 2 ties: 0)
    assert out["acc colour"].item() == pytest.approx(0.5)
    assert out["acc shape"].item() == pytest.approx(0.5)
    assert out["acc chars"].item() == pytest.approx(0.5)


def test_gradient_reaches_the_tokens_and_nothing_else_trains():
    torch.manual_seed(0)
    a = _anchors()
    assert not list(a.parameters())  # buffers only
    tokens = torch.randn(2, 3, 2, requires_grad=True)
    batch = {"aux_colour": torch.tensor([[0, 1, 2], [2, 1, 0]]), "aux_shape": torch.tensor([[0, 1, 2], [1, 1, 0]]),
             "aux_chars": torch.tensor([[[1, 0], [0, 2], [0, 0]], [[0, 0], [0, 0], [2, 2]]])}
    out = a(tokens, batch)
    sum(out[k] for k in anchor.VOCABS).backward()
    assert torch.isfinite(tokens.grad).all() and tokens.grad.abs().sum() > 0


def test_a_batch_without_labels_gives_zero_not_nan():
    tokens = torch.randn(1, 2, 2)
    out = _anchors()(tokens, _batch([IGNORE, IGNORE], [0, 0], [[0, 0], [0, 0]]))
    assert all(out[k].item() == 0.0 for k in anchor.VOCABS)
    assert anchor.losses(None, {}, {}) == {}
    assert anchor.losses(_anchors(), {"y": tokens}, {"input_ids": None}) == {}  # a clip step: no dense targets


class _Tok:
    """Spellings to token ids, as a tokenizer's ``__call__`` returns them."""

    ids = {" red": [0], "red": [1], " light blue": [2, 3], "light blue": [4, 3]}

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": self.ids[text]})()


def test_word_vector_averages_normalized_rows_then_spellings():
    embed = torch.tensor([[2.0, 0.0], [0.0, 5.0], [3.0, 0.0], [0.0, 1.0], [0.0, 4.0]])
    got = anchor.word_vector(_Tok(), embed, [" red", "red"])
    s = 1 / math.sqrt(2)
    assert torch.allclose(got, torch.tensor([s, s]))
    # " light blue": rows (1,0),(0,1) -> (s, s); "light blue": (0,1),(0,1) -> (0, 1); mean then normalize
    got = anchor.word_vector(_Tok(), embed, [" light blue", "light blue"])
    m = torch.tensor([s, s + 1.0])
    assert torch.allclose(got, m / m.norm())


def test_weight_decays_linearly_to_zero():
    assert anchor.weight(2.0, 0.0, "linear") == 2.0
    assert anchor.weight(2.0, 0.25, "linear") == pytest.approx(1.5)
    assert anchor.weight(2.0, 1.2, "linear") == 0.0
    assert anchor.weight(2.0, 0.9, "none") == 2.0


def test_mix_parsing():
    from eval.train import towers

    assert towers.parse_mix(None) == towers.IMAGE_MIX
    mix = towers.parse_mix("scene=0.55,document=0.2")
    assert mix == {"scene": 0.55, "text": 0.0, "document": 0.2, "chart": 0.0}
    with pytest.raises(ValueError, match="unknown image kind"):
        towers.parse_mix("clip=1")
    with pytest.raises(ValueError):
        towers.parse_mix("scene=0")


@pytest.mark.slow
def test_smoke_train_with_the_anchor_and_a_scene_mix(tmp_path, smollm2_load_info, monkeypatch):
    """One CPU step (an image step of one scene; the clip path is the trainer's smoke test's): the anchor losses
    are logged, the plan stores the anchor and the mix, and the export holds the tower and projector only."""
    import json

    from eval.train import towers
    from mmkv.models.demo import load_demo

    monkeypatch.setattr(towers, "VISION", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                           "num_attention_heads": 2})
    monkeypatch.setattr(towers, "step_mode", lambda step, model: "image")
    out = tmp_path / "run"
    assert towers.main(["--model", "demo-llava", "--out", str(out), "--batch", "1", "--warmup", "1", "--workers",
                        "0", "--steps", "1", "--anchor", "1.0", "--mix", "scene=1", "--export"]) == 0
    log = json.loads((out / "log.json").read_text())
    assert [r["step"] for r in log] == [1]
    assert log[0]["anchor colour"] > 0 and log[0]["anchor shape"] > 0 and 0 <= log[0]["anchor acc colour"] <= 1
    plan = json.loads((out / "tower.json").read_text())["plan"]
    assert plan["anchor"] == 1.0 and plan["anchor_decay"] == "linear" and plan["mix"]["scene"] == 1.0
    _, _, adapter = load_demo("demo-llava", "cpu", torch.float32, tower_dir=out)  # strict: no extra keys
    assert "trained" in adapter.synthetic


def test_probe_word_readout_counts_objects_nearest_their_own_words():
    from eval.synth.common import COLOURS
    from eval.train.dense import PALETTE_NAMES
    from eval.train.probe import word_readout

    colours = sorted(COLOURS)
    eye = torch.eye(len(PALETTE_NAMES) + 3)
    words = {"colour": eye[:len(PALETTE_NAMES)], "shape": eye[len(PALETTE_NAMES):]}
    # two objects: image 0 token 5 is the first sorted colour's word plus a little of shape 1; image 1 token 7 is
    # shape 2's word with a little of the wrong colour
    proj = torch.zeros(2, 10, eye.shape[1])
    first = PALETTE_NAMES.index(colours[0])
    proj[0, 5] = eye[first] + 0.1 * words["shape"][1]
    proj[1, 7] = words["shape"][2] + 0.1 * eye[PALETTE_NAMES.index(colours[2])]
    lab = {"object": {"image": [0, 1], "token": [5, 7], "colour": [0, 1], "shape": [1, 2]}}
    got = word_readout(proj, lab, words)
    # object 0: colour right, shape right (its only shape component); object 1: colour wrong (nearest colours[2]), shape right
    assert got == {"object colour (nearest word)": 0.5, "object shape (nearest word)": 1.0}
