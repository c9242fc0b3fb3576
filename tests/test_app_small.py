"""Issue 32, item 5: what a user reads in the app, checked without a browser (the wiring: tests/browser)."""

from __future__ import annotations

import pandas as pd

from mmkv.ui import stats
from mmkv.ui.blocks import methods_markdown, plain_number
from mmkv.ui.compare import token_pieces
from mmkv.ui.spec_controls import check_spec, controls_for, registry, slots_of


class ByteTokenizer:
    """Each id is one byte of UTF-8, as byte-level BPE splits a rare character."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class Out:
    def __init__(self, ids):
        self.tokens = [ids]


def test_token_diff_never_splits_a_character():
    ids = list("café ok".encode())  # é is two bytes, so two tokens
    eng = type("E", (), {"tokenizer": ByteTokenizer()})()
    pieces = token_pieces("café ok", Out(ids), eng)
    assert pieces == ["c", "a", "f", "é", " ", "o", "k"] and "\ufffd" not in "".join(pieces)


def test_methods_tab_writes_numbers_as_a_person_does():
    assert plain_number(1 / 6) == "0.1667" and plain_number(3.0) == "3" and plain_number(True) == "true"
    md = methods_markdown(registry())
    assert "eta1=0.1667" in md and "0.16666" not in md


def test_typed_spec_sets_the_controls():
    order = slots_of(registry())
    vis, txt, window, sinks, *knobs = controls_for("visual=calibquant:bits=2,tau2=1 text=xquant:kq=28 window=64",
                                                   order)
    assert (vis, txt, window, sinks) == ("calibquant", "xquant", 64, 4)
    got = {(s.method, s.name): v for s, v in zip(order, knobs, strict=True)}
    assert got[("calibquant", "bits")] == 2 and got[("calibquant", "tau2")] == 1.0 and got[("xquant", "kq")] == 28
    assert got[("kivi", "bits")] == 2  # a method not in the spec keeps its defaults
    assert check_spec("visual=calibquant:bits=3").startswith("Invalid cache spec")


def test_bar_axis_tops_the_tallest_bar():
    assert stats.nice_top(pd.DataFrame({"run": ["a", "b"], "v": [17.01, 8.09]})) == 20
    assert stats.nice_top(pd.DataFrame({"run": ["a"], "v": [0.3]})) == 0.5
    assert stats.nice_top(pd.DataFrame(columns=["run", "v"])) is None
