import pytest

import mmkv
from mmkv.methods import KIVI, CalibQuant, describe
from mmkv.spec import CacheSpec


def test_parse_and_round_trip():
    s = CacheSpec.parse("visual=calibquant:bits=1,tau2=2 text=kivi:bits=2,group=32 window=64 sinks=5")
    assert isinstance(s.visual, CalibQuant) and s.visual.bits == 1 and s.visual.tau2 == 2.0
    assert isinstance(s.text, KIVI) and s.text.bits == 2 and s.text.group == 32
    assert (s.window, s.sinks) == (64, 5)
    assert CacheSpec.parse(str(s)) == s


def test_defaults_and_fp16():
    s = CacheSpec.parse("fp16")
    assert s.is_fp16 and (s.window, s.sinks) == (128, 4)
    assert CacheSpec.parse("text=kivi").text == KIVI(bits=2, group=32)


@pytest.mark.parametrize("text,match", [
    ("text=kivi:bits=3", r"bits=3 is not supported; allowed values: \[1, 2, 4, 8\]"),
    ("visual=calibquant:bits=5", "allowed values"),
    ("text=calibquant:bits=1", "does not handle text tokens"),
    ("visual=nosuch", r"unknown cache method 'nosuch'; available: \["),
    ("text=kivi:group=x", "not a valid int"),
    ("text=kivi:bitz=2", "unknown parameter 'bitz'"),
    ("window=-1", "window and sinks must be >= 0"),
    ("colour=red", "unknown spec field"),
    ("visual", "is not key=value"),
])
def test_invalid_specs_name_the_allowed_values(text, match):
    with pytest.raises(ValueError, match=match):
        CacheSpec.parse(text)


def test_group_must_divide_head_dim():
    with pytest.raises(ValueError, match="must divide the model's head_dim=48"):
        mmkv.MMKVCache("text=kivi:group=32", num_layers=2, head_dim=48)


def test_registry_describes_methods_for_the_app():
    by_name = {m["name"]: m for m in describe()}
    assert {"fp16", "kivi", "calibquant"} <= set(by_name)
    cq = by_name["calibquant"]
    assert cq["modalities"] == ["visual"]
    assert cq["params"]["bits"]["choices"] == [1, 2, 4, 8] and cq["params"]["bits"]["default"] == 1
    assert cq["params"]["tau2"]["default"] == 3.0
    assert by_name["kivi"]["params"]["group"]["default"] == 32
