"""Shared-prefix packing for the towers' trainer (``eval/train/pack.py``, issue 28): a packed row's ids are exactly
the prompts ``prepare_inputs`` makes, each answer's loss equals the one its own unpacked row gives (the unpacked
trainer path as the reference), the block mask and weights against loops, and a packed training run."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.slow

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def _demo(name: str):
    from mmkv.models.demo import load_demo

    return load_demo(name, "cpu", torch.float32, vision=TINY, tower_dir="random")


@pytest.mark.parametrize("name,mode", [("demo-llava", "image"), ("demo-internvl", "tiled"), ("demo-llava", "clip")])
def test_prefix_and_tails_rebuild_each_prompt_exactly(smollm2_load_info, name, mode):
    from eval.train import pack
    from eval.train.rows import sample_packed
    from mmkv.models.inputs import prepare_inputs

    _, processor, adapter = _demo(name)
    if mode == "clip":
        adapter.default_video_frames = 2  # the same frame-by-frame path, fewer images to process
    _, item, pairs = sample_packed(3, 1, mode)
    prompts = [q for q, _ in pairs]
    assert len(prompts) >= 3 and len(set(prompts)) == len(prompts)
    prep, prefix, tails = pack.split_prefix(adapter, processor, item, prompts)
    visual = adapter.visual_mask(prep.input_ids)[0]
    assert visual.any() and int(visual.nonzero().max()) < len(prefix)  # every visual token is in the prefix
    for q, tail in zip(prompts, tails, strict=True):
        ref = prepare_inputs(adapter, [{"role": "user", "content": [item, {"type": "text", "text": q}]}], processor)
        assert torch.equal(torch.cat([prefix, tail]), ref.input_ids[0]), q
        assert torch.equal(prep.model_kwargs["pixel_values"], ref.model_kwargs["pixel_values"])
        assert not adapter.visual_mask(tail[None]).any()


@pytest.mark.usefixtures("demo_lm_first_layers")  # plumbing: SmolLM2's first two layers (tests/lm_layers.py)
def test_packed_answer_losses_equal_the_unpacked_rows(smollm2_load_info):
    """Two images, each with three of its questions and its caption (fewer unpacked rows to run): per answer token, the packed forward's cross-entropy
    equals the unpacked trainer batch's (one row per question), fp32, |diff| <= 1e-4 (measured ~2e-5 through the whole
    model, ~1e-5 through the two layers used here)."""
    from eval.train import pack, towers
    from eval.train.rows import sample_packed

    model, processor, adapter = _demo("demo-llava")
    model.eval()
    assert len(model.model.language_model.layers) == model.config.text_config.num_hidden_layers == 2
    drawn = [sample_packed(7, i, "image", {"scene": 1.0, "text": 0, "document": 0, "chart": 0}) for i in (0, 1)]
    rows = [(item, [*pairs[:3], pairs[-1]]) for _, item, pairs in drawn]
    end = towers.turn_end_id(processor.tokenizer)
    packed = pack.encode_packed(adapter, processor, rows, end)
    plain = towers.encode(adapter, processor, [(item, q, a) for item, pairs in rows for q, a in pairs])
    assert int(packed["answers"]) == plain["input_ids"].shape[0] == sum(len(p) for _, p in rows)

    def token_ce(batch):
        with torch.no_grad():
            h = model.model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                            **pack.model_kwargs(batch)).last_hidden_state
        at = batch["answer_at"]
        logits = model.lm_head(h.reshape(-1, h.shape[-1])[at])
        return torch.nn.functional.cross_entropy(logits, batch["labels"].reshape(-1)[at + 1], reduction="none")

    a, b = token_ce(packed), token_ce(plain)
    assert a.shape == b.shape and a.numel() > 20
    assert torch.equal(packed["labels"].reshape(-1)[packed["answer_at"] + 1],
                       plain["labels"].reshape(-1)[plain["answer_at"] + 1])
    assert (a - b).abs().max().item() <= 1e-4
    # the trainer's loss: the mean over blocks of each block's mean token loss
    w = packed["answer_w"]
    seg = packed["seg"].reshape(-1)[packed["answer_at"] + 1]
    row = (packed["answer_at"] + 1) // packed["seg"].shape[1]
    per_block = [a[(row == r) & (seg == k)].mean() for r in (0, 1) for k in range(1, len(rows[r][1]) + 1)]
    ref = torch.stack(per_block).mean()
    got = towers.answer_loss(_NoGrad(model), packed)
    assert torch.allclose((a * w).sum() / w.sum(), ref, rtol=1e-5) and torch.allclose(got, ref, rtol=1e-4)


class _NoGrad:
    """The model with gradients off, so ``answer_loss`` runs as the trainer calls it."""

    def __init__(self, model):
        self.lm_head = model.lm_head
        self._model = model.model

    def model(self, **kw):
        with torch.no_grad():
            return self._model(**kw)


def test_block_mask_and_weights_against_loops():
    from eval.train.pack import attention_mask, block_weights

    seg = torch.tensor([[0, 0, 1, 1, 2, 2, 2, -1], [0, 1, 1, 1, 2, 3, -1, -1]])
    got = attention_mask(seg)
    assert got.shape == (2, 1, 8, 8)
    for r in range(2):
        for i in range(8):
            for j in range(8):
                ok = j <= i and (seg[r, j] == 0 or seg[r, j] == seg[r, i])
                assert bool(got[r, 0, i, j]) == bool(ok), (r, i, j)
    assert got.any(-1).all()  # no empty row: padding sees the prefix and itself
    labels = torch.full((2, 8), -100)
    labels[0, [3, 5, 6]] = 9
    labels[1, [2, 3, 4, 5]] = 9
    at = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    at = at[0] * 8 + at[1]
    w = block_weights(labels, seg, at)
    # row 0: block 1 has 1 answer token, block 2 has 2; row 1: block 1 has 2, block 2 and 3 one each
    assert w.tolist() == [1.0, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0]


@pytest.mark.usefixtures("demo_lm_first_layers")  # plumbing: SmolLM2's first two layers (tests/lm_layers.py)
def test_packed_training_run_stores_the_plan(tmp_path, smollm2_load_info, monkeypatch):
    from eval.train import towers

    monkeypatch.setattr(towers, "VISION", dict(TINY))
    build = towers.build

    def two_frame_build(*a, **kw):  # step 0 is a clip step: 2 frames instead of 8, the same path
        model, processor, adapter = build(*a, **kw)
        adapter.default_video_frames = 2
        return model, processor, adapter

    monkeypatch.setattr(towers, "build", two_frame_build)
    _, processor, adapter = two_frame_build("demo-llava", torch.device("cpu"), TINY)
    step = next(s for s in range(100) if towers.step_mode(s, "demo-llava") == "image")
    batch = towers.Steps("demo-llava", adapter, processor, batch=2, total=step + 1, pack=True)[step]
    assert int(batch["answers"]) > 2 and batch["seg"].max() > 1
    out = tmp_path / "run"
    args = ["--model", "demo-llava", "--out", str(out), "--batch", "2", "--warmup", "1", "--workers", "0", "--pack"]
    assert towers.step_mode(0, "demo-llava") == "clip"
    assert towers.main([*args, "--steps", "1"]) == 0
    log = json.loads((out / "log.json").read_text())
    assert len(log) == 1 and torch.isfinite(torch.tensor(log[0]["loss"]))
    assert json.loads(torch.load(out / "ckpt.pt", weights_only=True)["plan"])["pack"] is True


def test_flex_block_mask_attends_as_the_dense_mask():
    """``pack.block_mask`` (``--attention flex``) lets the same (query, key) pairs attend as ``attention_mask``:
    FlexAttention over it equals SDPA over the dense mask on random q/k/v, padding rows included (forward only: torch
    has no FlexAttention backward on the CPU), fp32, |diff| <= 1e-5."""
    from torch.nn.attention.flex_attention import flex_attention

    from eval.train.pack import attention_mask, block_mask

    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 3, -1, -1], [0, 0, 1, 1, 1, 1, 2, 3, 3, 4, -1]])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 11, 16, generator=g) for _ in range(3))
    got = flex_attention(q, k, v, block_mask=block_mask(seg))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(seg))
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.usefixtures("demo_lm_first_layers")  # plumbing: SmolLM2's first two layers (tests/lm_layers.py)
def test_flex_attention_in_the_language_model_gives_the_dense_forward(smollm2_load_info):
    """The trainer's ``--attention flex`` path through transformers: the block mask reaches every layer of the
    language model untouched and the packed rows' hidden states equal the dense mask's (fp32, CPU, forward only);
    on a CPU device the option is refused with a clear error (no FlexAttention backward there)."""
    from eval.train import pack, towers
    from eval.train.rows import sample_packed

    model, processor, adapter = _demo("demo-llava")
    model.eval()
    _, item, pairs = sample_packed(11, 0, "image", {"scene": 1.0, "text": 0, "document": 0, "chart": 0})
    batch = pack.encode_packed(adapter, processor, [(item, pairs[:3])], towers.turn_end_id(processor.tokenizer))

    def hidden(flex):
        with torch.no_grad():
            return model.model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                               **pack.model_kwargs(batch, flex)).last_hidden_state

    dense = hidden(False)
    before = model.model.language_model.config._attn_implementation
    model.model.language_model.set_attn_implementation(pack.FLEX)
    try:
        assert pack.flex_on(model)
        flex = hidden(True)
    finally:
        model.model.language_model.set_attn_implementation(before)
    assert not pack.flex_on(model)
    assert (flex - dense).abs().max().item() <= 1e-4 * dense.abs().max().item()
    with pytest.raises(ValueError, match="CUDA"):
        pack.use_flex(model, torch.device("cpu"))
