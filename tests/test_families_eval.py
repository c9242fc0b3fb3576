"""The user-facing ways in for each VLM family of issue 30, on a tiny random-weight folder of each
(``tiny_vlms.family_folders``): ``mmkv-eval`` runs a task of 2 items from the generated held-out sets
(``eval/synth``) with fp16 and with 1-bit CalibQuant on the visual tokens beside KIVI on the text, and the app's model
box loads the folder and names the family. Random weights: the scores are meaningless, the plumbing is what is
checked (every item answered without error, visual tokens found and routed, the 1-bit cache smaller)."""

from __future__ import annotations

import csv

import pytest
from tiny_vlms import family_folders

from eval import run
from eval.results import ResultStore
from eval.run import canonical_spec
from eval.synth.export import write_coco, write_docvqa, write_mmbench_video

pytestmark = pytest.mark.slow
SPEC = "visual=calibquant:bits=1 text=kivi:bits=2 window=8 sinks=2"
# one task per family, every task on some family; MMBench-Video only where the family takes video
TASK_OF = {"idefics3": "docvqa", "llava_next": "coco_caption", "gemma3": "docvqa",
           "llava_onevision": "mmbench_video", "qwen_vl": "mmbench_video"}
TAKES_VIDEO = {"idefics3": False, "llava_next": False, "gemma3": False, "llava_onevision": True, "qwen_vl": True}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_load_info):
    from mmkv.models.smollm2 import ensure_tokenizer

    return family_folders(tmp_path_factory.mktemp("families"), ensure_tokenizer())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The held-out layouts the tasks read, as ``python -m eval.synth.export`` writes them (seed 1000)."""
    root = tmp_path_factory.mktemp("synth")
    write_coco(root / "coco_caption", 3, 1000)
    write_docvqa(root / "docvqa", 1, 1000)
    write_mmbench_video(root / "mmbench_video", 1, 1000)
    return root


@pytest.mark.parametrize("family", list(TASK_OF))
def test_eval_task_runs_on_the_family(folders, data, tmp_path, monkeypatch, family):
    task = TASK_OF[family]
    if task == "coco_caption":  # no Java: the pure-Python tokenizer; the JVMs' start alone takes ~20 s here
        monkeypatch.setattr("eval.tasks.coco_caption.metrics.shutil.which", lambda name: None)
    argv = [task, "--model", str(folders[family]), "--spec", SPEC, "--data", str(data / task), "--limit", "2",
            "--max-new-tokens", "3", "--out", str(tmp_path), "--quiet"]
    if task == "mmbench_video":
        argv += ["--frames", "4", "--infer-only"]
    assert run.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["method"] for r in rows] == ["Baseline", "calibquant + kivi + window=8 + sinks=2"]
    assert rows[1]["bits"] == "V1/T2"
    assert all(r["n"] == "2" for r in rows)
    store = ResultStore(tmp_path)
    specs = ["fp16", canonical_spec(SPEC)]
    assert all(not store.errors(s) for s in specs)  # every item answered, none recorded as a failed sample
    base, quant = (sorted(store.records(s).values(), key=lambda r: r["idx"]) for s in specs)
    assert len(base) == len(quant) == 2
    for b, q in zip(base, quant):  # the same prompt, the same visual tokens, now in a 1-bit segment
        assert b["stats"]["prompt_tokens"]["visual"] == q["stats"]["prompt_tokens"]["visual"] > 0
        assert q["stats"]["cache_bytes"]["visual"] < b["stats"]["cache_bytes"]["visual"] / 3
        assert 0 < len(q["tokens"]) <= 3


def test_video_task_is_refused_where_the_family_takes_no_video(folders, data, tmp_path, capsys):
    argv = ["mmbench_video", "--model", str(folders["gemma3"]), "--data", str(data / "mmbench_video"), "--limit", "1",
            "--frames", "2", "--infer-only", "--out", str(tmp_path)]
    assert run.main(argv) == 2
    assert "takes no video" in capsys.readouterr().err


@pytest.mark.parametrize("family", list(TASK_OF))
def test_app_model_box_loads_the_family_folder(folders, family):
    from mmkv.ui.models import FAMILY_HUB_IDS, MODEL_BOX_HELP, ModelHost, badge_html, model_choices

    host = ModelHost()
    info = host.load(str(folders[family]))
    assert info["family"] == family and info["takes_images"] and info["takes_video"] == TAKES_VIDEO[family]
    assert f"· {family} ·" in badge_html(info)
    assert all(hub_id in model_choices() for hub_id in FAMILY_HUB_IDS[family])
    named = {"idefics3": "SmolVLM", "llava_next": "LLaVA-NeXT", "gemma3": "Gemma 3", "llava_onevision": "LLaVA-OneVision",
             "qwen_vl": "Qwen2.5-VL"}
    assert named[family] in MODEL_BOX_HELP
