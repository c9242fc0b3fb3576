"""Cache controls -> spec strings, checked against the real method registry and parser."""

from __future__ import annotations

import pytest

from mmkv.ui import spec_controls as sc
from mmkv.ui.fake import FAKE_METHODS


def values_for(slots, **over):
    return [over.get(f"{s.modality}.{s.method}.{s.name}", s.info.get("default")) for s in slots]


def test_fake_registry_spec():
    slots = sc.slots_of(FAKE_METHODS)
    spec = sc.build_spec("calibquant", "kivi", 64, 2, slots, values_for(slots, **{"visual.calibquant.bits": 1}))
    assert spec == "visual=calibquant:bits=1 text=kivi:bits=2 window=64 sinks=2"
    spec = sc.build_spec("calibquant", "fp16", 128, 4, slots,
                         values_for(slots, **{"visual.calibquant.calibrate": False, "visual.calibquant.tau2": 1.5}))
    assert spec == "visual=calibquant:bits=2,calibrate=false,tau2=1.5 window=128 sinks=4"
    assert sc.build_spec("fp16", "fp16", 128, 4, slots, values_for(slots)) == "fp16"


def test_methods_come_from_the_registry_only():
    methods = FAKE_METHODS + [{"name": "newmethod", "modalities": ["text"], "params": {}, "needs_artifact": False}]
    assert [m["name"] for m in sc.methods_for(methods, "text")] == ["kivi", "aquakv", "newmethod"]
    assert sc.default_method(methods, "text") == "kivi"
    assert sc.default_method([m for m in methods if m["name"] != "kivi"], "text") == "aquakv"


def test_artifact_note_names_the_command():
    note = sc.artifact_note(FAKE_METHODS, ["calibquant", "aquakv"], "demo-llava")
    assert "aquakv" in note and "demo-llava" in note and "calibquant" not in note


def test_format_value():
    assert sc.format_value(True) == "true" and sc.format_value(2.0, "int") == "2"
    assert sc.format_value(0.25, "float") == "0.25" and sc.format_value(3.0, "float") == "3"


def test_real_registry_round_trips():
    mmkv = pytest.importorskip("mmkv")
    methods = mmkv.methods.describe()
    slots = sc.slots_of(methods)
    vis = sc.default_method(methods, "visual")
    txt = sc.default_method(methods, "text")
    for m in sc.methods_for(methods, "visual"):
        for b in (m["params"].get("bits", {}).get("choices") or [None]):
            over = {f"visual.{m['name']}.bits": b} if b is not None else {}
            spec = sc.build_spec(m["name"], txt, 128, 4, slots, values_for(slots, **over))
            assert sc.check_spec(spec) == "", spec
            parsed = mmkv.CacheSpec.parse(spec)
            if b is not None:
                assert parsed.visual.bits == b
    assert sc.check_spec(sc.build_spec(vis, txt, 32, 0, slots, values_for(slots))) == ""


def test_every_text_method_of_the_real_registry_builds_a_valid_spec():
    """The text picker offers each registered text method (SKVQ, AQUA-KV, AlignedKV included) with its knobs; the
    spec the controls build parses back to that method with every offered choice of its first knob."""
    mmkv = pytest.importorskip("mmkv")
    methods = mmkv.methods.describe()
    slots = sc.slots_of(methods)
    names = [m["name"] for m in sc.methods_for(methods, "text")]
    assert {"kivi", "xquant", "skvq", "aquakv", "alignedkv"} <= set(names), names
    for m in sc.methods_for(methods, "text"):
        params = m["params"]
        knob = next((k for k, v in params.items() if v.get("choices")), None)
        for c in (params[knob]["choices"] if knob else [None]):
            over = {f"text.{m['name']}.{knob}": c} if knob else {}
            spec = sc.build_spec("calibquant", m["name"], 128, 4, slots, values_for(slots, **over))
            assert sc.check_spec(spec) == "", spec
            parsed = mmkv.CacheSpec.parse(spec)
            assert parsed.text.name == m["name"]
            if knob:
                assert getattr(parsed.text, knob) == c, spec


def test_bits_not_offered_is_a_clear_message():
    pytest.importorskip("mmkv")
    msg = sc.check_spec("visual=calibquant:bits=3")
    assert msg.startswith("Invalid cache spec") and "allowed" in msg
    assert "empty" in sc.check_spec("  ")
    assert sc.check_spec("fp16") == ""
