"""docs/KERNELS.md's switch table is ``kernels.switches.SWITCHES``: the same names in the same order, the same
defaults and the same meanings (the docs may put code names in backticks). Thirteen meanings had drifted apart before
this test (e.g. ``MMKV_TEXT_RING``'s default said "none" in the code and "3 stages ... at head_dim 64" in the docs;
``plan.text_ring`` does the latter)."""

from __future__ import annotations

import re
from pathlib import Path

from kernels.switches import SWITCHES

DOC = Path(__file__).resolve().parent.parent / "docs" / "KERNELS.md"
ROW = re.compile(r"\| `([A-Z_0-9]+)` \| `(.*?)` \| (.*) \|$")


def _rows() -> list[tuple[str, str, str]]:
    text = DOC.read_text()
    table = text[text.index("## Switches"):text.index("## API")]
    return [(m[1], m[2], m[3].replace("`", "")) for m in map(ROW.match, table.splitlines()) if m]


def test_kernels_doc_lists_every_switch_in_order():
    assert [r[0] for r in _rows()] == list(SWITCHES)


def test_kernels_doc_defaults_and_meanings_are_the_code_s():
    for name, default, meaning in _rows():
        assert default == (SWITCHES[name].default or "(empty)"), name
        assert meaning == SWITCHES[name].meaning, name
