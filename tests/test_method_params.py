"""mmkv/methods/base.py and the methods' parameter surface: string forms, parsing, the app's description, and the
small derived figures (XQuant App. A bits, AQUA-KV artifact folders), written out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmkv.methods import artifacts, get_method
from mmkv.methods.alignedkv import AlignedKV
from mmkv.methods.aquakv import AquaKV
from mmkv.methods.base import _convert
from mmkv.methods.calibquant import CalibQuant
from mmkv.methods.kivi import KIVI
from mmkv.methods.skvq import SKVQ, table_names
from mmkv.methods.xquant import XQuant
from mmkv.spec import CacheSpec


def test_str_lists_only_changed_fields_with_booleans_lowercase():
    assert str(KIVI()) == "kivi"
    assert str(KIVI(bits=4)) == "kivi:bits=4"
    assert str(CalibQuant(calibrate=False)) == "calibquant:calibrate=false"
    assert str(CalibQuant(bits=2, calibrate=True)) == "calibquant:bits=2"
    assert str(AquaKV(predictors=False, seed=3)) == "aquakv:seed=3,predictors=false"


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), ("ON", True), (" yes ", True),
                                      ("0", False), ("false", False), ("off", False), ("No", False)])
def test_boolean_parameters_accept_the_documented_spellings(raw, want):
    assert _convert("m", "flag", raw, True) is want
    assert _convert("m", "flag", raw, False) is want


def test_parameters_convert_to_the_type_of_their_default():
    assert _convert("m", "n", " 7 ", 1) == 7 and isinstance(_convert("m", "n", "7", 1), int)
    assert _convert("m", "x", "1/6", 0.5) == pytest.approx(1 / 6)   # XQuant's eta1 as the paper writes it
    assert _convert("m", "x", "0.25", 0.5) == 0.25
    assert _convert("m", "s", " global ", "channel") == "global"
    assert _convert("m", "s", "abc", None) == "abc"
    for raw, default in (("maybe", True), ("1.5", 2), ("1/0", 0.5), ("x", 0.5)):
        with pytest.raises(ValueError):
            _convert("m", "k", raw, default)


def test_describe_gives_the_app_every_field_with_default_choices_and_type():
    d = KIVI.describe()
    assert d == {
        "name": "kivi",
        "modalities": ["visual", "text"],
        "params": {"bits": {"default": 2, "choices": [1, 2, 4, 8], "type": "int"},
                   "group": {"default": 32, "choices": [16, 32, 64, 128], "type": "int"}},
        "needs_artifact": False,
        "doc": "KIVI: per-channel keys, per-token values, fp16 residual window (Liu et al., 2024).",
    }
    c = CalibQuant.describe()["params"]
    assert c["calibrate"] == {"default": True, "choices": None, "type": "bool"}
    assert c["tau2"]["type"] == "float" and c["value_axis"]["type"] == "str"
    assert AquaKV.describe()["needs_artifact"] is True


def test_from_params_parses_known_keys_and_names_the_unknown_one():
    m = get_method("calibquant").from_params({"bits": "2", "calibrate": "off", "tau2": "2"})
    assert (m.bits, m.calibrate, m.tau2) == (2, False, 2.0)
    with pytest.raises(ValueError, match="unknown parameter 'bitz'"):
        KIVI.from_params({"bitz": "2"})
    with pytest.raises(ValueError, match="bits=3"):
        KIVI(bits=3)


def test_xquant_equivalent_bits_count_shared_key_layers_as_zero():
    # 8 layers, kq=4, vq=4, km=0 (odd key layers 1, 3, 5, 7 read their even neighbour's codes), vm=8 (no sharing):
    # keys 2 + 2 + 1 + 1 (layers 0, 2, 4, 6) = 6, values 4 * 2 + 4 * 1 = 12 -> 18 / 16
    assert XQuant(kq=4, vq=4, km=0, vm=8).equivalent_bits(8) == pytest.approx(18 / 16)
    # and symmetric for values: vm=0, km=8 -> keys 12, values 6
    assert XQuant(kq=4, vq=4, km=8, vm=0).equivalent_bits(8) == pytest.approx(18 / 16)
    # everything shared from layer 0 at 1 bit: 4 + 4 of 16 element-layers carry 1 bit
    assert XQuant(kq=0, vq=0, km=0, vm=0).equivalent_bits(8) == pytest.approx(0.5)


def test_aquakv_artifact_folder_names_the_quantizer_config_and_the_hadamard_seed():
    assert AquaKV().default_folder("org/Model").name == "higgs-b2-f4"  # higgs's groups follow the row width
    assert AquaKV(group=32, seed=5).default_folder("m").name == "higgs-b2-f4"
    assert AquaKV(quantizer="uniform", seed=5).default_folder("m").name == "uniform-b2-f4-g64"  # seed: hadamard only
    assert AquaKV(quantizer="hadamard", seed=5).default_folder("m").name == "hadamard-b2-f4-g64-s5"
    assert AquaKV(quantizer="hadamard").default_folder("m").name == "hadamard-b2-f4-g64"
    folder = AquaKV(bits=3, first_bits=2, group=32, quantizer="uniform").default_folder("org/Model")
    assert folder.name == "uniform-b3-f2-g32" and folder.parent.name == "aquakv"
    assert folder.parent.parent.name == "org--Model"


def test_calibquant_rejects_blocks_that_are_not_whole_bytes_and_clips_outside_0_1():
    for block in (0, 8, 16, 64):
        assert CalibQuant(block=block).block == block
    for block in (-8, 9, 12):
        with pytest.raises(ValueError, match="block"):
            CalibQuant(block=block)
    assert CalibQuant(clip="manual", clip_k=1.0, clip_v=0.01).clip_v == 0.01
    for clip in (0.0, -0.5, 1.01, 2.0):
        with pytest.raises(ValueError, match="clip_k"):
            CalibQuant(clip="manual", clip_k=clip)


def test_calibquant_clips_as_the_authors_code_by_default_and_reads_factors_only_when_manual():
    # the default spec clips at 1 bit only, with the released code's constants, and prints no clip parameter
    m = CacheSpec.parse("visual=calibquant:bits=1").visual
    assert m.clip == "authors" and m.clips == (0.5, 0.3) and str(m) == "calibquant"
    assert CacheSpec.parse("visual=calibquant:bits=2").visual.clips == (1.0, 1.0)
    off = CacheSpec.parse("visual=calibquant:clip=off").visual
    assert off.clips == (1.0, 1.0) and str(off) == "calibquant:clip=off"
    assert CalibQuant(clip="manual", clip_k=0.7, clip_v=0.9).clips == (0.7, 0.9)
    assert CalibQuant(clip="manual").clips == (1.0, 1.0)
    for clip in ("authors", "off"):  # factors without clip=manual would be silently ignored: refused instead
        with pytest.raises(ValueError, match="clip=manual"):
            CalibQuant(clip=clip, clip_v=0.3)
    with pytest.raises(ValueError, match="clip=manual"):
        CacheSpec.parse("visual=calibquant:clip_k=0.5")
    with pytest.raises(ValueError, match="clip"):
        CalibQuant(clip="centre")


def test_alignedkv_needs_a_power_of_two_head_dim_of_at_least_16():
    for d in (16, 32, 64, 128, 256):
        AlignedKV().check(d, 2)
    for d in (8, 12, 24, 48, 96):
        with pytest.raises(ValueError, match="head_dim"):
            AlignedKV().check(d, 2)


def test_skvq_variant_names_artifact_tables_and_head_dim_rule():
    assert SKVQ(reorder=False).variant() == "nat"
    assert SKVQ(reorder=False, groups="fixed").variant() == "nat"
    assert SKVQ(groups="fixed").variant() == "fix" and SKVQ(groups="variable").variant() == "var"
    assert table_names("k", 128, "var", 2) == {"perm": "k.perm.g128", "gid": "k.gid.g128", "alpha": "k.alpha.var.g128.b2"}
    SKVQ(group=128).check(64, 2)   # the group shrinks to the head: g = min(group, head_dim)
    SKVQ(group=16).check(48, 2)
    for d in (20, 36):             # g = head_dim divides, but it is not a multiple of 8
        with pytest.raises(ValueError, match="multiple"):
            SKVQ(group=128).check(d, 2)
    with pytest.raises(ValueError, match="multiple"):
        SKVQ(group=32).check(48, 2)  # 48 % 32


def test_aquakv_calibrate_command_names_only_non_default_flags():
    assert AquaKV().calibrate_command("m") == "mmkv-calibrate aquakv --model m --bits 2 --quantizer higgs"
    # group and seed do not shape higgs's artifact, so its command never names them
    assert AquaKV(group=32, seed=3).calibrate_command("m") == "mmkv-calibrate aquakv --model m --bits 2 --quantizer higgs"
    assert AquaKV(quantizer="uniform", group=32, seed=3).calibrate_command("m").endswith("uniform --group 32")
    cmd = AquaKV(bits=3, quantizer="hadamard", first_bits=2, group=32, seed=7).calibrate_command("org/M")
    assert cmd == ("mmkv-calibrate aquakv --model org/M --bits 3 --quantizer hadamard"
                   " --first-bits 2 --group 32 --seed 7")
    assert AquaKV().predictor_nbytes() == 0  # nothing bound yet


ADAPTER = SimpleNamespace(name="tiny", num_layers=3, num_kv_heads=1, head_dim=16)


def save_tau(tmp_path, model="tiny"):
    tau = torch.tensor([[0.0, 3.0], [1.0, 2.0], [2.0, 2.0]])
    art = artifacts.Artifact("calibquant", model, artifacts.shape_of(ADAPTER), {"layer_tau": tau},
                             {"tau1": 1.0, "tau2": 3.0})
    return art.save(tmp_path / model)


def test_spec_names_the_fitted_tau_per_model_or_per_layer(tmp_path):
    folder = save_tau(tmp_path)
    per_model = CacheSpec.parse(f"visual=calibquant:bits=1,tau_fit=model,artifact={folder}").visual.bind(ADAPTER)
    assert per_model.calib == (1.0, 3.0) and per_model.for_layer(1, 3).calib == (1.0, 3.0)
    per_layer = CacheSpec.parse(f"visual=calibquant:bits=1,tau_fit=layer,artifact={folder}").visual.bind(ADAPTER)
    assert [per_layer.for_layer(i, 3).calib for i in range(3)] == [(0.0, 3.0), (1.0, 2.0), (2.0, 2.0)]
    off = CacheSpec.parse("visual=calibquant:bits=1").visual.bind(ADAPTER)
    assert off.calib == (0.0, 3.0) and off.for_layer(1, 3) is off


def test_missing_or_foreign_artifact_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="mmkv-calibrate calibquant --model tiny"):
        CacheSpec.parse(f"visual=calibquant:tau_fit=model,artifact={tmp_path / 'none'}").visual.bind(ADAPTER)
    other = save_tau(tmp_path, "other")
    with pytest.raises(ValueError, match="made for model 'other'"):
        CacheSpec.parse(f"visual=calibquant:tau_fit=model,artifact={other}").visual.bind(ADAPTER)
    with pytest.raises(ValueError, match="tau_fit"):
        CacheSpec.parse("visual=calibquant:tau_fit=head")


def test_aquakv_higgs_checks_whole_bytes_not_the_group():
    AquaKV().check(48, 2)  # group 64 does not divide 48, but higgs never uses it
    with pytest.raises(ValueError, match="divisible by 8"):
        AquaKV().check(36, 2)
    with pytest.raises(ValueError, match="group=64"):
        AquaKV(quantizer="uniform").check(48, 2)
    assert AquaKV().config() == {"bits": 2, "first_bits": 4, "quantizer": "higgs"}
