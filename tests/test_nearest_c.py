"""HIGGS/EDEN rounding's compiled loop (kernels/ops/nearest_c.py) against the torch reference it replaces on the CPU
(``nearest_points`` with ``MMKV_CPU_NATIVE=0``) and against an independent float64 brute force: the chosen point is a
nearest one (its squared distance equals the true minimum within 1e-5 relative, plus 1e-6), and the indices agree with
torch's on at least 99.99% of pairs (they may differ only between two points at the same distance within rounding)."""

from __future__ import annotations

import pytest
import torch

from kernels.decode.cpu_native import library
from kernels.layouts import pack_planes
from kernels.ops.nearest_c import nearest2
from mmkv.methods.aquakv_quant import _grid, _pack_pairs, nearest_points

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the torch path is the only one")


def _min_dist(pairs: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = (pairs.double()[:, None, :] - grid.double()[None]).square().sum(-1)
    return d, d.min(-1).values


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 15, 17, 63, 64, 65, 129, 4099])  # the loop takes blocks of 64
def test_the_loop_picks_a_nearest_grid_point(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    # mostly N(0, 1) as HIGGS feeds it, some pairs far outside the grid and some near grid points
    grid, _ = _grid(bits, "cpu")
    pairs = torch.randn(n, 2, generator=g) * torch.tensor([1.0, 1.3])
    if n > 8:
        pairs[:4] *= 40.0
        pairs[4:8] = grid[torch.randint(0, grid.shape[0], (4,), generator=g)] + 1e-3
    got = nearest2(library(), pairs, grid)
    assert got is not None and got.dtype == torch.uint8 and got.shape == (n,)
    if n == 0:
        return
    assert int(got.max()) < grid.shape[0]
    d, best = _min_dist(pairs, grid)
    chosen = d.gather(1, got.long()[:, None])[:, 0]
    assert torch.all(chosen <= best * (1 + 1e-5) + 1e-6), (chosen - best).max()
    idx, points = nearest2(library(), pairs, grid, points=True)
    assert torch.equal(idx, got) and points.shape == (n, 2)
    assert torch.equal(points, grid[got.long()])  # the chosen points, copied exactly


def test_the_loop_agrees_with_the_torch_reference_and_is_what_nearest_points_uses(monkeypatch):
    g = torch.Generator().manual_seed(7)
    pairs = torch.randn(50001, 2, generator=g)
    for bits in (2, 3, 4):
        fast = nearest_points(pairs, bits)
        monkeypatch.setenv("MMKV_CPU_NATIVE", "0")
        ref = nearest_points(pairs, bits)
        monkeypatch.delenv("MMKV_CPU_NATIVE")
        assert torch.equal(fast, nearest2(library(), pairs, _grid(bits, "cpu")[0]))
        assert (fast != ref).float().mean() <= 1e-4, (bits, int((fast != ref).sum()))


def test_a_tie_goes_to_the_first_point_and_a_nan_to_point_0():
    grid, _ = _grid(4, "cpu")
    grid = grid.clone()
    grid[200] = grid[37]  # an exact duplicate: every pair is as near to 200 as to 37
    g = torch.Generator().manual_seed(3)
    pairs = grid[37] + 1e-2 * torch.randn(70, 2, generator=g)
    pairs[5, 1] = float("nan")
    got = nearest2(library(), pairs, grid).long()
    assert got[5] == 0
    keep = torch.arange(70) != 5
    assert torch.all(got[keep] != 200)
    d, best = _min_dist(pairs[keep], grid)
    assert torch.all(d.gather(1, got[keep][:, None])[:, 0] <= best * (1 + 1e-5) + 1e-6)


def test_the_loop_declines_what_it_cannot_read():
    grid, _ = _grid(2, "cpu")
    pairs = torch.randn(10, 2)
    assert nearest2(None, pairs, grid) is None
    assert nearest2(library(), pairs.double(), grid) is None
    assert nearest2(library(), pairs, torch.randn(257, 2)) is None
    assert nearest2(library(), torch.randn(10, 3), grid) is None
    # a strided view is read as its values, not its storage
    wide = torch.randn(10, 4)
    assert torch.equal(nearest2(library(), wide[:, ::2], grid), nearest2(library(), wide[:, ::2].contiguous(), grid))


# pairs a row whose codes fill whole bytes of every plane (3 bits: a 2-bit and a 1-bit plane, 8 codes a byte)
@pytest.mark.parametrize("bits, pairs", [(2, 2), (2, 96), (3, 4), (3, 96), (4, 1), (4, 7), (4, 96)])
def test_pair_packing_equals_packing_the_interleaved_codes(bits, pairs):
    g = torch.Generator().manual_seed(bits * 100 + pairs)
    idx = torch.randint(0, 1 << (2 * bits), (3, 5, pairs), generator=g).to(torch.uint8)
    mask = (1 << bits) - 1
    want = pack_planes(torch.stack([idx & mask, idx >> bits], -1).flatten(-2), bits, dim=-1)
    got = _pack_pairs(idx, bits)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("native", ["1", "0"])
def test_nearest_points_returns_the_chosen_points(monkeypatch, native):
    monkeypatch.setenv("MMKV_CPU_NATIVE", native)
    pairs = torch.randn(333, 2, generator=torch.Generator().manual_seed(3))
    idx, points = nearest_points(pairs, 2, points=True)
    assert torch.equal(idx, nearest_points(pairs, 2))
    assert torch.equal(points, _grid(2, "cpu")[0][idx.long()])
