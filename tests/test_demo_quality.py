"""The shipped demo VLMs see (issue 28): on 20 held-out generated questions about shapes, colours, counts and
positions, the trained towers in ``assets/demo_towers/<model>/`` answer at least ``MIN_EXACT`` exactly in fp16, and
with the visual cache at 1 bit (CalibQuant's default: the authors' clip, calibrated) they keep ``KEEP`` of that; the
issue's absolute target (90% exact) is an expected failure until the towers are trained further. (In this, the
papers' protocol, a question sent with its image is prefilled with exact attention, so a one-token answer's first
token is fp16's; read over the stored 1-bit cache the demos keep almost nothing: ``--after-media``, below.)
Also: the quality study's command runs end to end on CPU (tiny random tower, a few questions) and its specs parse."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

TARGET_EXACT = 0.9         # issue 28's target for fp16 and 1 bit: missed by the shipped towers (docs/BENCHMARKS.md)
KEEP = 0.97                # issue 28: 1-bit CalibQuant with calibration keeps >= 97% of the fp16 score
# A floor under what the shipped towers answer in fp16 on these 20 questions on a CPU (2026-11-27, packed towers:
# demo-llava 0.60, demo-internvl 0.65, 1 bit the same; the unpacked ones 0.45 and 0.50; the continued demo-internvl
# of the twelfth session 0.55: one shape question more, one count and two position questions fewer): it catches a
# tower that stops seeing (the random tower: 0) or a retraining that loses two questions in ten, not the target.
MIN_EXACT = 0.5
N_QUESTIONS = 20
CATEGORIES = ("shape", "colour", "count", "position")
SEED = 1000                # held out: see eval/studies/demo_quality.py (training never uses these streams)
ONE_BIT = "visual=calibquant:bits=1"


_ASKED: dict = {}  # (model, spec) -> (exact, wrong answers): each pair is asked once per test process


def _held_out_exact(name: str, assets_dir, specs) -> dict:
    if all((name, s) in _ASKED for s in specs):
        return {s: _ASKED[name, s] for s in specs}
    from eval.studies.demo_quality import questions, run, score
    from mmkv.engine import Engine
    from mmkv.models import load_model

    folder = assets_dir / "demo_towers" / name
    weights = folder / "tower.safetensors"
    if not weights.is_file():
        pytest.skip(f"no trained tower shipped yet: {weights} is missing (python -m eval.train.towers --export)")
    lm = load_model(name, device="cpu", tower=str(folder))
    assert "trained" in lm.adapter.synthetic
    pool = questions("vqa", 8 * N_QUESTIONS, SEED)
    per = N_QUESTIONS // len(CATEGORIES)  # the first questions of each category, in the held-out order
    samples = [x for c in CATEGORIES for x in [y for y in pool if y["category"] == c][:per]]
    assert len(samples) == N_QUESTIONS and {x["category"] for x in samples} == set(CATEGORIES)
    out = {}
    answers = run(Engine(lm), samples, specs, batch=4, max_new_tokens=8)  # one prefill a batch for every spec
    for spec in specs:
        preds, _ = answers[spec]
        m, _ = score("vqa", samples, preds)
        out[spec] = _ASKED[name, spec] = (m["exact"], [(x["question"], x["answer"], p)
                                                       for x, p in zip(samples, preds, strict=True)
                                                       if p != x["answer"]])
    return out


@pytest.mark.parametrize("name", ["demo-llava", "demo-internvl"])
def test_shipped_demo_answers_held_out_questions_in_fp16_and_at_1_bit(name, assets_dir, smollm2_load_info):
    got = _held_out_exact(name, assets_dir, ["fp16", ONE_BIT])
    fp16, one = got["fp16"][0], got[ONE_BIT][0]
    assert fp16 >= MIN_EXACT, got["fp16"]
    assert one >= KEEP * fp16, (fp16, got[ONE_BIT])


@pytest.mark.xfail(strict=True, reason="issue 28: the shipped towers answer 55-60% of these in fp16, not 90%")
def test_shipped_demo_meets_the_issues_absolute_target(assets_dir, smollm2_load_info):
    got = _held_out_exact("demo-internvl", assets_dir, ["fp16"])
    assert got["fp16"][0] >= TARGET_EXACT, got["fp16"]


def test_study_specs_parse():
    from eval.studies.demo_quality import SPECS
    from mmkv.spec import CacheSpec

    parsed = [CacheSpec.parse(s) for s in SPECS]
    assert str(parsed[0]) == str(CacheSpec()) and len({str(p) for p in parsed}) == len(SPECS)
    assert not parsed[2].visual.calibrate and parsed[1].visual.calibrate and parsed[6].window == 16
    assert parsed[1].visual.clips == (0.5, 0.3) and parsed[3].visual.clips == (1.0, 1.0)


@pytest.mark.usefixtures("demo_lm_first_layers")  # plumbing: SmolLM2's first two layers (tests/lm_layers.py)
def test_study_runs_on_cpu_with_a_tiny_tower(tmp_path, smollm2_load_info, monkeypatch):
    from eval.studies import demo_quality
    from eval.studies.demo_quality import main, normalize_answer

    # 4 new tokens a task instead of 16 (48 for captions): this test checks the study's plumbing and the output's
    # structure, never the answers, and each further token is a decode step of both specs on every task
    monkeypatch.setattr(demo_quality, "MAX_NEW", dict.fromkeys(demo_quality.MAX_NEW, 4))
    out = tmp_path / "q.json"
    # XQuant's kq/vq/km/vm count layers: 2-bit and 1-bit codes and a shared layer, within the two layers here
    assert main(["--model", "demo-llava", "--tower", "random", "--n", "1", "--device", "cpu", "--batch", "2",
                 "--spec", "fp16", "--spec", "visual=calibquant:bits=1 text=xquant:kq=2,vq=1,km=0,vm=2 window=16",
                 "--video", "frames", "--video-frames", "2", "--out", str(out)]) == 0  # CPU: 2 x 576 tokens
    r = json.loads(out.read_text())
    assert r["config"]["synthetic"] == "random vision tower" and r["config"]["seed"] == SEED
    assert r["config"]["video_frames"] == 2
    assert set(r["tasks"]) == {"vqa", "doc", "video", "caption"}
    for task, per in r["tasks"].items():
        assert list(per) == ["fp16", "visual=calibquant:bits=1 text=xquant:kq=2,vq=1,km=0,vm=2 window=16"]
        for row in per.values():
            assert row["n"] == len(row["predictions"]) >= 1 and row["kv_mib"] > 0
            head = {"vqa": "normalized", "doc": "ANLS", "video": "normalized", "caption": "CIDEr"}[task]
            assert head in row["metrics"]
    assert "Table 2 layout" in r["tables"] and "SYNTHETIC: random vision tower" in r["tables"]
    # --rescore: the stored predictions give the same metrics; a prediction set to its gold answer is scored right
    vqa = r["tasks"]["vqa"]["fp16"]
    vqa["predictions"][0]["prediction"] = vqa["predictions"][0]["gold"]
    out.write_text(json.dumps(r))
    again = tmp_path / "again.json"
    assert main(["--rescore", str(out), "--out", str(again)]) == 0
    r2 = json.loads(again.read_text())
    assert r2["tasks"]["vqa"]["fp16"]["metrics"]["exact"] == 1.0 / vqa["n"] * (1 + sum(
        p["prediction"] == p["gold"] for p in vqa["predictions"][1:]))
    assert r2["tasks"]["doc"] == r["tasks"]["doc"] and "Table 2 layout" in r2["tables"]
    r["tasks"]["vqa"]["fp16"]["predictions"][0]["id"] = "not-a-sample"
    out.write_text(json.dumps(r))
    with pytest.raises(ValueError, match="not the held-out samples"):
        main(["--rescore", str(out)])
    assert normalize_answer(' "Red." ') == "red" and normalize_answer("The circle") == "circle"
    assert normalize_answer("2.50") == "2.50"


def test_scene_score_counts_only_the_targets_four_categories():
    from eval.studies.demo_quality import score

    # issue 28's 90% is over shape/colour/count/position questions: text cards and charts stay out of "scene"
    cats = ["shape", "colour", "count", "position", "text", "chart", "chart"]
    samples = [{"id": str(i), "category": c, "answer": "yes"} for i, c in enumerate(cats)]
    preds = ["yes", "no", "yes", "yes", "yes", "yes", "no"]
    m, _ = score("vqa", samples, preds)
    assert m["scene n"] == 4 and m["scene exact"] == m["scene normalized"] == 0.75
    assert m["exact"] == 5 / 7 and m["chart exact"] == 0.5
    assert "scene exact" not in score("doc", [dict(samples[0], category="form")], ["yes"])[0]


def test_after_media_feeds_the_question_over_the_stored_cache(demo_llava, monkeypatch):
    """``--after-media``: the question is fed after the media, over the cache as the spec stored it. With an fp16
    cache that is the same attention as one prompt (the same answers as ``run``); with 1-bit visual tokens the fed
    suffix holds no visual token and the cache it reads holds the image quantized (fewer visual bytes than fp16's)."""
    from eval.studies.demo_quality import questions, run, run_after_media
    from mmkv.engine import Engine
    from mmkv.spec import CacheSpec

    eng = Engine(demo_llava)
    fed = []
    cont = Engine._continue

    def spy(self, past, ids, visual, kwargs, spec):
        got = cont(self, past, ids, visual, kwargs, spec)
        fed.append((str(spec), got[1].shape[1], int(got[3].sum()), got[0].nbytes_by_modality(used=True)["visual"]))
        return got

    monkeypatch.setattr(Engine, "_continue", spy)
    samples = questions("vqa", 2, SEED)[:2]
    specs = ["fp16", ONE_BIT]
    once = run(eng, samples, specs, batch=2, max_new_tokens=2)
    after = run_after_media(eng, samples, specs, max_new_tokens=2)
    assert after["fp16"][0] == once["fp16"][0]
    assert [f[0] for f in fed] == [str(CacheSpec.parse(s)) for s in specs] * 2
    for (_, n, vis, _), x in zip(fed, [s for s in samples for _ in specs], strict=True):
        assert vis == 0 and n > len(x["question"].split())  # the question and the template's tail, no image
    assert all(q[3] < f[3] / 4 for f, q in zip(fed[::2], fed[1::2], strict=True))
