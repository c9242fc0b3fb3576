"""Unit tests written to kill mutmut's survivors in the cache, positions, attention, spec and method modules
(docs/TESTING.md). Expected values are computed by hand, in closed form, or by an fp64 reference in this file,
never by the code path under test."""

from __future__ import annotations

import torch

from mmkv.engine import _count_spans


def test_count_spans_of_a_leading_span():
    assert _count_spans(torch.tensor([1, 0, 0, 1])) == 2
