"""The towers' trainer's row drawing (``eval/train/rows.py``, issue 28): the training-only position questions are
true of the drawn scene, leave out near ties and the generator's own questions, and only packed rows carry them."""

from __future__ import annotations

import pytest

from eval.synth import generate
from eval.train.rows import position_questions, sample_packed


def _by_name(objs):
    return {f"{o['colour']} {o['shape']}": o for o in objs}


def test_position_questions_match_the_drawing():
    asked = 0
    for it in generate("scene", 60, seed=5):
        objs, size = _by_name(it.meta["objects"]), it.meta["size"]
        qa = position_questions(it)
        assert not set(qa) & set(it.qa)
        for q, a in qa:
            asked += 1
            if q.endswith("on the left or the right?"):
                o = objs[q[len("Is the "):-len(" on the left or the right?")]]
                assert abs(o["x"] - size / 2) > o["r"]
                assert a == ("left" if o["x"] < size / 2 else "right")
                continue
            rel = " left of the " if " left of the " in q else " right of the "
            first, second = q[len("Is the "):-1].split(rel)
            a_, b_ = objs[first], objs[second]
            assert abs(a_["x"] - b_["x"]) > a_["r"] + b_["r"]
            left = a_["x"] < b_["x"]
            assert a == ("yes" if left == (rel == " left of the ") else "no")
    assert asked > 120  # 60 scenes of 1-5 shapes: the questions are not vacuous


@pytest.mark.parametrize("kind", ["text", "document", "chart", "clip"])
def test_no_position_questions_outside_scenes(kind):
    assert all(position_questions(it) == [] for it in generate(kind, 3, seed=5))


def test_packed_rows_add_them_only_when_asked():
    for i in range(12):
        it, content, blocks = sample_packed(3, i, "image", {"scene": 1.0})
        it2, content2, more = sample_packed(3, i, "image", {"scene": 1.0}, positions=True)
        assert it.qa == it2.qa and content["image"].tobytes() == content2["image"].tobytes()
        extra = position_questions(it)
        assert more == [*blocks[:-1], *extra, blocks[-1]]  # the caption stays last


def test_positions_need_packed_rows(tmp_path, capsys):
    from eval.train import towers

    with pytest.raises(SystemExit):
        towers.main(["--model", "demo-llava", "--out", str(tmp_path), "--steps", "1", "--positions"])
    assert "--pack" in capsys.readouterr().err
    args = towers.parser("").parse_args(["--out", str(tmp_path), "--steps", "1", "--pack", "--positions"])
    assert towers.new_plan(args)["positions"] is True
    assert "positions" not in towers.new_plan(towers.parser("").parse_args(["--out", str(tmp_path), "--steps", "1"]))
