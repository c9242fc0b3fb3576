"""Scorers on hand-made cases with known values: ANLS, COCO caption metrics, MMBench-Video ratings, judge reply
parsing, greedy agreement, table labels."""

import json
from pathlib import Path

import pytest

from eval.tables import method_label
from eval.tasks.docvqa import anls
from eval.tasks.docvqa.anls import levenshtein
from eval.tasks.mmbench_video.judge import chat_url, parse_score
from eval.tasks.mmbench_video.rating import rate
from eval.tasks.text.agreement import compare

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "eval"


@pytest.mark.parametrize("preds,golds,expected", [
    (["Acme Corp"], [["acme corp"]], 1.0),                      # case-insensitive
    (["  acme   corp \n"], [["Acme Corp"]], 1.0),               # whitespace-insensitive
    (["helo"], [["hello"]], 0.8),                               # 1 edit over 5 chars
    (["abc"], [["xyz"]], 0.0),                                  # NL = 1 >= 0.5 -> 0
    (["abcd"], [["abxy"]], 0.0),                                # NL = 0.5 exactly -> cut to 0
    (["abcde"], [["abxde"]], 0.8),
    ([""], [["1001"]], 0.0),                                    # empty prediction
    ([""], [[""]], 1.0),                                        # empty prediction, empty gold: identical
    (["1001"], [[""]], 0.0),                                    # empty gold
    (["259.20"], [["$259.20", "259.20"]], 1.0),                 # several golds: best one counts
    (["$259.2"], [["$259.20", "zzz"]], 1 - 1 / 7),
    (["x"], [[]], 0.0),                                         # no gold at all scores 0
    (["a", "b"], [["a"], ["c"]], 0.5),                          # mean over questions
    ([], [], 0.0),
])
def test_anls_known_values(preds, golds, expected):
    assert anls(preds, golds) == pytest.approx(expected)


def test_anls_rejects_mismatched_and_flat_golds():
    with pytest.raises(ValueError):
        anls(["a"], [])
    with pytest.raises(ValueError):
        anls(["a"], ["a"])


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3


def _coco_refs():
    ann = json.loads((ASSETS / "coco_caption" / "annotations.json").read_text())
    refs = {}
    for a in ann["annotations"]:
        refs.setdefault(str(a["image_id"]), []).append(a["caption"])
    return refs


def test_perfect_captions_score_bleu4_one_and_high_cider():
    from eval.tasks.coco_caption.metrics import caption_scores

    refs = _coco_refs()
    scores, notes = caption_scores(refs, {k: v[0] for k, v in refs.items()})
    assert list(scores)[:4] == ["BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4"]
    assert scores["BLEU_4"] == pytest.approx(1.0, abs=1e-6)
    assert scores["ROUGE_L"] == pytest.approx(1.0)
    assert scores["CIDEr"] > 2.0
    bad, _ = caption_scores(refs, {k: "a photo" for k in refs})
    assert bad["CIDEr"] < 0.1 and bad["BLEU_4"] < 0.01
    if scores["METEOR"] is not None:  # Java present
        assert scores["METEOR"] > 0.9 > bad["METEOR"]


def test_caption_metrics_without_java_fall_back_and_say_so(monkeypatch):
    from eval.tasks.coco_caption import metrics

    monkeypatch.setattr(metrics.shutil, "which", lambda name: None)
    refs = _coco_refs()
    scores, notes = metrics.caption_scores(refs, {k: v[1] for k, v in refs.items()}, spice=True)
    assert scores["METEOR"] is None and scores["SPICE"] is None
    assert scores["BLEU_4"] == pytest.approx(1.0, abs=1e-6)
    assert any("Java not found" in n for n in notes) and any("SPICE unavailable" in n for n in notes)
    assert metrics.simple_tokenize("A cat's face, isn't it?") == "a cat 's face is n't it"


def test_mmbench_video_ratings_follow_the_benchmark_groups():
    items = [(["Object Recognition"], 3), (["Video Scene"], 1), (["Causal Reasoning"], 2),
             (["Function Reasoning", "OCR"], -1)]
    r = rate(items)
    assert r["Perception"] == pytest.approx((3 + 1 + 0) / 3)   # failed judgment counts 0
    assert r["Reasoning"] == pytest.approx((2 + 0) / 2)
    assert r["Overall"] == pytest.approx(6 / 4)
    assert r["HL"] is None
    assert rate(items, valid_only=True)["Overall"] == pytest.approx(2.0)


@pytest.mark.parametrize("reply,score", [("3", 3), ("Score: 2.", 2), ("0", 0), ("I'd say 1/3", 1), ("7", -1),
                                         ("", -1), ("10", -1)])
def test_judge_reply_parsing(reply, score):
    assert parse_score(reply) == score


def test_judge_url_normalisation():
    assert chat_url("http://h:1/v1") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"


def test_greedy_agreement():
    assert compare([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 1.0)
    assert compare([1, 2, 3, 4], [1, 9, 3, 4]) == (0.25, 0.75)
    assert compare([1, 2, 3, 4], [1, 2]) == (0.5, 0.5)
    assert compare([], []) == (1.0, 1.0)


@pytest.mark.parametrize("spec,label", [
    ("fp16", ("Baseline", "16")),
    ("visual=calibquant:bits=1", ("calibquant", "1")),
    ("visual=calibquant:bits=2,calibrate=false", ("calibquant(calibrate=false)", "2")),
    ("visual=kivi:bits=4,group=32", ("kivi", "4")),
    ("visual=calibquant:bits=1 text=kivi:bits=2 window=64", ("calibquant + kivi + window=64", "V1/T2")),
])
def test_method_labels_follow_the_paper_rows(spec, label):
    from eval.run import canonical_spec

    assert method_label(canonical_spec(spec)) == label
