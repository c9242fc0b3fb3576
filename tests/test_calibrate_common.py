"""Calibration plumbing shared by SKVQ and AQUA-KV: artifacts tied to a model, q/k/v collection, RoPE inverse."""

import pytest
import torch

from mmkv.calibrate.collect import collect_qkv, language_model, rope_cos_sin, rotate_keys, unrotate_keys
from mmkv.methods import artifacts
from mmkv.models.adapter import Adapter


def fake_adapter(name="m", layers=4, kv=2, d=64):
    return Adapter(name=name, family="text", num_layers=layers, num_q_heads=kv * 3, num_kv_heads=kv, head_dim=d,
                   lm_config=None)


def test_artifact_round_trip_and_model_check(tmp_path, monkeypatch):
    monkeypatch.setenv("MMKV_CACHE_DIR", str(tmp_path))
    ad = fake_adapter("org/some-model")
    t = {"perm": torch.randperm(64).int(), "alpha": torch.rand(4, 2, 3)}
    folder = artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), t, {"data": "valid.txt"}).save(
        artifacts.default_dir(ad.name, "skvq"))
    assert folder == tmp_path / "calib" / "org--some-model" / "skvq"
    back = artifacts.load(None, "skvq", ad)
    assert torch.equal(back.tensors["perm"], t["perm"]) and torch.equal(back.tensors["alpha"], t["alpha"])
    assert back.meta["data"] == "valid.txt" and "created" in back.meta
    with pytest.raises(ValueError, match="made for model 'org/some-model'.*mmkv-calibrate skvq --model other"):
        artifacts.load(folder, "skvq", fake_adapter("other"))
    with pytest.raises(ValueError, match="made for model"):
        artifacts.load(folder, "skvq", fake_adapter("org/some-model", layers=5))
    with pytest.raises(ValueError, match="holds a 'skvq' artifact, not 'aquakv'"):
        artifacts.load(folder, "aquakv", ad)
    with pytest.raises(FileNotFoundError, match="mmkv-calibrate aquakv --model org/some-model"):
        artifacts.load(None, "aquakv", ad)


def test_rope_inverse_is_exact_on_random_keys():
    g = torch.Generator().manual_seed(0)
    n, h, d = 37, 3, 64
    ang = torch.rand(n, d // 2, generator=g) * 20
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    k = torch.randn(n, h, d, generator=g, dtype=torch.float64)
    assert torch.allclose(unrotate_keys(rotate_keys(k, cos.double(), sin.double()), cos.double(), sin.double()), k)


@pytest.mark.slow
def test_collect_qkv_on_smollm2_gives_post_rope_keys_that_unrotate_to_k_proj(smollm2, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" The tower is 324 metres tall, about the same height as an 81-storey building. " * 40)
    col = collect_qkv(smollm2, text, seq_len=64, max_tokens=128, dtype=torch.float32)
    ad = smollm2.adapter
    assert len(col.k) == ad.num_layers and col.meta["windows"] == 2 and col.meta["tokens"] == 128
    assert col.q[0].shape == (128, ad.num_q_heads, ad.head_dim)
    assert col.k[5].shape == col.v[5].shape == (128, ad.num_kv_heads, ad.head_dim)
    # layer 0's pre-RoPE keys straight from its projection, on the same first window
    model, tok, _ = smollm2
    lm = language_model(model)
    ids = tok(text.read_text(), return_tensors="pt").input_ids[:, :64]
    with torch.inference_mode():
        h = lm.layers[0].input_layernorm(lm.embed_tokens(ids))
        k_pre = lm.layers[0].self_attn.k_proj(h).view(64, ad.num_kv_heads, ad.head_dim)
    cos, sin = rope_cos_sin(model, col.positions[:64])
    back = unrotate_keys(col.k[0][:64].float(), cos, sin)
    assert ((back - k_pre).norm() / k_pre.norm()).item() < 1e-4


def test_artifact_status_tells_the_app_what_to_run(tmp_path, monkeypatch):
    from mmkv.calibrate import artifact_status
    from mmkv.ui.spec_controls import artifact_note

    monkeypatch.setenv("MMKV_CACHE_DIR", str(tmp_path))
    assert artifact_status("skvq", "smollm2-135m") == (False, "mmkv-calibrate skvq --model smollm2-135m")
    methods = [{"name": "skvq", "needs_artifact": True}, {"name": "kivi", "needs_artifact": False}]
    note = artifact_note(methods, ["kivi", "skvq"], "smollm2-135m")
    assert "mmkv-calibrate skvq --model smollm2-135m" in note and "kivi" not in note
    ad = fake_adapter("smollm2-135m")
    artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), {"x": torch.ones(2)}).save(
        artifacts.default_dir(ad.name, "skvq"))
    assert artifact_status("skvq", "smollm2-135m")[0] is True
    assert artifact_note(methods, ["skvq"], "smollm2-135m") == ""
