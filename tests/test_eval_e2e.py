"""Every eval task end to end through the CLI on the offline fixtures with real mmkv models: demo-llava (random vision
tower; its language model SmolLM2's first two layers, tests/lm_layers.py: these tests check tables, not answers) for
the VLM tasks, the whole smollm2-135m for the text tasks and the local judge. Small limits and few new tokens keep the
whole file to about a minute on two CPU cores."""

import csv
import json
from pathlib import Path

import pytest

from eval import run

pytestmark = pytest.mark.slow
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "eval"


@pytest.fixture(scope="module")
def demo_llava():
    """Loaded once for the three VLM tasks (the text tasks go through the CLI's own loading path)."""
    from lm_layers import first_lm_layers

    import mmkv

    with first_lm_layers():
        lm = mmkv.load_model("demo-llava")
    engine = mmkv.Engine(lm)
    return lambda name: (lm, engine)


def table(out: Path) -> list[dict]:
    return list(csv.DictReader((out / "results.csv").open()))


def check_common(out: Path, methods: list[str], synthetic: str | None) -> list[dict]:
    rows = table(out)
    assert [r["method"] for r in rows] == methods
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specs"][0] == "fp16" and cfg["versions"]["torch"] and cfg["device"].startswith(("cpu", "cuda"))
    md = (out / "results.md").read_text()
    assert md.splitlines()[2].startswith("**Model:")
    if synthetic:
        assert f"SYNTHETIC: {synthetic}" in md and all(r["synthetic"] == synthetic for r in rows)
    else:
        assert "SYNTHETIC" not in md
    return rows


def test_coco_caption_demo_llava(tmp_path, demo_llava):
    argv = ["coco_caption", "--model", "demo-llava", "--spec", "visual=calibquant:bits=1", "--data",
            str(ASSETS / "coco_caption"), "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path), "--quiet"]
    assert run.main(argv, loader=demo_llava) == 0
    rows = check_common(tmp_path, ["Baseline", "calibquant"], "random vision tower")
    assert list(rows[0])[4:11] == ["BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4", "METEOR", "ROUGE_L", "CIDEr"]
    assert rows[0]["bits"] == "16" and rows[1]["bits"] == "1" and rows[1]["n"] == "2"
    # the 1-bit visual cache holds far fewer bytes than the fp16 one (576 visual tokens per image)
    assert float(rows[1]["kv_cache_mib"]) < 0.5 * float(rows[0]["kv_cache_mib"])
    rec = json.loads((tmp_path / "samples" / "fp16.jsonl").read_text().splitlines()[0])
    assert rec["stats"]["prompt_tokens"]["visual"] == 576 and len(rec["refs"]) == 5


def test_docvqa_demo_llava(tmp_path, demo_llava):
    argv = ["docvqa", "--model", "demo-llava", "--spec", "visual=kivi:bits=2", "--data", str(ASSETS / "docvqa"),
            "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path), "--quiet"]
    assert run.main(argv, loader=demo_llava) == 0
    rows = check_common(tmp_path, ["Baseline", "kivi"], "random vision tower")
    assert all(0.0 <= float(r["ANLS"]) <= 1.0 for r in rows)


def test_mmbench_video_demo_llava_with_local_judge(tmp_path, demo_llava):
    base = ["mmbench_video", "--model", "demo-llava", "--spec", "visual=calibquant:bits=2", "--data",
            str(ASSETS / "mmbench_video"), "--limit", "2", "--frames", "1", "--max-new-tokens", "4",
            "--out", str(tmp_path), "--quiet"]
    assert run.main([*base, "--infer-only"], loader=demo_llava) == 0
    assert table(tmp_path)[0]["Overall"] == ""
    # second pass: predictions are reused, a real local model (SmolLM2) judges them
    assert run.main([*base, "--judge-local", "smollm2-135m"], loader=demo_llava) == 0
    rows = check_common(tmp_path, ["Baseline", "calibquant"], "random vision tower")
    assert all(r["judged"] == "2" and 0.0 <= float(r["Overall"]) <= 3.0 for r in rows)
    assert "judge: local smollm2-135m" in (tmp_path / "results.md").read_text()
    rec = json.loads((tmp_path / "samples" / "fp16.jsonl").read_text().splitlines()[0])
    assert rec["stats"]["prompt_tokens"]["visual"] == 576  # one frame -> one image span


def test_perplexity_smollm2(tmp_path):
    # window=0: tokens go to KIVI as soon as a group of 16 is full, so a 24-token window already reads 2-bit codes
    argv = ["perplexity", "--model", "smollm2-135m", "--spec", "text=kivi:bits=2,group=16 window=0 sinks=0",
            "--context", "24", "--limit", "2", "--out", str(tmp_path), "--quiet"]
    assert run.main(argv) == 0
    rows = check_common(tmp_path, ["Baseline", "kivi(group=16) + window=0 + sinks=0"], None)
    fp16, kivi = (float(r["PPL"]) for r in rows)
    assert 1.0 < fp16 < 1e4 and 1.0 < kivi < 1e4 and kivi != fp16 and rows[0]["tokens"] == "46"


@pytest.fixture(scope="module")
def smollm2():
    import mmkv

    lm = mmkv.load_model("smollm2-135m")
    engine = mmkv.Engine(lm)
    return lambda name: (lm, engine)


def test_needle_and_agreement_smollm2(tmp_path, smollm2):
    spec = "text=kivi:bits=4,group=16 window=16 sinks=4"
    argv = ["needle", "--model", "smollm2-135m", "--spec", spec, "--contexts", "160,9999999", "--depths", "0.5",
            "--out", str(tmp_path / "needle"), "--quiet"]
    assert run.main(argv, loader=smollm2) == 0
    rows = check_common(tmp_path / "needle", ["Baseline", "kivi(group=16) + window=16"], None)
    assert list(rows[0])[4:7] == ["Accuracy", "160", "9999999"]
    assert rows[0]["9999999"] == ""  # longer than the corpus allows: recorded as a failed sample, noted
    assert "samples failed" in (tmp_path / "needle" / "results.md").read_text()
    argv = ["agreement", "--model", "smollm2-135m", "--spec", spec, "--prompt-tokens", "48", "--num-prompts", "2",
            "--max-new-tokens", "6", "--out", str(tmp_path / "agree"), "--quiet"]
    assert run.main(argv, loader=smollm2) == 0
    rows = table(tmp_path / "agree")
    assert float(rows[0]["Prefix agreement"]) == 1.0 and float(rows[0]["Token agreement"]) == 1.0
    assert 0.0 <= float(rows[1]["Token agreement"]) <= 1.0


def test_text_model_on_an_image_task_is_a_clear_error(tmp_path, capsys):
    argv = ["docvqa", "--model", "smollm2-135m", "--data", str(ASSETS / "docvqa"), "--limit", "1",
            "--out", str(tmp_path)]
    assert run.main(argv) == 2
    assert "takes no images" in capsys.readouterr().err
