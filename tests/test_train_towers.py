"""The demo towers' trainer (``eval/train/towers.py``, issue 28): a few CPU steps on generated data train the tower
and projector only (the language model's weights stay SmolLM2's), checkpoints resume, and the exported fp16 weights
load back into the demo model, which then says its tower was trained."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.slow


def test_smoke_train_resume_export_and_load(tmp_path, smollm2_load_info, monkeypatch):
    from eval.train import towers
    from mmkv.models.demo import load_demo

    monkeypatch.setattr(towers, "VISION", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                          "num_attention_heads": 2})
    out = tmp_path / "run"
    assert towers.main(["--model", "demo-llava", "--out", str(out), "--steps", "2", "--batch", "2",
                        "--warmup", "1"]) == 0
    log = json.loads((out / "log.json").read_text())
    assert [r["step"] for r in log] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    # resumes at step 2 and runs one more
    assert towers.main(["--model", "demo-llava", "--out", str(out), "--steps", "3", "--batch", "2", "--warmup", "1",
                        "--export"]) == 0
    assert [r["step"] for r in json.loads((out / "log.json").read_text())] == [1, 2, 3]
    random_model, _, _ = load_demo("demo-llava", "cpu", torch.float32, vision=towers.VISION)
    trained, _, adapter = load_demo("demo-llava", "cpu", torch.float32, tower_dir=out)
    assert "trained" in adapter.synthetic
    # the tower changed, the language model did not
    diff = [(a - b).abs().max().item() for a, b in zip(trained.model.vision_tower.parameters(),
                                                       random_model.model.vision_tower.parameters(), strict=True)]
    assert max(diff) > 0
    for a, b in zip(trained.model.language_model.parameters(), random_model.model.language_model.parameters(),
                    strict=True):
        assert torch.equal(a, b)
