"""The decode plan refuses segment layouts its kernels cannot tile, by name and as ``ValueError`` / ``TypeError``
(``kernels/decode/plan.py``: ``plan_items`` reads shapes only, so these run on the CPU without any kernel)."""

from __future__ import annotations

import pytest
import torch

from kernels import testing
from kernels.decode.plan import plan_items


def _plan(seg, B=2, H=2, G=4, D=64, gluon=False):
    q = torch.zeros(B, H * G, D, dtype=torch.float16)
    return plan_items(q, [seg], B, H, G, D, 132, gluon, 2, True, None, None, 64)


@pytest.mark.parametrize("bits,block,ok", [(1, 8, False), (2, 8, False), (1, 16, True), (2, 16, True), (1, 32, True)])
def test_channel_block_under_16_tokens_is_refused(bits, block, ok):
    """The Triton channel kernel tiles a multi-block channel segment by its block: under 16 tokens it cannot."""
    g = torch.Generator().manual_seed(bits * 100 + block)
    seg = testing.channel_seg(2, 2, 96, 64, bits, block=block, g=g)
    if ok:
        items = _plan(seg)[0]
        assert items[0]["tt"] <= block and items[0]["tt"] % (8 // bits) == 0
    else:
        with pytest.raises(ValueError, match=f"channel block {block} is too small"):
            _plan(seg)


@pytest.mark.parametrize("block,group", [(8, 32), (48, 32), (32, 24)])
def test_kivi_block_and_group_must_be_powers_of_two(block, group):
    g = torch.Generator().manual_seed(block + group)
    seg = testing.kivi_seg(2, 2, 96, 64, [96, 50], 2, 2, 32, 32, g=g)
    seg = type(seg)(**{**seg.__dict__, "block": block, "group": group})
    with pytest.raises(ValueError, match=f"KIVI block {block} and group {group}"):
        _plan(seg)


def test_unknown_segment_type_is_refused():
    class Odd:
        lens = torch.zeros(2, dtype=torch.int32)
        k = torch.zeros(2, 2, 8, 64)

    with pytest.raises(TypeError, match="unknown segment type Odd"):
        _plan(Odd())
