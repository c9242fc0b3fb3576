"""The demo towers' trainer (``eval/train/towers.py``, issue 28): a few CPU steps on generated data train the tower
and projector only (the language model's weights stay SmolLM2's), checkpoints resume with the stored plan, batches
are deterministic per step and built exactly as inference builds its inputs, and the exported fp16 weights load
back into the demo model, which then says its tower was trained."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytestmark = pytest.mark.slow

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def _first(model: str, mode: str) -> int:
    from eval.train import towers

    return next(s for s in range(1000) if towers.step_mode(s, model) == mode)


# demo-llava only: the loop is the same for both layouts (a clip step with demo-internvl's 16 frames took a minute on
# 2 cores), and test_batches_match_inference_inputs_and_repeat checks demo-internvl's tiled and clip batches
@pytest.mark.parametrize("name", ["demo-llava"])
@pytest.mark.usefixtures("demo_lm_first_layers")  # plumbing: SmolLM2's first two layers (tests/lm_layers.py)
def test_smoke_train_resume_export_and_load(tmp_path, smollm2_load_info, monkeypatch, name):
    from eval.train import towers
    from mmkv.models.demo import load_demo

    monkeypatch.setattr(towers, "VISION", dict(TINY))
    # 2 frames a clip instead of demo-llava's 8: the clip step is the same code path (one row of "Frame{i}: " +
    # image prompts), and its forward and backward over 6 x 576 more image tokens was most of this test's time
    build = towers.build

    def two_frame_build(*a, **kw):
        model, processor, adapter = build(*a, **kw)
        adapter.default_video_frames = 2
        return model, processor, adapter

    monkeypatch.setattr(towers, "build", two_frame_build)
    assert [towers.step_mode(s, name) for s in (0, 1)] == ["clip", "image"]  # the run below covers both kinds
    out = tmp_path / "run"
    # with the dense auxiliary heads (eval/train/dense.py): trained on image steps, checkpointed, never exported
    kinds = ["--aux-kinds", "colour,shape,chars,count,position"]
    common = ["--model", name, "--out", str(out), "--batch", "2", "--warmup", "1", "--workers", "0", *kinds,
              "--aux", "1.0"]
    # a tower two layers deep (TINY has one): the plan stores it, the resumes below keep it without --layers
    assert towers.main([*common, "--steps", "3", "--stop-after", "0", "--layers", "2"]) == 0  # stops before step 1
    assert towers.main([*common, "--steps", "3", "--stop-after", "0.01"]) == 0  # one step, then out of time
    log = json.loads((out / "log.json").read_text())
    assert [r["step"] for r in log] == [1] and torch.isfinite(torch.tensor(log[0]["loss"]))
    # resumes at step 1 with the stored plan (3 steps), whatever this call asks for
    with pytest.raises(SystemExit, match="--aux"):  # the heads' state is part of the checkpoint: no switching
        towers.main([*common[:-1], "0", "--steps", "3"])
    with pytest.raises(SystemExit, match="--aux-kinds"):  # other heads, other parameters
        towers.main([*[a for a in common if a not in kinds], "--steps", "3"])
    with pytest.raises(SystemExit, match="--aux-at"):  # heads of another width
        towers.main([*common, "--aux-at", "output", "--steps", "3"])
    assert towers.main([*common, "--steps", "50", "--export"]) == 0
    log = json.loads((out / "log.json").read_text())
    assert [r["step"] for r in log] == [1, 3] and log[-1]["lr"] < log[0]["lr"]  # cosine decay to the plan's end
    assert towers.step_mode(2, name) == "image" and log[-1]["aux colour"] > 0  # step 3 (index 2) had targets
    assert log[-1]["aux row"] > 0 and log[-1]["aux column"] > 0
    assert "heads" in torch.load(out / "ckpt.pt", weights_only=True)
    exported = json.loads((out / "tower.json").read_text())
    assert exported["plan"]["steps"] == 3 and exported["plan"]["layers"] == exported["vision"]["num_hidden_layers"] == 2
    random_model, _, _ = load_demo(name, "cpu", torch.float32, vision={**TINY, "num_hidden_layers": 2},
                                   tower_dir="random")
    trained, _, adapter = load_demo(name, "cpu", torch.float32, tower_dir=out)  # no head keys: loads strictly
    assert "trained" in adapter.synthetic and trained.model.vision_tower.config.num_hidden_layers == 2
    # the tower changed, the language model did not
    diff = [(a - b).abs().max().item() for a, b in zip(trained.model.vision_tower.parameters(),
                                                       random_model.model.vision_tower.parameters(), strict=True)]
    assert max(diff) > 0
    for a, b in zip(trained.model.language_model.parameters(), random_model.model.language_model.parameters(),
                    strict=True):
        assert torch.equal(a, b)


def test_layers_option_is_checked_before_any_model_is_built(tmp_path, monkeypatch):
    """``--layers``: an ``--init`` tower of another depth and a depth under 1 are refused by the argument checks (no
    model is built); without it a run from ``--init`` keeps that tower's depth; a plan at ``VISION``'s depth stores
    no ``layers``, so earlier runs' plans stay equal to theirs."""
    from eval.train import towers

    monkeypatch.setattr(towers, "VISION", dict(TINY))  # 1 layer
    init = tmp_path / "init"
    init.mkdir()
    (init / "tower.json").write_text(json.dumps({"vision": {**TINY, "num_hidden_layers": 3}}))
    common = ["--model", "demo-llava", "--out", str(tmp_path / "run"), "--steps", "1"]
    for bad in (["--layers", "2", "--init", str(init)], ["--layers", "0"]):
        with pytest.raises(SystemExit):  # argparse's error
            towers.main([*common, *bad])
    assert not (tmp_path / "run").exists()
    ap = towers.parser("")
    assert "layers" not in towers.new_plan(ap.parse_args([*common, "--layers", "1"]))
    assert towers.new_plan(ap.parse_args([*common, "--layers", "3"]))["layers"] == 3
    args = ap.parse_args([*common, "--init", str(init)])  # no --layers: the run goes on at the --init tower's depth
    towers._check_args(ap, args)
    assert towers.new_plan(args)["layers"] == 3


def test_batches_match_inference_inputs_and_repeat(smollm2_load_info):
    """A step's batch is the same in any process and row order, and each row's prompt is what prepare_inputs makes
    for the same picture: InternVL tiles (tiled steps), clips as the video path's frames."""
    from eval.train import towers
    from mmkv.models.demo import load_demo
    from mmkv.models.inputs import prepare_inputs

    _, processor, adapter = load_demo("demo-internvl", "cpu", torch.float32, tower_dir="random")
    ds = towers.Steps("demo-internvl", adapter, processor, batch=5, total=1000)
    tiled = _first("demo-internvl", "tiled")
    a, b = ds[tiled], ds[tiled]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["pixel_values"].shape[0] > 1 and a["input_ids"].shape[0] == 1  # 5 // (MAX_TILES + 1) rows
    item, prompt, answer = towers.sample(tiled, 0, "tiled")
    ref = prepare_inputs(adapter, [{"role": "user", "content": [item, {"type": "text", "text": prompt}]}],
                         processor)
    n = ref.input_ids.shape[1]
    assert torch.equal(a["input_ids"][0, :n], ref.input_ids[0]) and torch.equal(a["pixel_values"],
                                                                              ref.model_kwargs["pixel_values"])
    assert (a["labels"][0, :n] == -100).all() and (a["labels"][0, n:] != -100).sum() >= 2  # answer + <|im_end|>
    tail = a["labels"][0][a["labels"][0] != -100]
    assert processor.tokenizer.decode(tail) == answer + "<|im_end|>"
    # every answer ends with the id the engine stops on (the first H100 run's towers ended theirs with id 1)
    from mmkv.engine import _eos_ids

    model, _, _ = load_demo("demo-internvl", "cpu", torch.float32, tower_dir="random")
    assert int(tail[-1]) == towers.turn_end_id(processor.tokenizer) and int(tail[-1]) in _eos_ids(model,
                                                                                                  processor.tokenizer)
    clip = ds[_first("demo-internvl", "clip")]
    assert clip["pixel_values"].shape == (adapter.default_video_frames, 3, 448, 448)  # one untiled tile a frame


def test_training_streams_never_meet_held_out_items():
    """Held-out items seed from crc32 (< 2**32); the trainer's string seeds are SHA-512-sized integers."""
    from eval.synth.common import rng_for
    from eval.train import towers

    held = {tuple(rng_for(seed, kind, i).getstate()[1][:8]) for seed in (1000, 1001) for kind in ("scene", "clip")
            for i in range(50)}
    train = {tuple(random.Random(f"mmkv-train/{s}/{i}").getstate()[1][:8]) for s in range(50) for i in range(8)}
    assert held and train and not held & train
    a, b = towers.sample(4, 2), towers.sample(4, 2)
    assert a[1:] == b[1:] and list(a[0]["image"].getdata()) == list(b[0]["image"].getdata())


def test_answer_positions_pick_the_positions_that_predict_answer_tokens():
    """``answer_at`` (built in the data worker) against a loop over the label grid: position ``j`` of row ``r``
    counts when the label at ``j + 1`` is an answer token; rows of different lengths, no answer, answer at the end."""
    from eval.train.towers import answer_positions

    labels = torch.full((3, 6), -100)
    labels[0, 4:6] = torch.tensor([7, 2])      # answer ends at the last column
    labels[2, 1:3] = torch.tensor([5, 2])      # right after the first token; row 1 has no answer
    ref = [r * 6 + j for r in range(3) for j in range(5) if labels[r, j + 1] != -100]
    got = answer_positions(labels)
    assert got.tolist() == ref == [3, 4, 12, 13]
    assert torch.equal(labels.reshape(-1)[got + 1], torch.tensor([7, 2, 5, 2]))
    assert answer_positions(torch.full((2, 4), -100)).numel() == 0
    assert answer_positions(torch.full((1, 1), 3)).numel() == 0  # one column: nothing to predict it from


def test_answer_loss_equals_the_masked_cross_entropy():
    """The index_select loss equals cross-entropy over a boolean mask of the shifted labels (the first version)."""
    from types import SimpleNamespace

    from eval.train.towers import answer_loss, answer_positions

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=g)
    head = torch.nn.Linear(8, 11, bias=False)
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 9, 1, 2, 10]])
    model = SimpleNamespace(model=lambda **kw: SimpleNamespace(last_hidden_state=hidden), lm_head=head)
    batch = {"input_ids": None, "attention_mask": None, "pixel_values": None, "labels": labels,
             "answer_at": answer_positions(labels)}
    keep = labels[:, 1:] != -100
    ref = torch.nn.functional.cross_entropy(head(hidden[:, :-1][keep]), labels[:, 1:][keep])
    assert torch.allclose(answer_loss(model, batch), ref)


def test_compile_layers_wraps_each_layer_and_keeps_the_state_dict_keys(smollm2_load_info):
    """Regional compilation: every layer of the language model and the tower, nothing else; compiling is lazy (no
    forward here), and checkpoints/exports keep the uncompiled keys."""
    from eval.train import towers
    from mmkv.models.demo import load_demo

    model, _, _ = load_demo("demo-llava", "cpu", torch.float32, vision=TINY, tower_dir="random")
    keys = list(model.state_dict())
    n_lm = model.config.text_config.num_hidden_layers
    assert towers.compile_layers(model) == n_lm + TINY["num_hidden_layers"]
    assert list(model.state_dict()) == keys
    assert all(layer._compiled_call_impl is not None for layer in model.model.language_model.layers)
    assert model.model.multi_modal_projector._compiled_call_impl is None


def test_step_profile_rejects_bad_counts():
    from eval.train.step_profile import main

    with pytest.raises(SystemExit):
        main(["--steps", "0"])
    with pytest.raises(SystemExit):
        main(["--kernels", "-1"])


def test_flex_attention_needs_packed_rows(tmp_path, capsys):
    from eval.train import towers

    with pytest.raises(SystemExit):
        towers.main(["--model", "demo-llava", "--out", str(tmp_path), "--steps", "1", "--attention", "flex"])
    assert "--attention flex" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # packed, but on the CPU: no FlexAttention backward there
        towers.main(["--model", "demo-llava", "--out", str(tmp_path), "--steps", "1", "--pack", "--attention", "flex"])
    assert "CUDA" in capsys.readouterr().err
