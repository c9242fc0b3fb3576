"""The CPU decode step's split linear layers (kernels/ops/row_linear.py) against torch's own ``F.linear``.

``row_linear`` computes the same dot products as ``F.linear`` through another BLAS entry point (a batched product),
so results are compared with a tolerance rather than bit for bit: at an odd input width (97) MKL blocks the two
products differently, and an fp32 output of magnitude ~10 moves by up to ~3e-6 (rtol and atol 1e-5: 97 products
at fp32's 6e-8 unit roundoff each). The engine test checks that greedy tokens do not move.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.ops import row_linear as rl
from mmkv.engine import Engine


@pytest.mark.parametrize("threads, out, want", [(2, 6, 2), (2, 7, 1), (1, 8, 1), (3, 9, 3), (4, 6, 3), (4, 8, 4),
                                                (4, 5, 1), (0, 8, 1)])
def test_parts_for_takes_the_most_threads_that_divide_the_rows(threads, out, want):
    assert rl.parts_for(out, threads) == want


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-2, 1e-2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_row_linear_matches_f_linear(dtype, rtol, atol, rows, parts, bias):
    g = torch.Generator().manual_seed(rows * 10 + parts)
    o, i = 3 * 2 * 37, 97  # odd input width, output rows divisible by both part counts
    w = torch.randn(o, i, generator=g).to(dtype)
    b = torch.randn(o, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 1, i, generator=g).to(dtype)
    got = rl.row_linear(x, w, b, parts)
    assert got.shape == (rows, 1, o) and got.dtype == dtype and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=rtol, atol=atol)


def test_row_linear_keeps_leading_shape_of_a_flat_input():
    w = torch.randn(10, 7)
    x = torch.randn(7)
    torch.testing.assert_close(rl.row_linear(x, w, None, 2), F.linear(x, w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape, parts", [((9, 4), 2), ((8, 4), 1)])
def test_row_linear_refuses_uneven_or_single_blocks(shape, parts):
    with pytest.raises(ValueError, match="equal blocks"):
        rl.row_linear(torch.randn(1, shape[1]), torch.randn(*shape), None, parts)


def test_row_linear_refuses_a_non_contiguous_weight():
    with pytest.raises(ValueError, match="contiguous"):
        rl.row_linear(torch.randn(1, 4), torch.randn(4, 8).t(), None, 2)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 31, bias=False),
                               torch.nn.Linear(31, 10))


def test_split_linears_install_only_inside_the_block(two_threads, monkeypatch):
    model = _model()
    calls = []
    real = rl.row_linear
    monkeypatch.setattr(rl, "row_linear", lambda *a: calls.append(a[3]) or real(*a))
    x = torch.randn(1, 33)
    want = model(x)
    split = rl.SplitLinears(model)
    # 64 and 10 rows split in two; 31 rows do not divide, so that layer keeps F.linear
    assert sorted(m.out_features for m in split.forwards) == [10, 64]
    with split:
        got = model(x)
        assert calls == [2, 2]
        calls.clear()
        model(torch.randn(rl.MAX_ROWS + 1, 33))  # a prefill-sized input: F.linear
        assert calls == []
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert all("forward" not in m.__dict__ for m in model.modules())
    model(x)
    assert calls == []


def test_split_linears_do_nothing_on_one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert rl.SplitLinears(_model()).forwards == {}
    finally:
        torch.set_num_threads(before)


def test_split_linears_follow_a_change_of_threads(two_threads):
    model = torch.nn.Sequential(torch.nn.Linear(5, 12))
    split = rl.SplitLinears(model)
    assert split.threads == 2
    torch.set_num_threads(3)
    with split:
        assert split.threads == 3 and "forward" in model[0].__dict__
    assert "forward" not in model[0].__dict__


def test_exception_inside_the_block_still_restores(two_threads):
    model = _model()
    with pytest.raises(RuntimeError, match="boom"):
        with rl.SplitLinears(model):
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("spec", ["fp16", "text=kivi:bits=2 window=16 sinks=4"])
def test_engine_tokens_do_not_move_with_split_linears(smollm2, two_threads, monkeypatch, spec):
    eng = Engine(smollm2)
    ids = smollm2.prepare([{"role": "user", "content": "Name three colours of the rainbow."}]).input_ids
    monkeypatch.setenv("MMKV_CPU_GROUP_LINEAR", "0")  # one split per linear (groups: tests/test_cpu_forward.py)
    monkeypatch.setenv("MMKV_CPU_SPLIT_LINEAR", "0")
    plain = eng.generate(ids, spec, max_new_tokens=24)
    calls = []
    real = rl.row_linear
    monkeypatch.setattr(rl, "row_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("MMKV_CPU_SPLIT_LINEAR", "1")
    split = eng.generate(ids, spec, max_new_tokens=24)
    assert plain.tokens.shape[1] >= 8
    # every decode step (all but the prefill's token) ran its 7 linears a layer and the head split, and the
    # prefill its head and its last layer's o_proj, gate, up and down (one row each: the last position only,
    # mmkv/models/last_row.py)
    n_linear = 7 * len(smollm2.model.model.layers) + 1
    assert len(calls) == (split.tokens.shape[1] - 1) * n_linear + 1 + 4
    assert torch.equal(split.tokens, plain.tokens)
