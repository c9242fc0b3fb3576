"""eval/studies/query_precision.py, the numerics study behind docs/KERNELS.md's int8 design note: it compares roundings of
``q*s`` against exact attention, and the ordering it reports (16-bit fixed point in two int8 halves is finer than
fp16, which is finer than one int8) holds on a small instance."""

from __future__ import annotations

from eval.studies.query_precision import ROUNDINGS, study


def test_query_rounding_errors_are_ordered():
    res = study(n=301, D=64, G=3, sharpness=8.0, trials=3, seed=1)
    assert set(res) == set(ROUNDINGS)
    fp16, int16, int8 = (res[k]["median"] for k in ROUNDINGS)
    assert 0 < int16 < fp16 < int8 < 2e-3
