"""The generated training/eval data for demo vision towers (``eval/synth``, issue 28): deterministic by seed, and
every answer checked against what was drawn (pixels and the generator's own numbers), not against a model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eval.synth import KINDS, generate
from eval.synth.common import COLOURS


def _colour_mask(img, colour) -> np.ndarray:
    a = np.asarray(img).astype(int)
    return (np.abs(a - np.array(COLOURS[colour])).sum(-1) < 12)


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_items_other_seed_other_items(kind):
    a, b, c = generate(kind, 3, seed=1), generate(kind, 3, seed=1), generate(kind, 3, seed=2)
    pix = lambda it: np.asarray(it.image if it.image is not None else it.frames[-1]).tobytes()  # noqa: E731
    assert [pix(x) for x in a] == [pix(x) for x in b] and [x.qa for x in a] == [x.qa for x in b]
    assert [pix(x) for x in a] != [pix(x) for x in c]
    for it in a:
        assert it.caption and it.qa and all(q.endswith("?") and ans for q, ans in it.qa)


def test_scene_answers_match_the_drawing():
    for it in generate("scene", 40, seed=0):
        objs = it.meta["objects"]
        qa = dict(it.qa)
        assert qa["How many shapes are there?"] == str(len(objs))
        assert sum(int(qa[f"How many {s}s are there?"]) for s in ("circle", "square", "triangle")) == len(objs)
        for o in objs:  # each shape's colour at its centre (shapes never overlap)
            assert _colour_mask(it.image, o["colour"])[int(o["y"]), int(o["x"])], o
        no = [q for q, a in it.qa if q.startswith("Is there a") and a == "no"][0]
        colour, shape = no[len("Is there a "):-1].split()
        assert not any(o["colour"] == colour and o["shape"] == shape for o in objs)


def test_text_is_drawn_in_its_colour_inside_its_box():
    for it in generate("text", 20, seed=0):
        x0, y0, x1, y1 = (int(v) for v in it.meta["box"])
        m = _colour_mask(it.image, it.meta["colour"])
        assert m[y0:y1 + 1, x0:x1 + 1].sum() > 20 and m.sum() == m[y0:y1 + 1, x0:x1 + 1].sum()
        assert dict(it.qa)["What does the text say?"] == it.meta["text"]


def test_document_answers_are_on_the_page():
    for it in generate("document", 30, seed=0):
        page = "\n".join(it.meta["lines"])
        for q, a in it.qa:
            if not q.startswith("How many"):
                assert a in page, (q, a, page)


def test_chart_highest_and_values():
    for it in generate("chart", 20, seed=0):
        labels, values = it.meta["labels"], it.meta["values"]
        qa = dict(it.qa)
        assert values[labels.index(qa["Which category has the highest value?"])] == max(values)
        assert values[labels.index(qa["Which category has the lowest value?"])] == min(values)
        assert _colour_mask(it.image, it.meta["colour"]).sum() > 100


def test_clip_motion_and_appearance_match_the_frames():
    for it in generate("clip", 24, seed=0):
        m0 = _colour_mask(it.frames[0], it.meta["colour"])
        m1 = _colour_mask(it.frames[-1], it.meta["colour"])
        assert 8 <= len(it.frames) <= 16
        if it.meta["type"] == "move":
            (y0, x0), (y1, x1) = (np.argwhere(m).mean(0) for m in (m0, m1))
            dx, dy = x1 - x0, y1 - y0
            seen = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            assert seen == it.meta["direction"] == [a for q, a in it.qa if q.startswith("Which way")][0]
        else:
            grew = m1.sum() > m0.sum()
            assert grew == (it.meta["type"] == "appear")
            assert m0.sum() == 0 if it.meta["type"] == "appear" else m1.sum() == 0


def _some_ttf() -> Path | None:
    """A .ttf on any machine that runs the suite: gradio's KaTeX fonts, else the system's."""
    import gradio

    for root in (Path(gradio.__file__).parent, Path("/usr/share/fonts")):
        hit = next((f for f in sorted(root.rglob("*Regular*.ttf"))), None)
        if hit:
            return hit
    return None


@pytest.mark.parametrize("kind", ["text", "document", "chart"])
def test_items_do_not_depend_on_the_machines_fonts(kind, tmp_path, monkeypatch):
    """A tower trained on the GPU image (no system fonts) read nothing of the held-out documents a machine with
    DejaVu drew (ANLS 0.55 -> 0.11): by default only Pillow's bundled font is drawn, whatever the machine has."""
    from eval.synth import common

    ttf = _some_ttf()
    if ttf is None:
        pytest.skip("no .ttf on this machine")
    (tmp_path / "Some-Regular.ttf").write_bytes(ttf.read_bytes())
    pix = lambda items: [np.asarray(it.image).tobytes() for it in items]  # noqa: E731
    monkeypatch.delenv(common.FONTS_ENV, raising=False)
    monkeypatch.setattr(common, "_FONT_DIRS", ())
    bare = generate(kind, 6, seed=3)
    monkeypatch.setattr(common, "_FONT_DIRS", (str(tmp_path),))
    common._font_files.cache_clear()
    assert pix(generate(kind, 6, seed=3)) == pix(bare)
    monkeypatch.setenv(common.FONTS_ENV, "system")  # opting in draws from them: some item changes
    assert pix(generate(kind, 6, seed=3)) != pix(bare)
    monkeypatch.setenv(common.FONTS_ENV, str(tmp_path))
    assert pix(generate(kind, 6, seed=3)) != pix(bare)
    monkeypatch.setenv(common.FONTS_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="MMKV_SYNTH_FONTS"):
        generate(kind, 1, seed=3)
    common._font_files.cache_clear()


def test_unknown_kind():
    with pytest.raises(ValueError, match="kinds"):
        generate("audio", 1)


def test_held_out_sets_are_read_by_the_eval_tasks(tmp_path):
    from eval.synth.export import main
    from eval.tasks.coco_caption.task import _local
    from eval.tasks.docvqa import task as docvqa
    from eval.tasks.mmbench_video.data import read_tsv
    from mmkv.models.video import load_video_frames

    assert main(["--out", str(tmp_path), "--coco", "4", "--docvqa", "2", "--video", "2", "--seed", "7"]) == 0
    coco = _local(tmp_path / "coco_caption", None)
    assert len(coco) == 4 and all(s["refs"] and Path(s["image"]).is_file() for s in coco)
    docs = docvqa.load_samples({"data": str(tmp_path / "docvqa")}, None)
    assert len(docs) >= 2 * 4 and all(d["answers"] for d in docs)
    vids = read_tsv(tmp_path / "mmbench_video")
    assert len(vids) >= 2 * 2
    frames = load_video_frames(vids[0]["video"], num_frames=4)
    assert len(frames) == 4 and frames[0].size == (336, 336)
